"""`pie bench`: engine decode and prefill speed on the configured model, next to transformers'
`generate` on the same machine in the same run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import trio

from pie.actors.generate import generate
from pie.drivers.memory import peak_resident_mb
from pie.engine import Engine, open_engine
from pie.events.sampling import Argmax

_TEXT = (
    "The history of computing is a story of people who wanted machines to do arithmetic for "
    "them, and then of machines that began to do far more than arithmetic. "
)


def _prompt(tokenizer: Any, length: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        ids.extend(tokenizer.encode(_TEXT))
    return ids[:length]


async def _engine_figures(engine: Engine, args: argparse.Namespace) -> dict[str, float]:
    tok = engine.tokenizer
    n = args.decode_tokens
    async with engine.requester("bench") as req:
        await generate(req, _prompt(tok, 16), max_tokens=4, sampler=Argmax())
        one = await generate(req, _prompt(tok, 16), max_tokens=n, sampler=Argmax())
        prefill = min(
            [
                (
                    await generate(
                        req, _prompt(tok, args.prefill_tokens), max_tokens=1, sampler=Argmax()
                    )
                )
                for _ in range(2)
            ],
            key=lambda g: g.prefill_seconds,
        )
    concurrent, batched = await concurrent_decode(engine, args.concurrency, n)
    return {
        "decode_tps_batch1": (len(one.tokens) - 1) / one.decode_seconds,
        "decode_tps_16": concurrent,
        "prefill_tps": args.prefill_tokens / prefill.prefill_seconds,
        "mean_batch_size_concurrent": batched,
    }


async def concurrent_decode(engine: Engine, concurrency: int, tokens: int) -> tuple[float, float]:
    """Tokens per second of `concurrency` greedy decodes at once through requesters (the
    engine's own loop, no inferlet), and the mean number of requests per pass."""
    tok = engine.tokenizer
    results: list[Any] = []

    async def one_stream(i: int) -> None:
        async with engine.requester(f"bench:{i}") as r:
            prompt = _prompt(tok, 16 + i)
            results.append(await generate(r, prompt, max_tokens=tokens, sampler=Argmax()))

    before = engine.statistics().scheduler
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(one_stream, i)
    wall = time.perf_counter() - started
    after = engine.statistics().scheduler
    batched = (after.requests - before.requests) / max(1, after.batches - before.batches)
    return sum(len(g.tokens) for g in results) / wall, batched


def _hf_figures(engine: Engine, args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from pie.drivers.loader import resolve_model

    dtype = getattr(torch, engine.info.dtype)
    model: Any = AutoModelForCausalLM.from_pretrained(
        resolve_model(engine.config.model.path), dtype=dtype
    )
    model.eval()
    n = args.decode_tokens
    short = torch.tensor([_prompt(engine.tokenizer, 16)])
    long = torch.tensor([_prompt(engine.tokenizer, args.prefill_tokens)])

    def timed(ids: torch.Tensor, tokens: int) -> float:
        started = time.perf_counter()
        model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )
        return time.perf_counter() - started

    with torch.inference_mode():
        timed(short, 4)
        first = min(timed(short, 1) for _ in range(2))
        total = timed(short, n)
        prefill = min(timed(long, 1) for _ in range(2))
    return {
        "hf_decode_tps_batch1": (n - 1) / (total - first),
        "hf_prefill_tps": args.prefill_tokens / prefill,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pie.cli.options import engine_config

    config = engine_config(args)
    figures: dict[str, Any] = {}

    async def main() -> None:
        async with open_engine(config) as engine:
            figures.update(_run_info(engine))
            figures.update(await _engine_figures(engine, args))
            figures["peak_rss_mb"] = peak_resident_mb()
            if not args.no_hf:
                figures.update(await trio.to_thread.run_sync(_hf_figures, engine, args))

    trio.run(main)
    if "hf_decode_tps_batch1" in figures:
        figures["ratio_decode_batch1"] = (
            figures["decode_tps_batch1"] / figures["hf_decode_tps_batch1"]
        )
        figures["ratio_decode_16_vs_hf_batch1"] = (
            figures["decode_tps_16"] / figures["hf_decode_tps_batch1"]
        )
        figures["ratio_prefill"] = figures["prefill_tps"] / figures["hf_prefill_tps"]
    return figures


def _run_info(engine: Engine) -> dict[str, Any]:
    import torch

    return {
        "model": engine.info.model_name,
        "device": engine.info.device,
        "dtype": engine.info.dtype,
        "torch_threads": torch.get_num_threads(),
        "kv_pages": engine.info.num_pages,
        "page_size": engine.info.page_size,
    }


def run_bench(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    rows = [
        (
            "decode tokens/s, batch 1",
            "decode_tps_batch1",
            "hf_decode_tps_batch1",
            "ratio_decode_batch1",
        ),
        (
            f"decode tokens/s, {args.concurrency} concurrent",
            "decode_tps_16",
            "hf_decode_tps_batch1",
            "ratio_decode_16_vs_hf_batch1",
        ),
        (
            f"prefill tokens/s ({args.prefill_tokens})",
            "prefill_tps",
            "hf_prefill_tps",
            "ratio_prefill",
        ),
    ]
    print(
        f"{figures['model']} on {figures['device']} ({figures['dtype']}), "
        f"{figures['torch_threads']} threads",
        file=sys.stderr,
    )
    print(f"{'':<34}{'pie':>10}{'transformers':>14}{'ratio':>8}")
    for label, ours, theirs, ratio in rows:
        hf = figures.get(theirs)
        print(f"{label:<34}{figures[ours]:>10.1f}{(hf or 0):>14.1f}{figures.get(ratio, 0):>8.2f}")
    print(f"{'mean batch size (concurrent)':<34}{figures['mean_batch_size_concurrent']:>10.1f}")
    print(f"{'peak resident memory (MB)':<34}{figures['peak_rss_mb']:>10.0f}")
    return 0
