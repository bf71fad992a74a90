"""The engine's own config sections: [model], [driver], [kv], [scheduler], [event_log],
[bus], [sandbox]."""

from __future__ import annotations

import os
import re
from typing import Any

import attrs
from attrs import field, frozen

from pie.config.checks import at_least, choice, positive, share

DEFAULT_MODEL = "smollm2-135m"
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}")


def _adapters(_: object, attribute: attrs.Attribute[Any], value: dict[str, str]) -> None:
    for name, path in value.items():
        if not _ADAPTER_NAME.fullmatch(name):
            raise ValueError(
                f"model.adapters: {name!r} is not an adapter name (1 to 64 letters, digits and "
                "._:/-, starting with a letter or digit)"
            )
        if not isinstance(path, str) or not path:
            raise ValueError(f"model.adapters: {name!r} needs the path of a PEFT adapter folder")


def _model_name(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value and not _ADAPTER_NAME.fullmatch(value):
        raise ValueError(
            f"model name {value!r}: 1 to 64 letters, digits and ._:/-, starting with a letter "
            "or digit"
        )


def _kv_share(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"kv_share must be in [0, 1], got {value}")


@frozen(kw_only=True)
class ModelConfig:
    path: str = DEFAULT_MODEL
    """The alias `smollm2-135m`, an HF model directory, or a .gguf file."""
    name: str = field(default="", validator=_model_name)
    """What programs and clients call it (`load(name)`, the OpenAI `model` field); empty: the
    alias, the folder's name or the .gguf file's stem."""
    kv_share: float = field(default=0.0, validator=_kv_share)
    """With several [[models]], this model's part of the KV budget ([kv] memory_mb or
    memory_fraction, or num_pages); 0: an equal part of what the entries that set one leave."""
    dtype: str = field(default="auto", validator=choice("auto", "float32", "bfloat16", "float16"))
    """auto: float32 on the CPU, bfloat16 on CUDA."""
    device: str = field(default="auto", validator=choice("auto", "cpu", "cuda"))
    weights: str = field(default="auto", validator=choice("auto", "dtype", "int8", "int4"))
    """How linear weights are held: auto is int4 for a float32 model on the CPU whose GGUF file
    stores its layers as Q4_0/Q4_1 blocks (exact there, and faster) when the kernel builds with
    AVX2 or better, and keeps them in `dtype` otherwise; dtype always keeps them in `dtype`;
    int8 (CPU only) keeps each
    decoder linear layer as int8 rows with one scale per row, smoothed from a calibration pass,
    and multiplies in int8 (a quarter of float32's bytes; outputs close to, not equal to,
    float32's); int4 (CPU only) keeps them as 4-bit Q4_1 blocks multiplied by a kernel compiled
    on first use: a GGUF model's own Q4_0/Q4_1 blocks as they are (outputs equal to the float32
    model's up to rounding with float32 activations), other weights quantized per group of 32;
    its output head and tied embeddings are Q8_0 blocks. int8 keeps the head in `dtype`."""
    activations: str = field(default="float32", validator=choice("float32", "int8"))
    """How int4 weights multiply their inputs: float32 multiplies the dequantized blocks with
    float x (outputs equal to the dequantized model's up to rounding); int8 quantizes each block
    of 32 values of every row of x to int8 with one scale, as llama.cpp does, and multiplies with
    AVX-512 VNNI integer dot products over the weights held in 16-row tiles (batch-1 decode
    about 1.6x faster; outputs within about 3% of float32 activations', the same for a token
    whatever pass or batch it is in). int8 on a CPU without AVX-512 VNNI is refused."""
    adapters: dict[str, str] = field(factory=dict, validator=_adapters)
    """LoRA adapters by name: each a PEFT folder (adapter_config.json and
    adapter_model.safetensors) checked against the model at start. A forward pass or a
    generation names the adapter it runs through (none: the base model); one batch mixes them."""
    max_adapters: int = field(default=8, validator=at_least(0))
    """The most adapters `adapters` may name."""
    adapter_rank_budget: int = field(default=512, validator=at_least(0))
    """The loaded adapters' ranks (r) added up may be at most this (their memory and the work
    they add to a pass grow with it)."""
    tensor_parallel: int = field(default=1, validator=at_least(1))
    """Ranks that one replica of the model runs on (torch.distributed: gloo on the CPU, NCCL
    with one GPU per rank): rank 0 is this process, pie starts the others. Each keeps whole
    KV-head groups (at most one rank per KV head) and a part of the MLP columns. Above 1: the
    torch driver, float weights (weights auto or dtype) and no adapters."""

    def __attrs_post_init__(self) -> None:
        if self.tensor_parallel == 1:
            return
        if self.weights in ("int8", "int4"):
            raise ValueError(
                f"model.tensor_parallel = {self.tensor_parallel} shards float weights: "
                f"weights = {self.weights!r} runs on one rank"
            )
        if self.adapters:
            raise ValueError(
                f"model.tensor_parallel = {self.tensor_parallel}: LoRA adapters run on one rank"
            )


@frozen(kw_only=True)
class DriverConfig:
    """Which driver runs the model, and how it shares the machine's cores with the engine's
    other threads."""

    threads: int = field(default=0, validator=at_least(0))
    """torch's CPU threads; 0: the usable cores minus one (at least 1), leaving a core to the
    event loop, the pass loop's helper thread and the guests."""
    omp_wait_policy: str = field(default="passive", validator=choice("passive", "active"))
    """OMP_WAIT_POLICY when the environment does not set it: passive threads sleep between
    parallel regions, active ones spin and hold their cores."""
    backend: str = field(default="auto", validator=choice("auto", "torch", "cuda"))
    """Which driver runs the model: cuda (flashinfer's paged kernels and CUDA graphs; needs a
    GPU, the `cuda` extra and a bfloat16 or float16 model), torch (plain torch on any device),
    or auto: cuda where it can run, else torch. `pie doctor` says which and why."""
    cuda_graphs: bool = True
    """The cuda driver captures decode passes as CUDA graphs at start-up and replays them."""
    graph_batch_sizes: tuple[int, ...] = field(
        default=(), validator=attrs.validators.deep_iterable(at_least(1))
    )
    """Decode batch sizes captured as graphs; a pass replays the smallest that holds it.
    Empty: 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, as far as
    [scheduler] max_batch_requests, which is always captured."""


@frozen(kw_only=True)
class KvConfig:
    page_size: int = field(default=16, validator=at_least(1))
    num_pages: int = field(default=0, validator=at_least(0))
    """0 sizes the pool from memory_mb, or from the model and memory_fraction."""
    memory_mb: int = field(default=0, validator=at_least(0))
    """The pool's budget in MiB; 0: room for [scheduler] max_batch_requests contexts of the
    model's full length, but at most memory_fraction of the memory free after loading it."""
    memory_fraction: float = 0.5
    """Of the memory free after loading the model: the GPU's on CUDA, the system's on the CPU
    (where pages take resident memory only once a pass first uses them)."""
    dtype: str = field(default="auto", validator=choice("auto", "int8"))
    """auto: pages hold the model's dtype; int8: one byte per value with a float32 scale per
    page, K or V, and head (a quarter of float32's memory; the torch driver only)."""
    prefix_cache: str = field(default="user", validator=choice("off", "user", "global"))
    """Which contexts reuse each other's committed pages instead of computing them again: none,
    a user's own (so no program learns another user's prompts from how fast its pass ran), or
    every context's."""
    inferlet_page_share: float = field(default=0.5, validator=share)
    """Of the pool, the pages one inferlet (or client) may hold; past it, out-of-pages."""
    user_page_share: float = field(default=0.75, validator=share)
    """Of the pool, the pages all contexts of one user may hold; past it, out-of-pages."""
    snapshot_page_share: float = field(default=0.25, validator=share)
    """Of the pool, the pages one user's named snapshots may hold; past it, snapshot-quota."""
    snapshots_dir: str = ""
    """Where named snapshots are kept so that they survive a restart or a kill (each user's
    records, rebuilt at start); empty keeps them in memory only. `pie serve` sets it, when
    empty, to `snapshots` beside the compiled components (see [sandbox] cache_dir)."""


@frozen(kw_only=True)
class SchedulerConfig:
    max_batch_tokens: int = field(default=512, validator=at_least(1))
    max_batch_requests: int = field(default=64, validator=at_least(1))
    decode_tokens: int = field(default=16, validator=at_least(1))
    """Requests of at most this many tokens are served before prefill chunks in each pass."""
    fast_path: bool = True
    """Run inferlets' plain decodes on the driver thread (leases), without Trio round trips."""
    speculation_depth: int = field(default=1, validator=at_least(0))
    """Passes staged ahead of a program on the fast path (0: none)."""
    chain_passes: str = field(default="auto", validator=choice("auto", "on", "off"))
    """Launch the fast path's staged passes on the device behind the pass whose tokens they
    read, before that pass is collected, so the host builds one pass while the device runs
    another (auto: on a CUDA device)."""
    max_slots_per_pass: int = field(default=512, validator=at_least(1))
    """Sampling and probe slots one program's pass may have; more is refused as invalid."""
    max_probe_values: int = field(default=1 << 22, validator=at_least(1))
    """Values one pass's slots may return together (a raw-logits row is the vocabulary, a
    distribution two per token); more is refused as invalid before the driver sees it."""


@frozen(kw_only=True)
class EventLogConfig:
    enabled: bool = True
    ring_size: int = field(default=100_000, validator=at_least(0))
    path: str = ""
    """When set, every event is also appended to this JSON-lines file."""
    max_unwritten: int = field(default=100_000, validator=at_least(1))
    """Records the file writer may fall behind by; past that, records are left out of the file
    (which marks the gap) until it catches up by half."""
    encoder: str = field(default="process", validator=choice("process", "thread"))
    """Where the file's records are encoded: `process`, a child process that takes each event
    as the ring packs it (the engine's process only pickles it), or `thread`, the writer thread
    in the engine's process."""
    ring_payload_chars: int = field(default=256, validator=at_least(0))
    """Of each text or bytes field of an event, what the in-memory ring keeps (0: all); the
    file keeps every event whole."""
    record_inferlets: bool = False
    """Also record every host call each inferlet makes and what it got back, so that `pie replay
    --inferlet` can run the program again without the model (docs/event-log.md)."""
    record_max_mb: float = field(default=64.0, validator=positive)
    """Bytes one inferlet's recording may hold; past that it stops, and the log says so."""
    record_user_mb: float = field(default=1024.0, validator=positive)
    """Bytes the recordings of one user's inferlets may hold together over the engine's run."""


@frozen(kw_only=True)
class BusConfig:
    """What the messaging bus holds for inferlets and clients (docs/inferlet-api.md#messaging)."""

    max_message_kb: int = field(default=1024, validator=at_least(1))
    """A pushed or broadcast message's size in UTF-8; larger ones are refused too-large."""
    max_queue_messages: int = field(default=10_000, validator=at_least(1))
    max_queue_mb: int = field(default=16, validator=at_least(1))
    """Bytes of messages one queue holds until they are pulled; past that a push is overrun."""
    max_user_mb: int = field(default=64, validator=at_least(1))
    """Bytes of messages one user's pushes hold on all queues; past that a push fails quota."""
    max_waiting_pulls: int = field(default=1024, validator=at_least(1))
    """Pulls one inferlet or connection may have waiting at once, on all queues; past that a
    pull fails overrun."""


@frozen(kw_only=True)
class SandboxConfig:
    budget_seconds: float = 300.0
    """Wall-clock time an inferlet may run, waiting included."""
    memory_mb: int = field(default=512, validator=at_least(16))
    """Linear memory cap per inferlet (a Python inferlet needs about 13 MB to start)."""
    max_concurrent: int = field(default=64, validator=at_least(1))
    """Inferlets running at once; more wait in the admission queue."""
    guest_memory_mb: int = field(default=0, validator=at_least(0))
    """Linear memory all running inferlets may reserve together: one is admitted only while
    its memory_mb fits in what is left (0: half of the machine's memory, at least memory_mb)."""
    max_inferlets_per_user: int = field(default=256, validator=at_least(0))
    """Inferlets of one user running and queued together; more launches are refused (0: no
    limit)."""
    max_running_per_user: int = field(default=0, validator=at_least(0))
    """Inferlets of one user running at once; more wait in the admission queue though slots are
    free (0: up to max_concurrent). A freed slot always goes to the waiting user with the fewest
    running, so the default lets one user use every idle slot without starving others."""
    max_children: int = field(default=64, validator=at_least(0))
    """Children one inferlet may have running and queued at once (0: no limit)."""
    max_child_depth: int = field(default=8, validator=at_least(0))
    """How many generations of children below an inferlet a client launched (0: none)."""
    max_session_messages: int = field(default=1024, validator=at_least(0))
    """Session messages one inferlet may hold that its program has not received (0: no limit);
    a send past it is refused overrun."""
    max_session_mb: float = field(default=16.0, validator=at_least(0))
    """Bytes of such messages one inferlet may hold (0: no limit); past it, overrun."""
    max_user_session_mb: float = field(default=64.0, validator=at_least(0))
    """Bytes of such messages one user's inferlets may hold together (0: no limit); past it,
    quota."""
    cache_dir: str = ""
    """Compiled components; empty means $PIE_CACHE_DIR/components or ~/.cache/pie/components."""
    scratch_dir: str = ""
    """When set, each inferlet gets a fresh directory under it at /scratch, removed when it ends."""
    scratch_quota_mb: int = field(default=256, validator=at_least(0))
    """Bytes one /scratch may hold (0: no limit)."""
    scratch_max_files: int = field(default=10_000, validator=at_least(0))
    """Files and directories one /scratch may hold (0: no limit)."""
    persist_dir: str = ""
    """When set, each inferlet also gets persist_dir/<its user> at /data, kept across runs."""
    persist_quota_mb: int = field(default=64, validator=at_least(0))
    """Bytes one user's /data may hold (0: no limit)."""
    persist_max_files: int = field(default=10_000, validator=at_least(0))
    """Files and directories one user's /data may hold (0: no limit)."""
    files_check_ms: float = field(default=100.0, validator=at_least(1))
    """How often running inferlets' /scratch and /data are measured against their quotas."""
    subscription_buffer: int = field(default=1024, validator=at_least(1))
    """Messages a topic subscription holds; past that its oldest are dropped (and the subscriber
    told of it by an overrun)."""
    subscription_buffer_mb: int = field(default=16, validator=at_least(1))
    """Bytes (UTF-8) of messages one subscription holds; past that its oldest are dropped."""
    subscription_buffer_inferlet_mb: int = field(default=64, validator=at_least(1))
    """Bytes of messages all of one inferlet's subscriptions hold together; past that the
    oldest of its fullest subscription are dropped."""
    epoch_ms: float = 5.0
    """How often the runaway-guest check runs."""
    guest_niceness: int = field(default=10, validator=[at_least(0), attrs.validators.le(19)])
    """Scheduling niceness of guest threads (0-19): above 0, busy guests yield the CPU to the
    engine's own threads, and to every other process on the machine."""

    def __attrs_post_init__(self) -> None:
        if 0 < self.guest_memory_mb < self.memory_mb:
            raise ValueError(
                f"guest_memory_mb ({self.guest_memory_mb}) must be 0 or at least memory_mb "
                f"({self.memory_mb}): no inferlet could ever be admitted"
            )

    @property
    def guest_memory_bytes(self) -> int:
        """The guests' memory budget in bytes, `guest_memory_mb` or, when 0, half of this
        machine's memory (never below one inferlet's cap)."""
        if self.guest_memory_mb:
            return self.guest_memory_mb << 20
        try:
            half = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError):
            half = 0
        return max(half, self.memory_mb << 20)
