"""`pie bench decoding`: what the decoding library's strategies cost or save on the configured
model, each against its plain counterpart, interleaved in one run. `structured`: a generation
held to a JSON schema by the grammar engine against the same generation unconstrained.
`lookup`: speculative decoding with prompt-lookup (and Jacobi) drafts against plain greedy
generation, on an answer that quotes its prompt. `best-of-n`: n branches forked off one
prefilled prompt against n separate prompts (time and peak KV pages). `window`: a long generation
with attention sinks and a sliding window against the same generation with full attention (time
and peak KV pages), and what the window costs in prediction: the mean log-probability of the
next token over a page of prose read through the window, with and without sinks, against full
attention."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import trio

from pie.build import SDK
from pie.cli.bench.inferlets import cached_component
from pie.config import with_overrides
from pie.engine import Engine, open_engine

STRUCTURED_OUTPUT = SDK / "examples" / "structured-output"
SPECULATIVE = SDK / "examples" / "speculative-decoding"
BEST_OF_N = SDK / "examples" / "best-of-n"
ATTENTION_WINDOW = SDK / "examples" / "attention-window"
PROSE = SDK.parent / "docs" / "architecture.md"
LONG_PROMPT = "Summarise this in one sentence: " + " ".join(
    ["the tide comes in over the flats and goes out again by the old harbour wall"] * 24
)
QUOTING = (
    "Copy the following list exactly: apple, banana, cherry, date, elderberry, fig, grape, "
    "honeydew, kiwi, lemon, mango, nectarine."
)
NUMBERS = {
    "type": "object",
    "properties": {
        "readings": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 4096,
        }
    },
    "required": ["readings"],
}
"""A schema no generation completes within the benchmark's tokens: every step is constrained."""
PROMPT = "Write a long list of sensor readings as JSON."


async def _run(engine: Engine, program: str, request: dict[str, Any]) -> tuple[float, int]:
    """Wall time of one run of the example, and the tokens its branches generated."""
    started = time.perf_counter()
    outcome = await engine.run_inferlet(program, json.dumps(request))
    wall = time.perf_counter() - started
    if not outcome.ok or outcome.result is None:
        raise RuntimeError(f"the benchmark inferlet failed: {outcome.error}")
    outputs = json.loads(outcome.result)["outputs"]
    return wall, sum(out["tokens"] for out in outputs)


async def _per_token(
    engine: Engine, program: str, request: dict[str, Any], tokens: int
) -> tuple[float, int]:
    """Seconds per generated token from a short and a long run (launch and prefill cancel out),
    and the tokens of the long run."""
    short_wall, short_tokens = await _run(engine, program, {**request, "max_tokens": 2})
    long_wall, long_tokens = await _run(engine, program, {**request, "max_tokens": tokens})
    return (long_wall - short_wall) / max(1, long_tokens - short_tokens), long_tokens


async def _structured(engine: Engine, program: str, args: argparse.Namespace) -> dict[str, Any]:
    base = {"prompt": PROMPT, "n": args.concurrency, "temperature": 0}
    modes = {"unconstrained": base, "schema": {**base, "schema": NUMBERS}}
    grammars = engine.inferlets.models[0].grammars
    assert grammars is not None
    for request in modes.values():  # warm-up: compiles the grammar, builds the tokenizer
        await _run(engine, program, {**request, "max_tokens": 4})
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, int] = {}
    before = grammars.statistics()
    for _ in range(args.repeats):
        for mode, request in modes.items():
            per_token, tokens[mode] = await _per_token(engine, program, request, args.tokens)
            seconds[mode].append(per_token)
    after = grammars.statistics()
    ratios = [s / u for s, u in zip(seconds["schema"], seconds["unconstrained"], strict=True)]
    masks = after.masks - before.masks
    return {
        "concurrency": args.concurrency,
        "tokens": tokens,
        "ms_per_token": {mode: 1e3 * statistics.median(v) for mode, v in seconds.items()},
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "mask_us_per_token": 1e6 * (after.mask_seconds - before.mask_seconds) / max(1, masks),
        "masks": masks,
    }


async def _lookup(engine: Engine, program: str, args: argparse.Namespace) -> dict[str, Any]:
    base = {"prompt": QUOTING, "max_tokens": args.tokens, "draft_tokens": args.draft_tokens}
    methods = ("plain", "lookup", "jacobi")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for method in methods:
            outcome = await engine.run_inferlet(program, json.dumps({**base, "method": method}))
            if not outcome.ok or outcome.result is None:
                raise RuntimeError(f"the benchmark inferlet failed: {outcome.error}")
            if repeat:
                runs[method].append(json.loads(outcome.result))
    plain = runs["plain"]
    row: dict[str, Any] = {"tokens": len(plain[0]["tokens"]), "passes": {}, "seconds": {}}
    for method in methods:
        row["passes"][method] = runs[method][0]["passes"]
        row["seconds"][method] = statistics.median(r["seconds"] for r in runs[method])
        if method != "plain":
            last = runs[method][0]
            speedups = [
                p["seconds"] / r["seconds"] for p, r in zip(plain, runs[method], strict=True)
            ]
            row[method] = {
                "acceptance": last["accepted"] / max(1, last["drafted"]),
                "speedup_median": statistics.median(speedups),
                "speedup_range": [min(speedups), max(speedups)],
                "same_tokens": all(
                    r["tokens"] == p["tokens"] for p, r in zip(plain, runs[method], strict=True)
                ),
            }
    return row


