"""Options that several commands share (engine, server connection) and the engine config they
select."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie.config import EngineConfig

DEFAULT_SERVER_URL = "ws://127.0.0.1:8080"
"""Where `pie serve` listens by default ([server] host and port)."""
DEFAULT_CLUSTER_URL = "redis://127.0.0.1:6379"
"""Where `pie cluster` looks for the cluster's Redis unless --cluster or $PIE_CLUSTER says."""


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="engine config file (TOML)")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="HF model directory, .gguf file, or an alias: smollm2-135m, gemma3-270m; repeat "
        "as NAME=PATH to serve several models side by side, the first the default",
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--weights",
        choices=["auto", "dtype", "int8", "int4"],
        help="dtype / int8 / int4: linear weights kept in --dtype, int8, 4-bit blocks (CPU)",
    )
    parser.add_argument(
        "--activations",
        choices=["float32", "int8"],
        help="how int4 weights multiply their inputs: float32 (exact) or int8 blocks (AVX-512 "
        "VNNI, as llama.cpp does)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="run the model on N tensor-parallel ranks (processes on torch.distributed)",
    )
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load the PEFT LoRA adapter folder PATH as NAME; repeatable",
    )


def add_cluster_url_option(parser: argparse.ArgumentParser) -> None:
    cluster = os.environ.get("PIE_CLUSTER", DEFAULT_CLUSTER_URL)
    parser.add_argument(
        "--cluster", default=cluster, metavar="URL", help=f"the Redis (default: {cluster})"
    )


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    server = os.environ.get("PIE_SERVER", DEFAULT_SERVER_URL)
    parser.add_argument("--server", default=server, help=f"WebSocket URL (default: {server})")
    parser.add_argument("--user", default=os.environ.get("PIE_USER"), help="authenticate as")
    parser.add_argument("--token", default=os.environ.get("PIE_TOKEN"), help="a user's token")
    parser.add_argument("--key", help="sign the server's challenge with this private key")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The config file named by --config (or the defaults) with --model, --dtype, --device,
    --weights, --activations, --tensor-parallel and --adapter."""
    from pie.config import load_config, with_overrides

    config = load_config(args.config)
    config = _with_models(config, getattr(args, "model", None) or [])
    adapters = dict(config.model.adapters)
    for given in getattr(args, "adapter", []):
        name, sep, path = given.partition("=")
        if not sep:
            raise ValueError(f"--adapter wants NAME=PATH, got {given!r}")
        adapters[name] = path
    shared = {
        "dtype": args.dtype,
        "device": args.device,
        "weights": getattr(args, "weights", None),
        "activations": getattr(args, "activations", None),
        "tensor_parallel": getattr(args, "tensor_parallel", None),
    }
    config = with_overrides(config, model={**shared, "adapters": adapters or None})
    if not config.models:
        return config
    import attrs

    others = tuple(
        attrs.evolve(m, **{k: v for k, v in shared.items() if v is not None})
        for m in config.models[1:]
    )
    return attrs.evolve(config, models=(config.model, *others))


def _with_models(config: EngineConfig, given: list[str]) -> EngineConfig:
    """--model PATH replaces [model]'s path; NAME=PATH, or several, replace the served models
    with [[models]] entries that keep [model]'s other keys. The flags that follow (--dtype,
    --weights...) then apply to the default model."""
    import attrs

    if not given:
        return config
    if len(given) == 1 and "=" not in given[0]:
        return attrs.evolve(config, models=(), model=attrs.evolve(config.model, path=given[0]))
    entries = []
    for one in given:
        name, sep, path = one.rpartition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model wants NAME=PATH when several are given, got {one!r}")
        entries.append(attrs.evolve(config.model, name=name, path=path))
    return attrs.evolve(config, models=tuple(entries), model=entries[0])
