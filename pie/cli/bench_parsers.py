"""The command line of `pie bench` and each of its suites."""

from __future__ import annotations

import argparse
from typing import Any

from pie.cli.options import add_engine_options

Commands = Any


def add_bench_parsers(commands: Commands) -> None:
    """`bench` (engine speed against transformers) and its suites."""
    bench = commands.add_parser("bench", help="measure decode/prefill speed against transformers")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--decode-tokens", type=int, default=64)
    bench.add_argument("--concurrency", type=int, default=16)
    bench.add_argument("--prefill-tokens", type=int, default=256)
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    add_engine_options(bench)
    suites = bench.add_subparsers(
        dest="suite",
        metavar="[inferlets | serve | tax | agents | gpu | decoding | metrics | cluster]",
    )
    _bench_inferlets_parser(suites)
    _bench_decoding_parser(suites)
    _bench_agents_parser(suites)
    _bench_tax_parser(suites)
    _bench_serve_parser(suites)
    _bench_gpu_parser(suites)
    _bench_peers_parser(suites)
    _bench_step_parser(suites)
    _bench_media_parser(suites)
    _bench_log_parser(suites)
    _bench_metrics_parser(suites)
    _bench_cluster_parser(suites)


def _bench_inferlets_parser(suites: Commands) -> None:
    inferlets = suites.add_parser(
        "inferlets", help="runtime overhead per token, launch latency and memory of inferlets"
    )
    inferlets.add_argument("--json", action="store_true", help="print one JSON object")
    inferlets.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    inferlets.add_argument("--tokens", type=int, default=64, help="tokens per measured run")
    inferlets.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    inferlets.add_argument("--repeats", type=int, default=3)
    inferlets.add_argument("--idle", type=int, default=16, help="idle inferlets to weigh")


def _bench_decoding_parser(suites: Commands) -> None:
    decoding = suites.add_parser(
        "decoding",
        help="decoding strategies against their plain forms",
    )
    decoding.add_argument("--json", action="store_true", help="print one JSON object")
    decoding.add_argument("--tokens", type=int, default=48, help="tokens per measured run")
    decoding.add_argument("--concurrency", type=int, default=4, help="branches decoding at once")
    decoding.add_argument("--repeats", type=int, default=3)
    decoding.add_argument("--draft-tokens", type=int, default=4, help="lookup: drafted per pass")
    decoding.add_argument("--n", type=int, default=8, help="best-of-n: branches")
    decoding.add_argument(
        "--long-tokens", type=int, default=4000, help="window: tokens of the long generation"
    )
    decoding.add_argument(
        "--window-tokens", type=int, default=256, help="window: tokens the window keeps"
    )
    families = ["structured", "lookup", "best-of-n", "window"]
    decoding.add_argument("--families", nargs="+", choices=families, default=families)
    add_engine_options(decoding)


def _bench_agents_parser(suites: Commands) -> None:
    agents = suites.add_parser(
        "agents", help="an agent loop with tool calls: in the engine vs a client re-sending"
    )
    agents.add_argument("--json", action="store_true", help="print one JSON object")
    agents.add_argument("--tasks", type=int, default=16, help="agent tasks at once")
    agents.add_argument("--calls", type=int, default=8, help="tool calls per task")
    agents.add_argument("--tool-ms", type=float, default=50.0, help="how long a tool call takes")
    agents.add_argument("--tokens", type=int, default=8, help="tokens generated per step")
    agents.add_argument(
        "--pass-ms", type=float, help="a fixed-time forward pass instead of the configured model"
    )
    add_engine_options(agents)