async def settled(engine: Engine, seconds: float = 10.0) -> None:
    """Waits until no context and no lease holds pages (an ended program's last lease is given
    back once its pass in flight ends)."""
    with trio.move_on_after(seconds):
        while (kv := engine.statistics().kv).contexts or kv.leases:
            await trio.sleep(0.005)


async def run_watching_pages(
    engine: Engine, program: str, request: dict[str, Any]
) -> tuple[Any, float, int]:
    """A run's outcome, its wall time, and the most KV pages in use while it ran (polled from
    the kv actor's statistics), once what earlier runs held is back in the pool."""
    await settled(engine)
    stats = engine.statistics().kv
    lowest = stats.pages_free

    async def watch() -> None:
        nonlocal lowest
        while True:
            lowest = min(lowest, engine.statistics().kv.pages_free)
            await trio.sleep(0.002)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        started = time.perf_counter()
        outcome = await engine.run_inferlet(program, json.dumps(request))
        wall = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return outcome, wall, stats.pages_total - lowest


async def _peak_pages(engine: Engine, program: str, request: dict[str, Any]) -> tuple[float, int]:
    outcome, wall, pages = await run_watching_pages(engine, program, request)
    if not outcome.ok:
        raise RuntimeError(f"the benchmark inferlet failed: {outcome.error}")
    return wall, pages


