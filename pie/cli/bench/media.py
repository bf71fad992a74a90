"""`pie bench media`: what media input costs on small random Qwen2-VL and Qwen2-Audio models:
decoding and preprocessing of pictures, audio and video, the encoders, and image requests through
the engine at once against one after another."""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from pie.cli.bench import spread
from pie.cli.bench.media_engine import ORDERS, concurrent_against_sequential
from pie.cli.bench.media_inputs import flac, jpeg, mp4
from pie.cli.bench.media_models import MediaModelSize, audio_checkpoint, vl_checkpoint
from pie.config import DriverConfig, default_cache_dir
from pie.media import decode_audio, decode_image, decode_video

VIDEO_FRAMES = 8
STAGES = ("decode_ms", "preprocess_ms", "encoder_ms")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure, the stages timed on the threads (and wait policy) the engine computes with."""
    from pie.drivers.threads import set_threads, set_wait_policy

    _check(args)
    set_wait_policy(DriverConfig())  # before torch loads
    threads = set_threads(DriverConfig())
    size = MediaModelSize(
        hidden=args.hidden,
        layers=args.layers,
        vision_dim=args.vision_dim,
        vision_depth=args.vision_depth,
        patch=args.patch,
    )
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir() / "bench-media"
    folders = {"vl": vl_checkpoint(size, cache), "audio": audio_checkpoint(size, cache)}
    figures: dict[str, Any] = {
        "model": size.describe(),
        "sizes": attrs.asdict(size),
        "repeats": args.repeats,
        "torch_threads": threads,
        **_stages(folders, args),
    }
    width, height = args.image_sizes[0]
    soft = int(figures[f"image_{width}x{height}"]["soft_tokens"])
    rounds = trio.run(concurrent_against_sequential, folders["vl"], args, soft)
    figures["engine"] = {
        "requests": args.requests,
        "tokens": args.tokens,
        "image": f"{width}x{height}",
        **{name: spread(values) for name, values in rounds.items()},
    }
    return figures


def _check(args: argparse.Namespace) -> None:
    counts = {"--repeats": args.repeats, "--requests": args.requests, "--tokens": args.tokens}
    counts.update({"--image-sizes": min(min(size) for size in args.image_sizes)})
    for flag, value in counts.items():
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.audio_seconds <= 0:
        raise ValueError(f"--audio-seconds must be positive, got {args.audio_seconds}")


def _stages(folders: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    """Decoding, preprocessing and encoding of each picture size, the video and the clip."""
    from pie.drivers.tokenizer import Tokenizer

    vl, audio = (_loaded(folder) for folder in folders.values())
    tokenize = Tokenizer.from_folder(folders["audio"]).encode
    figures = {}
    for width, height in args.image_sizes:
        make = functools.partial(jpeg, width=width, height=height)
        figures[f"image_{width}x{height}"] = _timed(make, decode_image, "image", vl, tokenize, args)
    video = mp4(VIDEO_FRAMES, *args.image_sizes[0])
    figures["video"] = _timed(
        lambda r: video, lambda d: decode_video(d, VIDEO_FRAMES), "video", vl, tokenize, args
    )
    clip = flac(args.audio_seconds)
    figures["audio"] = _timed(
        lambda r: clip, lambda d: decode_audio(d, audio.audio_rate), "audio", audio, tokenize, args
    )
    both = figures["audio"]["decode_preprocess_ms"]
    figures["audio"].update(
        seconds=args.audio_seconds,
        decode_preprocess_ms_per_second={k: v / args.audio_seconds for k, v in both.items()},
    )
    return figures


def _loaded(folder: Path) -> Any:
    import torch

    from pie.drivers.loader import load_model

    return load_model(str(folder), torch.float32, "cpu").model


def _timed(
    make: Callable[[int], bytes],
    decode: Callable[[bytes], Any],
    kind: str,
    model: Any,
    tokenize: Callable[[str], list[int]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Decode, preprocess and encode one item `args.repeats` times (after one untimed run),
    item r made by `make(r)`: each stage's milliseconds, and the item's soft tokens."""
    import torch

    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for repeat in range(-1, args.repeats):
        data = make(repeat + 1)
        started = time.perf_counter()
        decoded = decode(data)
        decoded_at = time.perf_counter()
        prepared = model.prepare(kind, decoded, tokenize)
        prepared_at = time.perf_counter()
        with torch.inference_mode():
            model.encode([prepared])
        ended = time.perf_counter()
        if repeat >= 0:
            marks = (started, decoded_at, prepared_at, ended)
            for stage, start, end in zip(STAGES, marks, marks[1:], strict=False):
                times[stage].append(1e3 * (end - start))
    row: dict[str, Any] = {stage: spread(values) for stage, values in times.items()}
    both = [a + b for a, b in zip(times["decode_ms"], times["preprocess_ms"], strict=True)]
    row["decode_preprocess_ms"] = spread(both)
    row.update(soft_tokens=prepared.soft_count, grid=list(prepared.grid), bytes=len(data))
    return row


def run_bench_media(args: argparse.Namespace) -> int:
    figures = measure(args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"random weights: {figures['model']}; {figures['torch_threads']} torch threads")
    print(f"{'':<24}{'decode ms':>20}{'preprocess ms':>20}{'encoder ms':>20}{'soft tokens':>13}")
    for width, height in args.image_sizes:
        _print_row(f"image {width}x{height} JPEG", figures[f"image_{width}x{height}"])
    width, height = args.image_sizes[0]
    _print_row(f"video {VIDEO_FRAMES}x{width}x{height}", figures["video"])
    _print_row(f"audio {args.audio_seconds:g} s FLAC", figures["audio"])
    per_second = figures["audio"]["decode_preprocess_ms_per_second"]
    print(f"audio decode + preprocess per second of audio: {_cell(per_second, 2)} ms")
    _print_engine(figures["engine"])
    return 0


def _cell(entry: dict[str, float], digits: int = 1) -> str:
    return f"{entry['median']:.{digits}f} [{entry['min']:.{digits}f}-{entry['max']:.{digits}f}]"


def _print_row(label: str, row: dict[str, Any]) -> None:
    cells = "".join(f"{_cell(row[stage]):>20}" for stage in STAGES)
    print(f"{label:<24}{cells}{row['soft_tokens']:>13}")


def _print_engine(engine: dict[str, Any]) -> None:
    print(
        f"{engine['requests']} requests, a {engine['image']} JPEG then {engine['tokens']} greedy "
        f"tokens each:"
    )
    print(f"{'':<12}{'wall s':>22}{'mean batch':>22}{'tokens/s':>22}{'encoder calls':>22}")
    for order in ORDERS:
        cells = [
            _cell(engine[f"{order}_wall_s"], 2),
            _cell(engine[f"{order}_mean_batch_size"], 2),
            _cell(engine[f"{order}_tokens_per_second"]),
            _cell(engine[f"{order}_encoder_calls"], 0),
        ]
        print(f"{order:<12}" + "".join(f"{c:>22}" for c in cells))
    print(f"sequential / concurrent wall time (per round): {_cell(engine['speedup'], 2)}")
