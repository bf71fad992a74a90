"""`pie bench peers`: pie against llama.cpp (llama-cpp-python, in its own cached environment)
on the same GGUF weights at matching precision, each engine in its own process, interleaved
rounds: batch-1 decode, 16-sequence aggregate decode, prefill, and peak resident memory."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from attrs import frozen

from pie.cli.bench import spread
from pie.cli.bench.peer_models import at_precision
from pie.drivers.loader.resolve import default_gguf_path

PEER_HOME = Path.home() / ".cache" / "pie" / "peers"
PEER_PACKAGE = "llama-cpp-python==0.3.36"
RUNNER = Path(__file__).resolve().parents[3] / "scenarios" / "peers" / "llama_cpp_peer.py"
Runs = dict[str, dict[str, list[dict[str, Any]]]]
"""Per precision, per engine ("pie", "peer"), each round's figures."""
FIGURES = ("decode_tps_batch1", "decode_tps_16", "prefill_tps", "peak_rss_mb")
RATIOS = {
    "ratio_decode_batch1": "decode_tps_batch1",
    "ratio_decode_16": "decode_tps_16",
    "ratio_prefill": "prefill_tps",
    "ratio_rss": "peak_rss_mb",
}


@frozen
class Pair:
    """One precision both engines run: pie's settings and the peer's GGUF precision."""

    name: str
    pie: tuple[str, ...]
    """Options for `pie bench`."""
    peer: str


PAIRS = (
    Pair("f32", ("--dtype", "float32", "--weights", "dtype"), "F32"),
    Pair("bf16", ("--dtype", "bfloat16", "--weights", "dtype"), "BF16"),
    Pair("int8/q8_0", ("--dtype", "float32", "--weights", "int8"), "Q8_0"),
    # llama.cpp multiplies Q4_1 weights with activations quantized to 8-bit blocks (Q8_1): pie's
    # int8 activations are the same precision.
    Pair("int4/q4_1", ("--dtype", "float32", "--weights", "int4", "--activations", "int8"), "Q4_1"),
    Pair("int4-exact/q4_1", ("--dtype", "float32", "--weights", "int4"), "Q4_1"),
)
SHARED_BEST = "int4/q4_1"
"""The most compact precision both engines run (the file's own Q4_1 blocks in both, with
activations in 8-bit blocks): where the headline ratios are taken."""


def peer_python(args: argparse.Namespace) -> Path:
    """The peer environment's interpreter, built first when `--setup` asks for it."""
    python = Path(args.peer_python) if args.peer_python else PEER_HOME / "venv" / "bin" / "python"
    if python.is_file():
        return python
    if not args.setup:
        raise SystemExit(
            f"pie: no llama.cpp environment at {python}; run `pie bench peers --setup` once "
            "(it compiles llama.cpp: about 35 minutes on 2 cores)"
        )
    build_peer(python.parent.parent)
    return python


def build_peer(venv: Path) -> None:
    print(f"pie: building {PEER_PACKAGE} into {venv} (compiles llama.cpp)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PEER_PACKAGE]
    subprocess.run(pip, check=True, env=env)


def _json_of(command: list[str]) -> dict[str, Any]:
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    figures: dict[str, Any] = json.loads(done.stdout)
    return figures


def run_pie(pair: Pair, model: Path, args: argparse.Namespace, config: Path) -> dict[str, Any]:
    command = [
        *(sys.executable, "-m", "pie.cli", "bench", "--json", "--no-hf"),
        *("--model", str(model), "--config", str(config), *pair.pie),
        *("--decode-tokens", str(args.decode_tokens)),
        *("--prefill-tokens", str(args.prefill_tokens)),
        *("--concurrency", str(args.concurrency)),
    ]
    return _json_of(command)


def run_peer(python: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's figures; run again without its repacked weight buffers when the CPU turns
    out not to execute what they use (AMX reported by a virtual CPU that traps it)."""
    command = [
        *(str(python), str(RUNNER), "--model", str(model), "--threads", str(args.threads)),
        *("--decode-tokens", str(args.decode_tokens)),
        *("--prefill-tokens", str(args.prefill_tokens)),
        *("--concurrency", str(args.concurrency)),
    ]
    try:
        return {**_json_of(command), "extra_buffers": True}
    except subprocess.CalledProcessError as failed:
        if failed.returncode != -signal.SIGILL:
            raise
    return {**_json_of([*command, "--no-extra-buffers"]), "extra_buffers": False}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    python = peer_python(args)
    source = Path(args.model) if args.model else default_gguf_path()
    pairs = [p for p in PAIRS if p.name in args.precisions]
    files = {p.peer: at_precision(source, p.peer, PEER_HOME / "models") for p in pairs}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        p.name: {"pie": [], "peer": []} for p in pairs
    }
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bench.toml"
        config.write_text(f"[driver]\nthreads = {args.threads}\n")
        for round_ in range(args.rounds):
            for i, pair in enumerate(pairs):
                order = ["pie", "peer"] if (round_ + i) % 2 == 0 else ["peer", "pie"]
                for engine in order:
                    figures = (
                        run_pie(pair, source, args, config)
                        if engine == "pie"
                        else run_peer(python, files[pair.peer], args)
                    )
                    runs[pair.name][engine].append(figures)
                    print(f"pie: round {round_ + 1} {pair.name} {engine} done", file=sys.stderr)
    return summarise(runs, args)


def summarise(
    runs: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Medians and ranges per engine and precision, and pie-over-peer ratios taken round by
    round (each round's two runs were side by side)."""
    out: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds, "precisions": {}}
    for name, engines in runs.items():
        entry: dict[str, Any] = {}
        for engine, figures in engines.items():
            if figures:
                entry[engine] = {key: spread([f[key] for f in figures]) for key in FIGURES}
        if engines["pie"] and engines["peer"]:
            for ratio, key in RATIOS.items():
                pairs = zip(engines["pie"], engines["peer"], strict=True)
                entry[ratio] = spread([ours[key] / theirs[key] for ours, theirs in pairs])
        out["precisions"][name] = entry
    peer_runs = [f for engines in runs.values() for f in engines["peer"]]
    out["peer_extra_buffers"] = all(f.get("extra_buffers", True) for f in peer_runs)
    best = out["precisions"].get(SHARED_BEST, {})
    for ratio in RATIOS:
        if ratio in best:
            out[ratio] = best[ratio]["median"]
    out["ratio_precision"] = SHARED_BEST
    return out


def run_bench_peers(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    labels = ("decode b1 tok/s", "decode x16 tok/s", "prefill tok/s", "peak RSS MB")
    print(f"{'precision':<12}{'engine':<8}" + "".join(f"{label:>22}" for label in labels))
    for name, entry in figures["precisions"].items():
        for engine in ("pie", "peer"):
            if engine not in entry:
                continue
            cells = [entry[engine][key] for key in FIGURES]
            row = "".join(
                f"{c['median']:>10.1f} [{c['min']:.0f}-{c['max']:.0f}]".rjust(22) for c in cells
            )
            who = "pie" if engine == "pie" else "llama.cpp"
            print(f"{name:<12}{who:<8}{row}")
        ratios = [entry[r]["median"] for r in RATIOS if r in entry]
        if ratios:
            print(f"{'':<12}{'ratio':<8}" + "".join(f"{r:>22.2f}" for r in ratios))
    return 0