def _bench_tax_parser(suites: Commands) -> None:
    tax = suites.add_parser(
        "tax", help="exposed runtime time per token at each speculation depth (fixed-time pass)"
    )
    tax.add_argument("--json", action="store_true", help="print one JSON object")
    tax.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    tax.add_argument("--tokens", type=int, default=256, help="tokens each generation makes")
    tax.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    tax.add_argument("--depths", type=int, nargs="+", default=[0, 1, 4])
    tax.add_argument(
        "--mode",
        nargs="+",
        choices=["run", "step", "step-poll"],
        default=["run", "step"],
        help="generation runs; stepped generations (one host call a step); stepped with "
        "something else pending on the inferlet's loop (three host calls a step)",
    )
    tax.add_argument("--think-us", type=float, default=0.0, help="step mode: busy work per token")
    tax.add_argument("--repeats", type=int, default=3)
    tax.add_argument("--slow-path", action="store_true", help="also run with the fast path off")
    tax.add_argument("--real", action="store_true", help="the configured model, not a fixed pass")
    add_engine_options(tax)


def _bench_log_parser(suites: Commands) -> None:
    log = suites.add_parser(
        "log", help="decode throughput with the event log off, in memory, in a file, recording"
    )
    log.add_argument("--json", action="store_true", help="print one JSON object")
    log.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    log.add_argument("--tokens", type=int, default=1024, help="tokens each generation makes")
    log.add_argument("--concurrency", type=int, default=16, help="inferlets decoding at once")
    log.add_argument("--repeats", type=int, default=5)
    log.add_argument(
        "--settings",
        nargs="+",
        choices=["off", "ring", "file", "record", "file-thread", "record-thread"],
        default=["off", "ring", "file", "record"],
        help="record: the file with every inferlet's host calls recorded; -thread: the file "
        "encoded on the writer thread ([event_log] encoder = thread)",
    )
    add_engine_options(log)


def _bench_serve_parser(suites: Commands) -> None:
    serve = suites.add_parser(
        "serve", help="latency and throughput of streamed completions through pie serve"
    )
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    serve.add_argument(
        "--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients per round"
    )
    serve.add_argument("--tokens", type=int, default=32, help="max_tokens of each completion")
    serve.add_argument("--server", help="measure this server (ws://HOST:PORT) instead of a new one")
    serve.add_argument("--model", help="model for the started server (default: the configured)")


def _bench_gpu_parser(suites: Commands) -> None:
    gpu = suites.add_parser(
        "gpu", help="CUDA driver decode and prefill on random-weight models, against the roofline"
    )
    gpu.add_argument("--json", action="store_true", help="print one JSON object")
    gpu.add_argument(
        "--shapes", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"], help="model shapes"
    )
    gpu.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    gpu.add_argument("--tokens", type=int, default=256, help="decode steps per context")
    gpu.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length for prefill")
    gpu.add_argument(
        "--compare-graphs", action="store_true", help="also decode without CUDA graphs (up to 64)"
    )
    gpu.add_argument(
        "--profile", type=int, default=0, metavar="ROWS", help="print a host profile's top rows"
    )
    gpu.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="ROWS",
        help="print the kernels with the most device time in eager decode steps at the highest "
        "concurrency",
    )


def _bench_step_parser(suites: Commands) -> None:
    step = suites.add_parser(
        "step", help="one decode step split by operation, compiled kernels against torch's ops"
    )
    step.add_argument("--json", action="store_true", help="print one JSON object")
    step.add_argument("--batch", type=int, default=1, help="contexts decoding together")
    step.add_argument("--context", type=int, default=64, help="tokens in each context at start")
    step.add_argument("--steps", type=int, default=40, help="timed steps per mode and round")
    step.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    step.add_argument("--model", help="a model (default: the embedded SmolLM2-135M)")
    step.add_argument("--weights", choices=["auto", "dtype", "int8", "int4"], default="auto")
    step.add_argument("--activations", choices=["float32", "int8"], default="float32")


