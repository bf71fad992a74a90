"""many-clients: 32 clients, each on its own connection, run greedy text completions at once
against one server; every result must equal its prompt run alone, and the engine must have
batched them together."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for `scenarios._support`

from pie.client import connect  # noqa: E402
from scenarios._support import (  # noqa: E402
    TEXT_COMPLETION,
    install,
    main,
    mean_batch_between,
    result_of,
)

CLIENTS = 32
MAX_TOKENS = 10
PROMPTS = (
    "What is the capital of France?",
    "Name a colour of the rainbow.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
)
MIN_MEAN_BATCH = 2.0


def request(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def run(url: str, cache_dir: Path | None = None) -> dict[str, Any]:
    """The scenario against the server at `url`; `cache_dir` holds built inferlets (default:
    $PIE_CACHE_DIR/inferlets)."""
    return trio.run(_run, url, cache_dir)


async def _run(url: str, cache_dir: Path | None) -> dict[str, Any]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(CLIENTS)]
    async with connect(url) as client:
        program = await install(client, TEXT_COMPLETION, cache_dir)
        alone = {prompt: await result_of(client, program, request(prompt)) for prompt in PROMPTS}
        before = await client.statistics()
        started = time.perf_counter()
        results = await concurrently(url, program, prompts)
        seconds = time.perf_counter() - started
        after = await client.statistics()
    batch = mean_batch_between(before, after)
    mismatched = [i for i, prompt in enumerate(prompts) if results[i] != alone[prompt]]
    return {
        "clients": CLIENTS,
        "prompts": prompts,
        "alone": alone,
        "results": results,
        "mismatched": mismatched,
        "seconds": seconds,
        "passes": after.passes - before.passes,
        "mean_batch_size": batch,
        "checks": {
            f"all {CLIENTS} clients got a result": all(r is not None for r in results),
            "every result equals its prompt run alone": not mismatched,
            f"the clients shared batches (mean batch size >= {MIN_MEAN_BATCH:g})": (
                batch >= MIN_MEAN_BATCH
            ),
        },
    }


async def concurrently(url: str, program: str, prompts: list[str]) -> list[str | None]:
    """One client per prompt, each with its own connection, all at once; their results in order
    (an inferlet that does not return raises)."""
    results: list[str | None] = [None] * len(prompts)

    async def one(index: int) -> None:
        async with connect(url) as client:
            results[index] = await result_of(client, program, request(prompts[index]))

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    return results


def summary(report: dict[str, Any]) -> str:
    done = sum(result is not None for result in report["results"])
    lines = [
        f"{done}/{report['clients']} clients returned in {report['seconds']:.1f} s",
        f"mean batch size {report['mean_batch_size']:.1f} over {report['passes']} passes",
        f"results differing from the prompt run alone: {len(report['mismatched'])}",
    ]
    lines += [f"  {prompt!r} -> {text.strip()!r}" for prompt, text in report["alone"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(__doc__, run, summary))