async def _interleaved(
    engine: Engine,
    program: str,
    modes: dict[str, dict[str, Any]],
    repeats: int,
    *,
    reseed: bool = False,
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each mode's wall times over `repeats` interleaved rounds, and its peak KV pages (the
    most over the rounds). With `reseed`, round r draws with seed + r, so that no round writes
    pages an earlier one committed (they would be shared, and counted twice while a lease
    still pins the copy the round wrote)."""
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    pages: dict[str, int] = {m: 0 for m in modes}
    for round_ in range(repeats):
        for mode, request in modes.items():
            if reseed:
                request = {**request, "seed": request["seed"] + round_}
            wall, peak = await _peak_pages(engine, program, request)
            seconds[mode].append(wall)
            pages[mode] = max(pages[mode], peak)
    return seconds, pages


async def _best_of_n(engine: Engine, program: str, args: argparse.Namespace) -> dict[str, Any]:
    base = {"prompt": LONG_PROMPT, "n": args.n, "max_tokens": args.tokens, "seed": 1}
    modes = {"forked": base, "separate": {**base, "separate": True}}
    await _peak_pages(engine, program, {**base, "max_tokens": 2})  # warm-up
    seconds, pages = await _interleaved(engine, program, modes, args.repeats)
    ratios = [s / f for f, s in zip(seconds["forked"], seconds["separate"], strict=True)]
    return {
        "n": args.n,
        "prompt_tokens": len(engine.tokenizer.encode(LONG_PROMPT)),
        "seconds": {m: statistics.median(v) for m, v in seconds.items()},
        "peak_pages": pages,
        "separate_over_forked_median": statistics.median(ratios),
        "separate_over_forked_range": [min(ratios), max(ratios)],
    }


async def _window(engine: Engine, program: str, args: argparse.Namespace) -> dict[str, Any]:
    base = {"prompt": LONG_PROMPT[:200], "max_tokens": args.long_tokens, "seed": 5}
    windowed = {**base, "window_tokens": args.window_tokens, "sink_tokens": 4}
    modes = {"window": windowed, "full": {**base, "window": False}}
    await _peak_pages(engine, program, {**base, "max_tokens": 2})  # warm-up
    seconds, pages = await _interleaved(engine, program, modes, args.repeats, reseed=True)
    text = PROSE.read_text()[:4000]
    reading = {
        "full": {"window": False},
        "sinks": {"window_tokens": args.window_tokens // 2, "sink_tokens": 4},
        "no sinks": {"window_tokens": args.window_tokens // 2, "sink_tokens": 0},
    }
    logprob = {}
    for mode, extra in reading.items():
        request = {"mode": "score", "text": text, **extra}
        outcome = await engine.run_inferlet(program, json.dumps(request))
        if not outcome.ok or outcome.result is None:
            raise RuntimeError(f"the benchmark inferlet failed: {outcome.error}")
        logprob[mode] = json.loads(outcome.result)["mean_logprob"]
    ratios = [f / w for w, f in zip(seconds["window"], seconds["full"], strict=True)]
    return {
        "tokens": args.long_tokens,
        "window_tokens": args.window_tokens,
        "seconds": {m: statistics.median(v) for m, v in seconds.items()},
        "peak_pages": pages,
        "full_over_window_median": statistics.median(ratios),
        "full_over_window_range": [min(ratios), max(ratios)],
        "reading_tokens": len(engine.tokenizer.encode(text)),
        "reading_window_tokens": args.window_tokens // 2,
        "mean_logprob": logprob,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pie.cli.options import engine_config

    config = with_overrides(engine_config(args), event_log={"enabled": False})
    structured = cached_component(STRUCTURED_OUTPUT)
    speculative = cached_component(SPECULATIVE)
    best = cached_component(BEST_OF_N)
    window = cached_component(ATTENTION_WINDOW)

    async def main() -> dict[str, Any]:
        figures: dict[str, Any] = {}
        async with open_engine(config) as engine:
            if "structured" in args.families:
                program = engine.programs.add(structured, name="structured-output").hash
                figures["structured"] = await _structured(engine, program, args)
            if "lookup" in args.families:
                program = engine.programs.add(speculative, name="speculative-decoding").hash
                figures["lookup"] = await _lookup(engine, program, args)
        if "best-of-n" in args.families:
            # Without the prefix cache, so that separate prompts cannot share pages either.
            plain = with_overrides(config, kv={"prefix_cache": "off"})
            async with open_engine(plain) as engine:
                program = engine.programs.add(best, name="best-of-n").hash
                figures["best-of-n"] = await _best_of_n(engine, program, args)
        if "window" in args.families:
            # A long generation on a CPU outlasts the default time budget of one inferlet.
            long = with_overrides(config, sandbox={"budget_seconds": 4 * 3600.0})
            async with open_engine(long) as engine:
                program = engine.programs.add(window, name="attention-window").hash
                figures["window"] = await _window(engine, program, args)
        return figures

    return trio.run(main)


def run_bench_decoding(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    if "structured" in figures:
        _print_structured(figures["structured"], args)
    if "lookup" in figures:
        _print_lookup(figures["lookup"], args)
    if "best-of-n" in figures:
        _print_best_of_n(figures["best-of-n"], args)
    if "window" in figures:
        _print_window(figures["window"], args)
    return 0


def _print_window(row: dict[str, Any], args: argparse.Namespace) -> None:
    low, high = row["full_over_window_range"]
    print(
        f"attention window: {row['tokens']} sampled tokens, a window of {row['window_tokens']}"
        f" tokens plus 4 sink tokens, {args.repeats} interleaved repeats (medians)"
    )
    for mode in ("window", "full"):
        seconds = row["seconds"][mode]
        print(
            f"  {mode:<7}{seconds:>8.1f} s  {row['tokens'] / seconds:>6.1f} tokens/s"
            f"  peak {row['peak_pages'][mode]} KV pages"
        )
    print(f"  full / window time: {row['full_over_window_median']:.2f}x ({low:.2f}-{high:.2f})")
    logprob = row["mean_logprob"]
    print(
        f"  reading {row['reading_tokens']} tokens of prose a page per pass, window"
        f" {row['reading_window_tokens']} tokens: mean next-token logprob full"
        f" {logprob['full']:.3f}, with sinks {logprob['sinks']:.3f},"
        f" without sinks {logprob['no sinks']:.3f}"
    )


def _print_best_of_n(row: dict[str, Any], args: argparse.Namespace) -> None:
    low, high = row["separate_over_forked_range"]
    print(
        f"best-of-{row['n']}: {row['prompt_tokens']}-token prompt, {args.tokens} tokens per"
        f" branch, {args.repeats} interleaved repeats (medians), prefix cache off"
    )
    for mode in ("forked", "separate"):
        print(f"  {mode:<9}{row['seconds'][mode]:>8.2f} s  peak {row['peak_pages'][mode]} KV pages")
    print(f"  separate / forked: {row['separate_over_forked_median']:.2f}x ({low:.2f}-{high:.2f})")


def _print_structured(row: dict[str, Any], args: argparse.Namespace) -> None:
    low, high = row["ratio_range"]
    print(
        f"structured output: {row['concurrency']} branches, {args.tokens} tokens,"
        f" {args.repeats} interleaved repeats (medians)"
    )
    for mode, ms in row["ms_per_token"].items():
        print(f"  {mode:<14}{ms:>8.2f} ms/token  ({row['tokens'][mode]} tokens in the long run)")
    print(f"  schema / unconstrained: {row['ratio_median']:.2f}x (range {low:.2f}-{high:.2f})")
    print(f"  grammar mask: {row['mask_us_per_token']:.0f} us per token over {row['masks']} masks")


def _print_lookup(row: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"speculative decoding: {row['tokens']} greedy tokens, up to {args.draft_tokens} drafted"
        f" per pass, {args.repeats} interleaved repeats (medians)"
    )
    for method in ("plain", "lookup", "jacobi"):
        line = f"  {method:<8}{row['seconds'][method]:>8.2f} s {row['passes'][method]:>5} passes"
        if method != "plain":
            m = row[method]
            low, high = m["speedup_range"]
            line += (
                f"  acceptance {m['acceptance']:.2f}  speed-up {m['speedup_median']:.2f}x"
                f" ({low:.2f}-{high:.2f})  same tokens: {m['same_tokens']}"
            )
        print(line)
