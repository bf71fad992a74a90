"""`pie bench gpu`: the CUDA driver's decode and prefill speed on random-weight models of real
shapes (nothing to download), next to the bandwidth roofline measured on the same device.

Decode: `concurrency` contexts with short prompts each take `tokens` greedy steps, one pass per
step with every context in it (EOS never stops them). The roofline of a step is the bytes it
must read (every weight once, and every context's KV) over the device's measured copy
bandwidth; the table gives measured tokens/s and the roofline's share of the measured step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from pie.drivers.batch import ForwardBatch
from pie.drivers.cuda_driver import CudaDriver
from pie.drivers.loader.config import model_config_from_hf
from pie.drivers.models import build_model
from pie.drivers.models.base import CausalLM, ModelConfig
from pie.drivers.paged_plan import bucket_for
from pie.drivers.select import load_flashinfer
from pie.events.forward import ForwardRequest
from pie.events.sampling import Argmax, SamplingSlot

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
    ),
}
PAGE_SIZE = 16
PROMPT = 32
SPARE_STEPS = 32
"""Decode steps a context has room for beyond the measured ones (warm-up, profile)."""


def random_model(shape: str, device: str) -> tuple[CausalLM, ModelConfig]:
    """A bfloat16 model of `shape` with N(0, 0.02) weights and unit norm scales."""
    config = model_config_from_hf(SHAPES[shape])
    model = build_model(config, torch.bfloat16, device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval(), config


def copy_bandwidth(device: str, gib: int = 2) -> float:
    """Bytes per second a device-to-device copy moves, counting what it reads and writes."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / min(times)


