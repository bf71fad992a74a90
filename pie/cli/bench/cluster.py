"""`pie bench cluster`: the prefix-heavy chat workload of chat_load.py through the SGLang router
in front of pie nodes, `cache_aware` against `round_robin` and 2 nodes against 1, in interleaved
rounds (a fresh router per round, fresh prompts per round); throughput, time to first token and
the nodes' prefix hit rate per configuration, and paired ratios with medians and ranges."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import psutil
import trio

from pie.cli.bench import spread
from pie.cli.bench.chat_load import (
    Workload,
    chat_requests,
    counters,
    round_figures,
    run_round,
    settled_counters,
)

METRICS = ("tokens_per_s", "requests_per_s", "first_token_p50_ms", "first_token_p99_ms")
Config = tuple[int, str]
"""(nodes, router policy)."""


def configurations(nodes: Sequence[int], policies: Sequence[str]) -> list[Config]:
    """Every node count with every policy; one node only with the first policy (a router with
    one node sends it everything, whatever its policy)."""
    return [(n, p) for n in sorted(set(nodes)) for p in (policies if n > 1 else policies[:1])]


def label(config: Config) -> str:
    nodes, policy = config
    return f"{nodes} node{'s' if nodes > 1 else ''}, {policy}"


async def _round(router: str, nodes: Sequence[str], bodies: list[dict[str, Any]], c: int) -> Any:
    before = await trio.to_thread.run_sync(counters, nodes)
    results, wall = await run_round(f"{router}/v1", bodies, c)
    after = await settled_counters(nodes, before, len(bodies))
    return round_figures(results, wall, before, after)


def _measure_round(
    config: Config, urls: Sequence[str], args: argparse.Namespace, model: str, rng: random.Random
) -> dict[str, Any]:
    from pie.cluster.router import RouterProcess, RouterSettings

    nodes, policy = config
    bodies = chat_requests(_workload(args), model, rng)
    settings = RouterSettings(workers=tuple(urls[:nodes]), policy=policy)
    with RouterProcess.start(settings) as router:
        figures: dict[str, Any] = trio.run(
            _round, router.url, urls[:nodes], bodies, args.concurrency
        )
    return figures


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(
        requests=args.requests,
        users=args.users,
        prompts=args.prompts,
        prompt_words=args.prompt_words,
        tokens=args.tokens,
        concurrency=args.concurrency,
    )


def _warm(urls: Sequence[str], model: str) -> None:
    """One short request to each node: its first launch compiles and loads the OpenAI program,
    which no round should pay."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for url in urls:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()


def _rounds(urls: Sequence[str], args: argparse.Namespace) -> dict[str, Any]:
    model = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]
    _warm(urls, model)
    configs = configurations(args.nodes, args.policies)
    rng = random.Random(args.seed)
    # One whole round over every node, unmeasured: the first ran at half speed in trials.
    print("pie: warm-up round", file=sys.stderr)
    _measure_round((max(args.nodes), "round_robin"), urls, args, model, rng)
    rounds: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        # Each repeat starts with another configuration, so none always runs first.
        order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
        for config in order:
            print(f"pie: round {repeat + 1}/{args.repeats}: {label(config)}", file=sys.stderr)
            rounds[config].append(_measure_round(config, urls, args, model, rng))
    return {"model": model, "rounds": rounds}


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {m: spread([r[m] for r in rounds]) for m in METRICS}
    summary["prefix_hit_rate"] = spread([r["prefix_hit_rate"] for r in rounds])
    return summary


def _ratio(top: list[dict[str, Any]], bottom: list[dict[str, Any]], metric: str) -> Any:
    """Per repeat, `top`'s figure over `bottom`'s (paired rounds), as a median and range."""
    pairs = [(t[metric], b[metric]) for t, b in zip(top, bottom, strict=True) if b[metric]]
    return spread([t / b for t, b in pairs]) if pairs else None


def ratios(rounds: dict[Config, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """cache_aware over round_robin at each node count, and the most nodes over one node."""
    found = []
    wanted = []
    counts = sorted({n for n, _ in rounds})
    for n in counts[1:]:
        if (n, "cache_aware") in rounds and (n, "round_robin") in rounds:
            wanted.append(((n, "cache_aware"), (n, "round_robin")))
    if len(counts) > 1:
        policy = next(p for n, p in rounds if n == counts[0])
        if (counts[-1], policy) in rounds:
            wanted.append(((counts[-1], policy), (counts[0], policy)))
    for top, bottom in wanted:
        row = {"name": f"{label(top)} / {label(bottom)}"}
        for metric in ("tokens_per_s", "first_token_p50_ms", "first_token_p99_ms"):
            row[metric] = _ratio(rounds[top], rounds[bottom], metric)
        found.append(row)
    return found


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The rounds against `args.workers`, or against nodes of a cluster started for them."""
    if args.workers:
        if len(args.workers) < max(args.nodes):
            raise ValueError(f"--nodes {max(args.nodes)} needs that many --workers")
        measured = _rounds(args.workers, args)
    else:
        measured = _on_own_cluster(args)
    rounds = measured["rounds"]
    return {
        "model": measured["model"],
        "workload": attrs.asdict(_workload(args)) | {"repeats": args.repeats},
        "cpus": psutil.cpu_count(),
        "configs": [
            {"nodes": n, "policy": p, "rounds": rounds[(n, p)], **_summary(rounds[(n, p)])}
            for n, p in rounds
        ],
        "ratios": ratios(rounds),
    }


def _on_own_cluster(args: argparse.Namespace) -> dict[str, Any]:
    from pie.cluster.local import LocalCluster, LocalClusterSettings

    with tempfile.TemporaryDirectory(prefix="pie-bench-cluster-") as folder:
        settings = LocalClusterSettings(
            state_dir=folder,
            nodes=max(args.nodes),
            models=tuple(args.model),
            config=args.config,
            env=dict(os.environ),
        )
        print(f"pie: starting {settings.nodes} nodes ...", file=sys.stderr)
        cluster = LocalCluster.start(settings)
        try:
            return _rounds([node.http_url for node in cluster.nodes], args)
        finally:
            cluster.stop()


def run_bench_cluster(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    work = figures["workload"]
    print(
        f"{figures['model']}: {work['requests']} streamed chats per round from {work['users']} "
        f"users under {work['prompts']} system prompts of ~{work['prompt_words']} words, "
        f"{work['tokens']} tokens each, {work['concurrency']} at once; {work['repeats']} rounds"
    )
    print(f"{'configuration':<24}{'tokens/s':>18}{'first p50 ms':>20}{'first p99':>10}{'hits':>7}")
    for config in figures["configs"]:
        tps, p50 = config["tokens_per_s"], config["first_token_p50_ms"]
        print(
            f"{label((config['nodes'], config['policy'])):<24}{_ranged(tps, '.1f'):>18}"
            f"{_ranged(p50, '.0f'):>20}{config['first_token_p99_ms']['median']:>10.0f}"
            f"{config['prefix_hit_rate']['median']:>7.0%}"
        )
    for row in figures["ratios"]:
        parts = [f"{m} {_ranged(row[m], '.2f')}" for m in ("tokens_per_s", "first_token_p50_ms")]
        print(f"{row['name']}: " + ", ".join(p for p in parts if "None" not in p))
    return 0


def _ranged(figure: dict[str, float] | None, form: str) -> str:
    if figure is None:
        return "None"
    low, mid, high = figure["min"], figure["median"], figure["max"]
    return f"{mid:{form}} ({low:{form}}-{high:{form}})"
