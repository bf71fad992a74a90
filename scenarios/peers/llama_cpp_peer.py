"""llama.cpp's side of `pie bench peers`, run by the interpreter of the cached environment that
holds llama-cpp-python (never pie's): the same figures `pie bench --json` prints, measured
through llama.cpp's batch API with greedy sampling, printed as one JSON object."""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import time

import llama_cpp as ll
import numpy as np

TEXT = (
    "The history of computing is a story of people who wanted machines to do arithmetic for "
    "them, and then of machines that began to do far more than arithmetic. "
)


class Engine:
    """One model and one context with room for `sequences` sequences of `per_sequence` tokens."""

    def __init__(
        self,
        path: str,
        threads: int,
        sequences: int,
        per_sequence: int,
        no_extra_buffers: bool,
    ) -> None:
        ll.llama_backend_init()
        model_params = ll.llama_model_default_params()
        # No repacked buffer types: on this kind of virtual machine the CPU reports AMX but
        # executing AMX tiles raises an illegal instruction; the AVX-512 kernels run instead.
        model_params.use_extra_bufts = not no_extra_buffers
        self.model = ll.llama_model_load_from_file(path.encode(), model_params)
        params = ll.llama_context_default_params()
        params.n_ctx = sequences * per_sequence
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        self.ctx = ll.llama_init_from_model(self.model, params)
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.batch = ll.llama_batch_init(512, 0, 1)

    def prompt(self, length: int) -> list[int]:
        text = (TEXT * (length // 8 + 2)).encode()
        tokens = (ll.llama_token * len(text))()
        count = ll.llama_tokenize(self.vocab, text, len(text), tokens, len(text), False, False)
        return list(tokens[:count])[:length]

    def clear(self) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits), at most 512 per call."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        if ll.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, index: int) -> int:
        row = ll.llama_get_logits_ith(self.ctx, index)
        values = np.ctypeslib.as_array(
            ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
        )
        return int(values.argmax())


def prefill(engine: Engine, prompts: list[list[int]]) -> list[int]:
    """Every prompt into its own sequence; each one's first sampled token."""
    flat = [
        (token, pos, seq, pos == len(p) - 1)
        for seq, p in enumerate(prompts)
        for pos, token in enumerate(p)
    ]
    firsts = []
    for start in range(0, len(flat), 512):
        chunk = flat[start : start + 512]
        engine.decode(chunk)
        firsts += [engine.argmax(i) for i, item in enumerate(chunk) if item[3]]
    return firsts


def generate(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[int, float, float]:
    """Greedy decoding of every prompt at once: (tokens made, prefill s, decode s)."""
    engine.clear()
    started = time.perf_counter()
    current = prefill(engine, prompts)
    prefilled = time.perf_counter()
    positions = [len(p) for p in prompts]
    for _ in range(tokens - 1):
        engine.decode([(t, positions[s], s, True) for s, t in enumerate(current)])
        current = [engine.argmax(s) for s in range(len(prompts))]
        positions = [p + 1 for p in positions]
    ended = time.perf_counter()
    return len(prompts) * tokens, prefilled - started, ended - prefilled


def peak_resident_mb() -> float:
    """Peak resident memory in MiB: VmHWM starts afresh at exec, where getrusage's ru_maxrss
    keeps the high-water mark of the process that spawned this one."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--no-extra-buffers", action="store_true")
    args = parser.parse_args()
    n = args.decode_tokens
    per_sequence = max(args.prefill_tokens + 8, 16 + args.concurrency + n)
    engine = Engine(args.model, args.threads, args.concurrency, per_sequence, args.no_extra_buffers)
    generate(engine, [engine.prompt(16)], 4)
    _, _, decode_seconds = generate(engine, [engine.prompt(16)], n)
    long = engine.prompt(args.prefill_tokens)
    prefill_seconds = min(generate(engine, [long], 1)[1] for _ in range(2))
    streams = [engine.prompt(16 + i) for i in range(args.concurrency)]
    made, first, rest = generate(engine, streams, n)
    figures = {
        "engine": "llama.cpp",
        "model": args.model,
        "decode_tps_batch1": (n - 1) / decode_seconds,
        "decode_tps_16": made / (first + rest),
        "prefill_tps": args.prefill_tokens / prefill_seconds,
        "peak_rss_mb": peak_resident_mb(),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