def _bench_media_parser(suites: Commands) -> None:
    media = suites.add_parser(
        "media", help="media decoding, preprocessing and encoders, and image requests at once"
    )
    media.add_argument("--json", action="store_true", help="print one JSON object")
    media.add_argument("--repeats", type=int, default=5, help="timed runs (rounds) of each")
    media.add_argument(
        "--image-sizes",
        type=_size,
        nargs="+",
        default=[(640, 480), (1280, 960)],
        metavar="WxH",
        help="picture sizes; the first is also the video's and the engine requests'",
    )
    media.add_argument("--audio-seconds", type=float, default=10.0, help="length of the clip")
    media.add_argument("--requests", type=int, default=8, help="image requests through the engine")
    media.add_argument("--tokens", type=int, default=16, help="greedy tokens after each picture")
    media.add_argument("--hidden", type=int, default=256, help="decoder width")
    media.add_argument("--layers", type=int, default=4, help="decoder layers")
    media.add_argument("--vision-dim", type=int, default=256, help="encoder width")
    media.add_argument("--vision-depth", type=int, default=4, help="encoder layers")
    media.add_argument("--patch", type=int, default=14, help="vision patch size in pixels")
    media.add_argument("--cache-dir", help="where the random models are kept")


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    try:
        return int(width), int(height)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, got {text!r}") from None


def _bench_peers_parser(suites: Commands) -> None:
    peers = suites.add_parser(
        "peers", help="pie against llama.cpp on the same GGUF weights at matching precisions"
    )
    peers.add_argument("--json", action="store_true", help="print one JSON object")
    peers.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    peers.add_argument("--threads", type=int, default=1, help="CPU threads for both engines")
    peers.add_argument("--decode-tokens", type=int, default=128)
    peers.add_argument("--prefill-tokens", type=int, default=512)
    peers.add_argument("--concurrency", type=int, default=16)
    precisions = ["f32", "bf16", "int8/q8_0", "int4/q4_1", "int4-exact/q4_1"]
    peers.add_argument("--precisions", nargs="+", choices=precisions, default=precisions)
    peers.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M)")
    peers.add_argument(
        "--setup", action="store_true", help="build the llama.cpp environment when missing"
    )
    peers.add_argument("--peer-python", help="a Python with llama-cpp-python installed")


def _bench_metrics_parser(suites: Commands) -> None:
    metrics = suites.add_parser(
        "metrics", help="/metrics scrape latency, and decode speed with and without a scraper"
    )
    metrics.add_argument("--json", action="store_true", help="print one JSON object")
    metrics.add_argument("--pass-ms", type=float, default=5.0, help="fixed forward pass time")
    metrics.add_argument("--concurrency", type=int, default=16, help="inferlets decoding at once")
    metrics.add_argument("--tokens", type=int, default=256, help="tokens each inferlet makes")
    metrics.add_argument("--repeats", type=int, default=5, help="rounds of each, interleaved")
    metrics.add_argument(
        "--scrape-ms", type=float, default=100.0, help="time between one scrape and the next"
    )


def _bench_cluster_parser(suites: Commands) -> None:
    cluster = suites.add_parser(
        "cluster", help="a prefix-heavy chat load through the router: cache_aware vs round_robin"
    )
    cluster.add_argument("--json", action="store_true", help="print one JSON object")
    cluster.add_argument("--nodes", type=int, nargs="+", default=[1, 2], help="node counts")
    cluster.add_argument(
        "--policies",
        nargs="+",
        choices=["cache_aware", "round_robin", "random", "power_of_two"],
        default=["cache_aware", "round_robin"],
        help="router policies (default: cache_aware round_robin)",
    )
    cluster.add_argument("--requests", type=int, default=32, help="chats per round")
    cluster.add_argument("--users", type=int, default=16, help="users sending them")
    cluster.add_argument("--prompts", type=int, default=4, help="system prompts they share")
    cluster.add_argument(
        "--prompt-words", type=int, default=200, help="about how long a system prompt is"
    )
    cluster.add_argument("--tokens", type=int, default=8, help="max_tokens of each reply")
    cluster.add_argument("--concurrency", type=int, default=4, help="chats in flight at once")
    cluster.add_argument("--repeats", type=int, default=3, help="rounds of each configuration")
    cluster.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    cluster.add_argument(
        "--workers",
        nargs="+",
        metavar="URL",
        help="measure these nodes (their HTTP fronts, http://HOST:PORT) instead of starting some",
    )
    cluster.add_argument("--config", help="engine config file (TOML) for the started nodes")
    cluster.add_argument(
        "--model", action="append", default=[], metavar="[NAME=]PATH", help="as for pie serve"
    )