class Workload:
    """Contexts placed in the driver's pages the way the kv actor would: each its own run of
    pages, grown a page at a time."""

    def __init__(self, driver: CudaDriver, contexts: int, length: int) -> None:
        pages_each = -(-length // PAGE_SIZE)
        if contexts * pages_each > driver.info.num_pages:
            raise ValueError(f"{contexts} contexts of {length} tokens exceed the KV pool")
        self.pages = [tuple(range(i * pages_each, (i + 1) * pages_each)) for i in range(contexts)]
        self.lengths = [0] * contexts
        self.last = [1] * contexts

    def prefill(self, driver: CudaDriver, tokens: int, max_batch_tokens: int) -> float:
        """Seconds to prefill every context with `tokens` random tokens, as many per pass as
        fit; the last token sampled greedily."""
        generator = torch.Generator().manual_seed(1)
        per_pass = max(1, min(max_batch_tokens // tokens, driver.info.max_batch_requests))
        seconds = 0.0
        for first in range(0, len(self.pages), per_pass):
            batch = ForwardBatch()
            for c in range(first, min(first + per_pass, len(self.pages))):
                ids = torch.randint(0, driver.info.vocab_size, (tokens,), generator=generator)
                self._add(batch, c, ids.tolist())
            seconds += _timed(driver, batch, self)
        return seconds

    def _add(self, batch: ForwardBatch, c: int, ids: list[int]) -> None:
        """Context c's next tokens, greedy at the last."""
        start = self.lengths[c]
        self.lengths[c] += len(ids)
        batch.add(
            ForwardRequest(
                corr=c,
                requester="bench",
                context=c,
                tokens=tuple(ids),
                positions=tuple(range(start, self.lengths[c])),
                kv_start=start,
                pages=self.pages[c],
                slots=(SamplingSlot(index=len(ids) - 1, op=Argmax()),),
            )
        )

    def decode_step(self, driver: CudaDriver) -> tuple[float, int]:
        batch = self._decode_batch(chained=False)
        kv_slots = sum(self.lengths)
        return _timed(driver, batch, self), kv_slots

    def _decode_batch(self, chained: bool) -> ForwardBatch:
        """Every context's next step; chained: its token is what the pass before sampled in
        the context's slot (slot c), read on the device."""
        batch = ForwardBatch()
        greedy = Argmax()
        for c, pages in enumerate(self.pages):
            position = self.lengths[c]
            self.lengths[c] += 1
            # As the engine's fast path adds a lane pass (pie/dataplane/passes.py).
            source = c if chained else None
            batch.add_decode(self.last[c], position, pages, position + 1, (), greedy, None, source)
        return batch

    def chained_steps(self, driver: CudaDriver, steps: int) -> list[tuple[float, int]]:
        """`steps` decode steps, each launched before the one before it is collected and
        reading that one's tokens on the device: the host builds a step while the device runs
        the last. Each step's time is the time between two collects."""
        timed: list[tuple[float, int]] = []
        launched = driver.launch(self._decode_batch(chained=False))
        last = time.perf_counter()
        for step in range(steps):
            kv_slots = sum(self.lengths)
            following = None
            if step + 1 < steps:
                following = driver.launch(self._decode_batch(chained=True), after=launched)
            outputs = driver.collect(launched)
            now = time.perf_counter()
            timed.append((now - last, kv_slots))
            last = now
            if following is not None:
                launched = following
        self.last = [getattr(out, "token", 1) for out in outputs]
        return timed


def _timed(driver: CudaDriver, batch: ForwardBatch, work: Workload) -> float:
    """Seconds of one pass; each context's sampled token is fed to its next step."""
    start = time.perf_counter()
    outputs = driver.forward(batch)
    seconds = time.perf_counter() - start
    for r, out in zip(batch.slot_requests, outputs, strict=True):
        work.last[r] = getattr(out, "token", 1)
    return seconds


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def decode_figures(
    driver: CudaDriver,
    concurrency: int,
    tokens: int,
    bandwidth: float,
    profile_rows: int = 0,
    chained: bool = False,
) -> dict[str, float]:
    work = Workload(driver, concurrency, PROMPT + tokens + SPARE_STEPS)
    work.prefill(driver, PROMPT, driver.info.max_batch_tokens)
    for _ in range(3):
        work.decode_step(driver)
    if chained:
        steps = work.chained_steps(driver, tokens)
    else:
        steps = [work.decode_step(driver) for _ in range(tokens)]
    seconds = [s for s, _ in steps]
    weight_bytes = sum(p.numel() * p.element_size() for p in driver.model.parameters())
    kv_per_slot = driver.cache.bytes_per_page // PAGE_SIZE
    mean_kv = statistics.fmean(kv for _, kv in steps)
    roofline = (weight_bytes + mean_kv * kv_per_slot) / bandwidth
    step = statistics.median(seconds)
    if profile_rows:
        _profile(driver, work, profile_rows, chained)
    return {
        "concurrency": concurrency,
        "tokens_per_s": concurrency * len(seconds) / sum(seconds),
        "step_ms_p50": 1e3 * step,
        "step_ms_p99": 1e3 * _percentile(seconds, 0.99),
        "roofline_step_ms": 1e3 * roofline,
        "roofline_pct": 100 * roofline / step,
        "graph_ms": 1e3 * _replay_seconds(driver, concurrency),
    }


def _replay_seconds(driver: CudaDriver, concurrency: int) -> float:
    """The device time of one decode step alone: the bucket's graph replayed back to back
    (nan without graphs). What a step takes beyond it is host time the device waits for."""
    if driver.graphs is None:
        return float("nan")
    graph = driver.graphs.graphs[bucket_for(concurrency, driver.graphs.buckets) or 0]
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20


def _profile(driver: CudaDriver, work: Workload, rows: int, chained: bool) -> None:
    """Where the host's time goes in 20 decode steps (chained or not): the functions with the
    most time of their own, to stderr."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    if chained:
        work.chained_steps(driver, 20)
    else:
        for _ in range(20):
            work.decode_step(driver)
    profiler.disable()
    mode = "chained" if chained else "one at a time"
    print(f"host profile, {len(work.pages)} contexts, 20 steps {mode}:", file=sys.stderr)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(rows)


def _kernel_profile(driver: CudaDriver, concurrency: int, rows: int) -> None:
    """The kernels with the most device time in 10 decode steps of `concurrency` contexts,
    run eagerly (a graph's kernels are the same ones), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    work = Workload(driver, concurrency, PROMPT + 16)
    work.prefill(driver, PROMPT, driver.info.max_batch_tokens)
    graphs, driver.graphs = driver.graphs, None
    try:
        for _ in range(3):
            work.decode_step(driver)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                work.decode_step(driver)
            torch.cuda.synchronize()
    finally:
        driver.graphs = graphs
    print(f"device profile, {concurrency} contexts, 10 eager steps:", file=sys.stderr)
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows)
    print(table, file=sys.stderr)


def prefill_figures(driver: CudaDriver, prompt: int, contexts: int) -> dict[str, float]:
    work = Workload(driver, contexts, prompt)
    Workload(driver, 1, prompt).prefill(driver, prompt, driver.info.max_batch_tokens)
    seconds = work.prefill(driver, prompt, driver.info.max_batch_tokens)
    return {
        "prompt_tokens": prompt,
        "contexts": contexts,
        "tokens_per_s": contexts * prompt / seconds,
    }


def bench_shape(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    kernels, version = load_flashinfer()
    if kernels is None:
        raise RuntimeError(version)
    device = "cuda"
    model, config = random_model(shape, device)
    most = max(args.concurrency)
    length = PROMPT + args.tokens + SPARE_STEPS
    num_pages = max(most * -(-length // PAGE_SIZE), 4 * -(-args.prefill_tokens // PAGE_SIZE)) + 8
    results: dict[str, Any] = {"shape": shape, "flashinfer": version}
    for graphs in (True, False) if args.compare_graphs else (True,):
        driver = CudaDriver(
            model,
            config,
            kernels=kernels,
            page_size=PAGE_SIZE,
            num_pages=num_pages,
            max_batch_tokens=max(8192, most),
            max_batch_requests=most,
            device=device,
            dtype=torch.bfloat16,
            model_name=shape,
            graph_batch_sizes=() if graphs else None,
        )
        key = "decode" if graphs else "decode_eager"
        concurrency = args.concurrency if graphs else [c for c in args.concurrency if c <= 64]
        results[key] = [
            decode_figures(driver, c, args.tokens, bandwidth, args.profile if graphs else 0)
            for c in concurrency
        ]
        if graphs:
            results["decode_chained"] = [
                decode_figures(driver, c, args.tokens, bandwidth, args.profile, chained=True)
                for c in concurrency
            ]
            results["prefill"] = prefill_figures(driver, args.prefill_tokens, 4)
            if args.kernels:
                _kernel_profile(driver, max(concurrency), args.kernels)
        del driver
        torch.cuda.empty_cache()
    return results


def _print_table(result: dict[str, Any], out: Any) -> None:
    print(f"\n{result['shape']} (bfloat16, flashinfer {result['flashinfer']})", file=out)
    print("  mode    conc  tok/s      p50 ms  p99 ms  graph ms  roofline ms  % roofline", file=out)
    modes = {"decode": "graphs", "decode_chained": "chained", "decode_eager": "eager"}
    for key, mode in modes.items():
        for row in result.get(key, []):
            print(
                f"  {mode:7} {row['concurrency']:4}"
                f"  {row['tokens_per_s']:9.0f}  {row['step_ms_p50']:6.2f}  "
                f"{row['step_ms_p99']:6.2f}  {row['graph_ms']:8.3f}  "
                f"{row['roofline_step_ms']:11.3f}  {row['roofline_pct']:9.1f}",
                file=out,
            )
    pre = result["prefill"]
    print(
        f"  prefill: {pre['contexts']} x {pre['prompt_tokens']} tokens, "
        f"{pre['tokens_per_s']:.0f} tokens/s",
        file=out,
    )


def run_bench_gpu(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("pie bench gpu: no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth("cuda")
    print(f"{name}: device copy {bandwidth / 1e12:.2f} TB/s (read + write)", file=sys.stderr)
    report: dict[str, Any] = {"device": name, "copy_bandwidth_tbps": bandwidth / 1e12}
    report["models"] = []
    with torch.inference_mode():
        for shape in args.shapes:
            result = bench_shape(shape, args, bandwidth)
            report["models"].append(result)
            _print_table(result, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report))
    return 0
