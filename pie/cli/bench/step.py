"""`pie bench step`: one decode step of the torch driver, timed and split by operation, with pie's
compiled CPU kernels (layer operations, in-place decode attention) and with torch's operations
and gathered attention, the two interleaved round by round in one process."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from typing import Any

from pie.cli.bench import spread

_INT4_LINEARS = ("::linear", "::linear_tiled")
SPLIT = (
    ("int4 layers", lambda name: name.startswith("pie_q4") and name.endswith(_INT4_LINEARS)),
    ("Q8_0 head", lambda name: name.endswith(("::linear8", "::linear8_tiled"))),
    ("int8 layers", lambda name: name == "aten::_int_mm"),
    ("float linears", lambda name: name == "aten::linear"),
    ("attention kernel", lambda name: name.startswith("pie_attention")),
    ("attention (sdpa)", lambda name: name == "aten::scaled_dot_product_attention"),
    ("KV gather/copy", lambda name: name in ("aten::index_select", "aten::index_copy_")),
    ("layer kernels", lambda name: name.startswith("pie_layer")),
)
"""Profiler op names -> the part of a step they are (the rest is Python and small ops)."""
MODES = ("compiled", "torch")


def run_bench_step(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    for mode in MODES:
        entry = figures[mode]
        step = entry["step_ms"]
        print(f"{mode:<9} step {step['median']:.2f} ms [{step['min']:.2f}-{step['max']:.2f}]")
        for part, ms in entry["split_ms"].items():
            print(f"  {part:<18}{ms:8.2f} ms")
    print(f"ratio (torch / compiled, per round): {figures['ratio']['median']:.2f}")
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pie.config import EngineConfig, with_overrides
    from pie.drivers.cpu_layers import cpu_layer_kernels
    from pie.drivers.factory import build_torch_driver
    from pie.drivers.models.layers import TORCH_KERNELS

    model = {
        "weights": args.weights,
        "activations": args.activations,
        **({"path": args.model} if args.model else {}),
    }
    pages = args.batch * 2 * (-(-(args.context + args.rounds * args.steps * 2) // 16) + 1)
    config = with_overrides(EngineConfig(), model=model, kv={"num_pages": pages, "page_size": 16})
    driver, _ = build_torch_driver(config)
    compiled = cpu_layer_kernels()
    steps = {
        mode: _Steps(driver, args.batch, args.context, offset) for offset, mode in enumerate(MODES)
    }
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    splits: dict[str, Counter[str]] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            driver.model.use_kernels(compiled if mode == "compiled" else TORCH_KERNELS)
            driver.in_place_decode = mode == "compiled"
            times[mode].append(steps[mode].timed(args.steps))
            splits[mode] = steps[mode].profiled(max(args.steps // 4, 1))
    driver.model.use_kernels(compiled)
    driver.in_place_decode = True
    ratios = [t / c for t, c in zip(times["torch"], times["compiled"], strict=True)]
    figures: dict[str, Any] = {
        "batch": args.batch,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "ratio": spread(ratios),
    }
    for mode in MODES:
        figures[mode] = {"step_ms": spread(times[mode]), "split_ms": dict(splits[mode])}
    return figures


class _Steps:
    """`batch` contexts prefilled with `context` tokens, then stepped one token at a time."""

    def __init__(self, driver: Any, batch: int, context: int, offset: int) -> None:
        from pie.events.sampling import Argmax, SamplingSlot

        self.driver = driver
        self.slots = (SamplingSlot(index=0, op=Argmax()),)
        span = driver.info.num_pages // (2 * batch)
        first = offset * batch * span
        self.pages = [tuple(range(first + c * span, first + (c + 1) * span)) for c in range(batch)]
        self.length = 0
        # Prefilled a context at a time: a whole batch of prompts may pass max_batch_tokens.
        for c in range(batch):
            self._forward({c: tuple(range(100 + c, 100 + c + context))})
        self.length = context

    def _forward(self, tokens: dict[int, tuple[int, ...]]) -> None:
        from pie.drivers.batch import ForwardBatch
        from pie.events.forward import ForwardRequest

        start = self.length
        end = start + len(next(iter(tokens.values())))
        size = self.driver.info.page_size
        requests = [
            ForwardRequest(
                corr=c,
                requester="bench",
                context=c,
                tokens=ids,
                positions=tuple(range(start, end)),
                kv_start=start,
                pages=self.pages[c][: -(-end // size)],
                slots=self.slots,
            )
            for c, ids in tokens.items()
        ]
        self.driver.forward(ForwardBatch.from_requests(requests))

    def step(self) -> None:
        self._forward({c: (5,) for c in range(len(self.pages))})
        self.length += 1

    def timed(self, count: int) -> float:
        """The median milliseconds of `count` steps, after two unmeasured ones."""
        self.step()
        self.step()
        seconds = []
        for _ in range(count):
            started = time.perf_counter()
            self.step()
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds) * 1e3

    def profiled(self, count: int) -> Counter[str]:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(count):
                self.step()
        split: Counter[str] = Counter()
        for event in prof.key_averages():
            part = next((part for part, matches in SPLIT if matches(event.key)), None)
            if part is not None:
                split[part] += event.cpu_time_total / count / 1e3
        return Counter({part: round(ms, 3) for part, ms in split.most_common()})
