"""A prefix-heavy chat workload for `pie bench cluster`: many users asking short questions under
a few long system prompts, streamed through an OpenAI endpoint; one round's throughput, time to
first token, and the nodes' prefix-cache hits read from their /metrics."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import numpy as np
import trio
from prometheus_client.parser import text_string_to_metric_families

QUESTIONS = (
    "What should I pack for a weekend hike?",
    "Summarise the rules above in one sentence.",
    "Give me a name for a grey cat.",
    "How do I boil an egg?",
    "Which is larger, a lake or a sea?",
    "Suggest a title for a short story.",
    "What is a good first programming language?",
    "Name a fruit that is yellow.",
)
WORDS = (
    "service guidance policy answer careful polite brief customer account order shipping "
    "refund warranty product support detail request record clear helpful friendly safety"
).split()
COUNTERS = (
    "pie_kv_prefix_hit_tokens_total",
    "pie_prefill_tokens_total",
    "pie_inferlets_ended_total",
)


@attrs.frozen(kw_only=True)
class Workload:
    requests: int
    users: int
    prompts: int
    """Distinct system prompts the requests share."""
    prompt_words: int
    """About how long each system prompt is (a word is about a token)."""
    tokens: int
    """max_tokens of each reply."""
    concurrency: int


def system_prompts(workload: Workload, rng: random.Random) -> list[str]:
    """Fresh prompts for one round: a nonce up front keeps one round's prefixes from being
    cached by another."""
    nonce = rng.getrandbits(48)
    return [
        f"Session {nonce:x}, assistant {k}. "
        + " ".join(rng.choice(WORDS) for _ in range(workload.prompt_words))
        for k in range(workload.prompts)
    ]


def chat_requests(workload: Workload, model: str, rng: random.Random) -> list[dict[str, Any]]:
    """The round's requests in a shuffled order: in a fixed order, `round_robin` over N nodes
    would send every request of a prompt to one node whenever N divides the prompt count."""
    prompts = system_prompts(workload, rng)
    bodies = [
        {
            "model": model,
            "messages": [
                {"role": "system", "content": prompts[i % workload.prompts]},
                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
            ],
            "max_tokens": workload.tokens,
            "temperature": 0,
            "stream": True,
            "user": f"user-{i % workload.users}",
        }
        for i in range(workload.requests)
    ]
    rng.shuffle(bodies)
    return bodies


@attrs.frozen(kw_only=True)
class Streamed:
    first_token_s: float
    chunks: int


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any]) -> Streamed:
    """One streamed chat completion: seconds to its first piece of text, and its pieces."""
    started = time.perf_counter()
    first = 0.0
    chunks = 0
    async with client.stream("POST", "/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            text = (await reply.aread()).decode(errors="replace")[:200]
            raise RuntimeError(f"the router answered {reply.status_code}: {text}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                chunks += 1
                first = first or time.perf_counter() - started
    if not chunks:
        raise RuntimeError("a streamed chat completion brought no text")
    return Streamed(first_token_s=first, chunks=chunks)


async def run_round(base_url: str, bodies: Sequence[dict[str, Any]], concurrency: int) -> Any:
    """Sends `bodies` with `concurrency` in flight; the replies and the wall time."""
    results: list[Streamed] = []
    pending = list(reversed(bodies))
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while pending:
                results.append(await stream_one(client, pending.pop()))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        wall = time.perf_counter() - started
    return results, wall


def counters(node_urls: Sequence[str]) -> list[dict[str, float]]:
    """Each node's prefix-cache and inferlet counters, from its /metrics."""
    read = []
    for url in node_urls:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        found = dict.fromkeys(COUNTERS, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in found:
                    found[sample.name] += sample.value
        read.append(found)
    return read


async def settled_counters(
    node_urls: Sequence[str], before: list[dict[str, float]], requests: int
) -> list[dict[str, float]]:
    """The counters once they count every request of the round (a node refreshes them on an
    interval, so they may lag its replies a moment)."""
    with trio.move_on_after(30):
        while True:
            now = await trio.to_thread.run_sync(counters, node_urls)
            ended = sum(
                n["pie_inferlets_ended_total"] - b["pie_inferlets_ended_total"]
                for n, b in zip(now, before, strict=True)
            )
            if ended >= requests:
                return now
            await trio.sleep(0.25)
    raise RuntimeError("the nodes' /metrics did not count the round's requests within 30 s")


def round_figures(
    results: list[Streamed],
    wall: float,
    before: list[dict[str, float]],
    after: list[dict[str, float]],
) -> dict[str, Any]:
    """Throughput, time to first token and prefix hit rate of one round."""
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    hits = sum(d["pie_kv_prefix_hit_tokens_total"] for d in delta)
    run = sum(d["pie_prefill_tokens_total"] for d in delta)
    firsts = [r.first_token_s * 1e3 for r in results]
    p50, p99 = np.percentile(np.asarray(firsts), [50, 99])
    return {
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r.chunks for r in results) / wall,
        "first_token_p50_ms": float(p50),
        "first_token_p99_ms": float(p99),
        "first_token_mean_ms": statistics.fmean(firsts),
        "prefix_hit_rate": hits / (hits + run) if hits + run else 0.0,
        "requests_per_node": [int(d["pie_inferlets_ended_total"]) for d in delta],
    }
