"""`pie bench agents`: an agent loop with simulated tool I/O, run two ways on one engine.

Each task alternates generation and a tool call (an HTTP request to a local server that takes
`--tool-ms`) `--calls` times, `--tasks` tasks at once. In the engine, one inferlet per task keeps
its context and calls the tool through the `http` interface, so the KV cache stays warm and only
each tool result is prefilled. On the client, each task re-sends its whole conversation to the
OpenAI-compatible endpoint every step and calls the tool itself; the engine's prefix cache
then spares it the prefill of every full page the earlier steps computed (the hits are in each
mode's `prefix_hit_tokens`). Both generate the same number of tokens per step (stop tokens
ignored).
"""

from __future__ import annotations

import argparse
import http.server
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import trio

from pie.cli.bench.inferlets import cached_component, component_from_source
from pie.config import HttpConfig, with_overrides
from pie.engine import Engine, open_engine
from pie.server.http import HttpFront
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER, Mounts

PROMPT = "You are an agent. Use the tool, then say what you learned in a few words."

AGENT_SOURCE = '''"""The in-engine agent: generate, call the tool, append its result, repeat."""

from inferlet import Context, Sampler, get_model, http


async def main(input):
    with Context(get_model()) as ctx:
        ctx.user(input["prompt"]).cue()
        for step in range(input["calls"]):
            await ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
            result = (await http.get(f"{input['tool']}?step={step}")).text()
            ctx.user(f"Tool result: {result}").cue()
        return await ctx.generate(Sampler.argmax(), max_tokens=input["tokens"], stop_tokens=[])
'''


class _Tool(http.server.BaseHTTPRequestHandler):
    delay = 0.05

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802  (the stdlib's name)
        time.sleep(self.delay)
        body = json.dumps({"path": self.path, "value": 42}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextmanager
def tool_server(delay: float) -> Iterator[str]:
    """A local HTTP tool that answers after `delay` seconds; yields its URL."""
    handler = type("Tool", (_Tool,), {"delay": delay})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/tool"
    finally:
        server.shutdown()
        server.server_close()


async def _in_engine(engine: Engine, program: str, tool: str, args: Any) -> list[float]:
    request = {"prompt": PROMPT, "calls": args.calls, "tokens": args.tokens, "tool": tool}
    latencies: list[float] = []

    async def task() -> None:
        started = time.perf_counter()
        outcome = await engine.run_inferlet(program, json.dumps(request))
        if not outcome.ok:
            raise RuntimeError(f"the agent inferlet ended {outcome.status}: {outcome.error}")
        latencies.append(time.perf_counter() - started)

    async with trio.open_nursery() as nursery:
        for _ in range(args.tasks):
            nursery.start_soon(task)
    return latencies


async def _client_loop(base: str, model: str, tool: str, args: Any) -> list[float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=args.tasks * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def step(messages: list[dict[str, str]]) -> str:
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": args.tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = await client.post(f"{base}/chat/completions", json=body)
            reply.raise_for_status()
            text: str = reply.json()["choices"][0]["message"]["content"]
            return text

        async def task() -> None:
            started = time.perf_counter()
            messages = [{"role": "user", "content": PROMPT}]
            for n in range(args.calls):
                messages.append({"role": "assistant", "content": await step(messages)})
                result = (await client.get(f"{tool}?step={n}")).text
                messages.append({"role": "user", "content": f"Tool result: {result}"})
            await step(messages)
            latencies.append(time.perf_counter() - started)

        async with trio.open_nursery() as nursery:
            for _ in range(args.tasks):
                nursery.start_soon(task)
    return latencies


def _summary(latencies: list[float], wall: float, args: Any) -> dict[str, float]:
    tokens = args.tasks * (args.calls + 1) * args.tokens
    return {
        "wall_s": wall,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
        "tasks_per_s": args.tasks / wall,
        "tokens_per_s": tokens / wall,
    }


async def _measure(engine: Engine, args: Any) -> dict[str, Any]:
    agent = engine.programs.add(component_from_source("agent-loop", AGENT_SOURCE), name="agent")
    server = engine.programs.add(cached_component(OPENAI_SERVER), name="openai-server")
    front = HttpFront(
        engine, HttpConfig(port=0), Mounts({OPENAI_PREFIX: server.hash}), host="127.0.0.1"
    )
    results: dict[str, Any] = {}
    with tool_server(args.tool_ms / 1000) as tool:
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            base = f"{front.url}{OPENAI_PREFIX}"
            # Compiles both components and warms the model before anything is timed.
            warm = argparse.Namespace(**{**vars(args), "tasks": 1, "calls": 1})
            await _in_engine(engine, agent.hash, tool, warm)
            await _client_loop(base, engine.info.model_name, tool, warm)
            for mode in ("in_engine", "client_loop"):
                before = engine.statistics().kv
                started = time.perf_counter()
                if mode == "in_engine":
                    latencies = await _in_engine(engine, agent.hash, tool, args)
                else:
                    model = engine.info.model_name
                    latencies = await _client_loop(base, model, tool, args)
                results[mode] = _summary(latencies, time.perf_counter() - started, args)
                after = engine.statistics().kv
                results[mode]["prefix_hit_tokens"] = (
                    after.prefix_hit_tokens - before.prefix_hit_tokens
                )
                _progress(mode, results[mode])
            front.stop()
            nursery.cancel_scope.cancel()
    results["speedup"] = results["client_loop"]["wall_s"] / results["in_engine"]["wall_s"]
    return results


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pie.cli.options import engine_config

    config = with_overrides(
        engine_config(args),
        event_log={"enabled": False},
        network={"allow": ("127.0.0.1",)},
        # A whole task is one inferlet here: on a slow machine it may well take minutes.
        sandbox={"budget_seconds": 3600.0},
    )

    async def main() -> dict[str, Any]:
        driver = tokenizer = None
        if args.pass_ms is not None:
            from pie.drivers.loader import resolve_model
            from pie.drivers.synthetic import SyntheticDriver
            from pie.drivers.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_folder(resolve_model(config.model.path or None))
            driver = SyntheticDriver(
                pass_seconds=args.pass_ms / 1000, vocab_size=tokenizer.vocab_size
            )
        async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
            return await _measure(engine, args)

    return trio.run(main)


def _progress(mode: str, row: dict[str, float]) -> None:
    import sys

    print(f"  {mode}: {row['wall_s']:.1f} s for all tasks", file=sys.stderr)


def run_bench_agents(args: argparse.Namespace) -> int:
    results = measure(args)
    if args.json:
        print(json.dumps(results))
        return 0
    what = "the configured model" if args.pass_ms is None else f"a fixed {args.pass_ms} ms pass"
    print(
        f"{args.tasks} tasks x {args.calls} tool calls ({args.tool_ms:g} ms each),"
        f" {args.tokens} tokens per step, on {what}"
    )
    print(
        f"{'mode':<13}{'wall s':>8}{'mean s':>8}{'p50 s':>8}{'max s':>8}{'tasks/s':>9}{'tok/s':>8}"
        f"{'cached':>8}"
    )
    for mode in ("in_engine", "client_loop"):
        row = results[mode]
        print(
            f"{mode:<13}{row['wall_s']:>8.2f}{row['latency_mean_s']:>8.2f}"
            f"{row['latency_p50_s']:>8.2f}{row['latency_max_s']:>8.2f}"
            f"{row['tasks_per_s']:>9.2f}{row['tokens_per_s']:>8.1f}{row['prefix_hit_tokens']:>8}"
        )
    print(f"client loop / in engine (wall time): {results['speedup']:.2f}x")
    return 0
