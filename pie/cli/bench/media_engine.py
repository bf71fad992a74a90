"""The engine part of `pie bench media`: image requests (a picture then greedy tokens) all at once
against the same requests one after another, the two orders interleaved round by round, each
round with pictures never seen before so that both pay for decoding and encoding."""

from __future__ import annotations

import argparse
import base64
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from pie.cli.bench.inferlets import component_from_source
from pie.cli.bench.media_inputs import jpeg
from pie.config import config_from_dict, with_overrides
from pie.dataplane.former import BatchStatistics
from pie.engine import Engine, open_engine

if TYPE_CHECKING:
    from pie.drivers.media_store import MediaStore

GUEST_SOURCE = '''"""Appends the request's picture to a context and generates greedy tokens."""

import base64

from inferlet import Context, Image, Model, Sampler


async def main(input):
    model = Model.load("")
    image = Image.from_bytes(model, base64.b64decode(input["image"]))
    with Context(model) as ctx:
        ctx.fill_tokens(input["before"])
        await ctx.append_image(image)
        generation = ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
        tokens = await generation.collect_tokens()
    image.free()
    if len(tokens) != input["tokens"]:
        raise ValueError(f"generated {len(tokens)} tokens, not {input['tokens']}")
    return len(tokens)
'''
BEFORE = [28, 1345, 288, 3145]
"""A few text tokens ahead of each picture."""
ORDERS = ("concurrent", "sequential")


async def concurrent_against_sequential(
    folder: Path, args: argparse.Namespace, soft_tokens: int
) -> dict[str, list[float]]:
    """Per order and round (`args.repeats`): wall seconds, mean batch size, generated tokens a
    second and encoder calls, as `<order>_<figure>` lists; and `speedup`, sequential over
    concurrent wall time in each round. Pictures are of the first of `args.image_sizes`,
    `soft_tokens` each."""
    wasm = component_from_source("bench-media", GUEST_SOURCE)
    width, height = args.image_sizes[0]
    figures: dict[str, list[float]] = {"speedup": []}
    async with open_engine(_config(folder, args, soft_tokens)) as engine:
        program = engine.programs.add(wasm, name="bench-media").hash
        await _run_all(engine, program, [_request(jpeg(0, width, height), args)], False)
        for round_ in range(args.repeats):
            order = ORDERS if round_ % 2 == 0 else ORDERS[::-1]
            walls = {}
            for name in order:
                seed = 1 + (2 * round_ + (name == "concurrent")) * args.requests
                pictures = [jpeg(seed + i, width, height) for i in range(args.requests)]
                requests = [_request(p, args) for p in pictures]
                row = await _run_all(engine, program, requests, name == "concurrent")
                row["tokens_per_second"] = args.requests * args.tokens / row["wall_s"]
                for figure, value in row.items():
                    figures.setdefault(f"{name}_{figure}", []).append(value)
                walls[name] = row["wall_s"]
            figures["speedup"].append(walls["sequential"] / walls["concurrent"])
    return figures


def _config(folder: Path, args: argparse.Namespace, soft_tokens: int) -> Any:
    page_size = 16
    per_request = len(BEFORE) + soft_tokens + 2 + args.tokens
    pages = args.requests * (per_request // page_size + 2) + 16
    model = {"name": "vl", "path": str(folder), "dtype": "float32", "device": "cpu"}
    config = config_from_dict(
        {
            "models": [model],
            # One user sends every request here, so that user may fill the pool.
            "kv": {"num_pages": pages, "page_size": page_size, "user_page_share": 1.0},
        }
    )
    return with_overrides(config, event_log={"enabled": False})


def _request(picture: bytes, args: argparse.Namespace) -> str:
    image = base64.b64encode(picture).decode()
    return json.dumps({"image": image, "before": BEFORE, "tokens": args.tokens})


async def _run_all(
    engine: Engine, program: str, requests: list[str], concurrent: bool
) -> dict[str, float]:
    """Wall seconds, mean batch size over the passes they ran, and encoder calls."""
    stack = engine.model()
    store: MediaStore = stack.driver.media  # type: ignore[attr-defined]  # torch drivers only
    before, encodes = stack.inference.batch_statistics(), store.encodes
    started = time.perf_counter()
    runs = [_runner(engine, program, r) for r in requests]
    if concurrent:
        async with trio.open_nursery() as nursery:
            for run in runs:
                nursery.start_soon(run)
    else:
        for run in runs:
            await run()
    return {
        "wall_s": time.perf_counter() - started,
        "mean_batch_size": _mean_batch(before, stack.inference.batch_statistics()),
        "encoder_calls": store.encodes - encodes,
    }


def _runner(engine: Engine, program: str, request: str) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        outcome = await engine.run_inferlet(program, request)
        if not outcome.ok:
            raise RuntimeError(f"the benchmark inferlet failed: {outcome.error or outcome.status}")

    return run


def _mean_batch(before: BatchStatistics, after: BatchStatistics) -> float:
    requests = after.requests - before.requests + after.lane_passes - before.lane_passes
    return requests / max(1, after.batches - before.batches)
