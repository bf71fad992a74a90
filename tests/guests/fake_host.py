"""A fake pie engine for SDK tests: the pie:inferlet WIT implemented in plain Python over a
toy byte-level model, recording every host call, so built guests run without the real engine.

The toy model's argmax continues the alphabet: after `a`..`y` comes the next letter, after `z`
the end-of-turn token, after anything else `a`.
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime.component import Component, Linker, Record, Variant

from pie.events.batching import ForwardCompleted
from pie.events.sampling import Argmax, SlotOp, TokenOutput
from pie.sandbox.host.forward import slot_op
from pie.sandbox.host.runs import Run, RunSpec

SPECIALS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
VOCAB = 259
EOT = SPECIALS["<|im_end|>"]
PAGE = 16
WIT = "pie:inferlet/{}@0.1.0"


class Refused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def record(**fields: Any) -> Record:
    """A WIT record for wasmtime-py, whose field names are the WIT (kebab-case) names."""
    value = Record()
    for name, field in fields.items():
        setattr(value, name.replace("_", "-"), field)
    return value


class Message:
    """A chat message as the guest sends it (role and content attributes)."""

    def __init__(self, role: str, content: str) -> None:
        self.role = role
        self.content = content


def next_token(last: int) -> int:
    if ord("a") <= last < ord("z"):
        return last + 1
    return EOT if last == ord("z") else ord("a")


def probs_after(last: int) -> list[float]:
    """Most mass on the alphabet rule, the rest spread over a few neighbours."""
    probs = [0.0] * VOCAB
    best = next_token(last)
    probs[best] = 0.7
    for offset, mass in ((1, 0.2), (2, 0.1)):
        probs[(best + offset) % 256] += mass
    return probs


class FakeHost:
    """Engine state for one guest run: contexts, snapshots, futures, and a call log."""

    def __init__(self, session_inbox: list[str | bytes] | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.poll_sizes: list[int] = []
        self.contexts: dict[int, list[int]] = {}
        self.snapshots: dict[str, list[int]] = {}
        self.futures: dict[int, Any] = {}
        self.sent: list[str | bytes] = []
        self.inbox = list(session_inbox or [])
        self.queues: dict[str, list[str]] = {}
        self.prefilled: list[int] = []
        self.runs: dict[int, Run] = {}
        self.run_steps: dict[int, list[Any]] = {}
        self._ids = iter(range(1, 1 << 30))

    # model -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        while text:
            special = next((s for s in SPECIALS if text.startswith(s)), None)
            if special:
                ids.append(SPECIALS[special])
                text = text[len(special) :]
            else:
                ids.extend(text[0].encode())
                text = text[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in SPECIALS.items()}
        out, raw = "", b""
        for t in ids:
            if t in names:
                out, raw = out + raw.decode(errors="replace") + names[t], b""
            else:
                raw += bytes([t])
        return out + raw.decode(errors="replace")

    def format_chat(self, messages: list[Any], cue: bool) -> str:
        text = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if cue else "")

    # contexts --------------------------------------------------------------------------------
    def ctx(self, handle: int) -> list[int]:
        if handle not in self.contexts:
            raise Refused("no-such-context", f"no context {handle}")
        return self.contexts[handle]

    def new_context(self, tokens: list[int]) -> int:
        handle = next(self._ids)
        self.contexts[handle] = list(tokens)
        return handle

    def snapshot(self, name: str) -> list[int]:
        if name not in self.snapshots:
            raise Refused("no-such-snapshot", f"no snapshot {name!r}")
        return self.snapshots[name]

    def check(self, handle: int) -> None:
        self.ctx(handle)

    def destroy(self, handle: int) -> None:
        self.check(handle)
        del self.contexts[handle]

    def truncate(self, handle: int, count: int) -> None:
        tokens = self.ctx(handle)
        if count > len(tokens):
            raise Refused("invalid", f"cannot drop {count} of {len(tokens)} tokens")
        del tokens[len(tokens) - count :]

    def take_snapshot(self, model: int, name: str) -> int:
        tokens = self.snapshot(name)
        del self.snapshots[name]
        return self.new_context(tokens)

    def delete_snapshot(self, model: int, name: str) -> None:
        self.snapshot(name)
        del self.snapshots[name]

    def save(self, handle: int, name: str) -> None:
        if name in self.snapshots:
            raise Refused("snapshot-exists", f"snapshot {name!r} exists")
        self.snapshots[name] = list(self.ctx(handle))

    def context_info(self, handle: int) -> Record:
        n = len(self.ctx(handle))
        pages = -(-n // PAGE)
        return record(
            tokens=n,
            pages=pages,
            reserved_pages=0,
            next_position=n,
            masked_pages=[],
            released_pages=[],
        )

    # forward ---------------------------------------------------------------------------------
    def execute(self, p: Any) -> int:
        tokens = self.ctx(p.context)
        self.prefilled.append(len(p.tokens))
        tokens.extend(p.tokens)
        outputs = []
        for slot in p.slots:
            if not 0 <= slot.index < len(p.tokens):
                raise Refused("invalid", f"slot index {slot.index} outside the pass")
            last = p.tokens[slot.index]
            outputs.append(self.read_out(slot.op, last))
        return self.future(outputs)

    def read_out(self, op: Variant, last: int) -> Variant:
        probs = probs_after(last)
        params: Any = op.payload
        if op.tag == "argmax":
            return Variant("token", next_token(last))
        if op.tag in ("multinomial", "top-k", "top-p", "min-p", "top-k-top-p"):
            rng = random.Random(params.seed)
            return Variant("token", rng.choices(range(VOCAB), weights=probs)[0])
        order = sorted(range(VOCAB), key=lambda t: -probs[t])
        if op.tag == "distribution":
            top = order[: params.k]
            return Variant("distribution", record(tokens=top, probs=[probs[t] for t in top]))
        if op.tag == "raw-logits":
            return Variant("logits", [math.log(p) if p else -30.0 for p in probs])
        if op.tag == "logprobs":
            return Variant("logprobs", [math.log(probs[t]) if probs[t] else -30.0 for t in params])
        return Variant("entropy", -sum(p * math.log(p) for p in probs if p))

    def sample(self, op: SlotOp, last: int) -> int:
        """A sampler given as an engine event (what generation runs use), like `read_out`."""
        if isinstance(op, Argmax):
            return next_token(last)
        rng = random.Random(getattr(op, "seed", None))
        return rng.choices(range(VOCAB), weights=probs_after(last))[0]

    # generate --------------------------------------------------------------------------------
    def start_run(self, p: Any) -> int:
        """A run through the engine's own `Run` over the toy model; its passes run when the
        guest waits for output, until the run has some for it."""
        mask = getattr(p, "logit-mask")
        spec = RunSpec(
            context=p.context,
            feed=tuple(p.tokens),
            op=slot_op(p.sampler),
            max_tokens=getattr(p, "max-tokens"),
            stop_tokens=frozenset(getattr(p, "stop-tokens")),
            stop_strings=tuple(getattr(p, "stop-strings")),
            logit_mask=None if mask is None else tuple(mask),
            deliver_every=getattr(p, "deliver-every"),
            text=p.text,
        )
        handle = next(self._ids)
        steps = self.run_steps[handle] = []
        run = Run(spec, lambda *step: steps.append(step), self.decode, lambda: None)
        self.runs[handle] = run
        run.start()
        return handle

    def next_run_output(self, handle: int) -> int:
        run, steps = self.runs[handle], self.run_steps[handle]
        while steps and not run.ready():
            feed, op, _mask, deliver = steps.pop(0)
            self.prefilled.append(len(feed))
            self.ctx(run.spec.context).extend(feed)
            out = TokenOutput(token=self.sample(op, feed[-1]))
            deliver(ForwardCompleted(corr=0, context=run.spec.context, outputs=(out,)))
        return self.future(handle)

    def run_output(self, pending: int) -> Record:
        out = self.runs[self.take(pending)].take()
        return record(
            tokens=list(out.tokens),
            text=out.text,
            finished=out.finished,
            final_token=out.final_token,
            last_written=out.last_written,
        )

    def no_grammar(self, *args: Any) -> Any:
        raise Refused("invalid", "the fake host has no grammar engine")

    def future(self, value: Any) -> int:
        handle = next(self._ids)
        self.futures[handle] = value
        return handle

    def take(self, handle: int) -> Any:
        if handle not in self.futures:
            raise Refused("no-such-handle", f"no future {handle}")
        return self.futures.pop(handle)

    def fetch(self, request: Any) -> int:
        """An echo server at every URL: the method, URL, headers and body it was sent."""
        if "denied" in request.url:
            raise Refused("denied", f"the network policy does not allow {request.url}")
        echo = {
            "method": request.method,
            "url": request.url,
            "headers": {h.name: h.value for h in request.headers},
            "body": bytes(request.body).decode(),
            "timeout-ms": getattr(request, "timeout-ms"),
        }
        body = json.dumps(echo).encode()
        headers = [record(name="content-type", value="application/json")]
        return self.future(record(status=200, url=request.url, headers=headers, body=body))

    def list_tools(self, server: str) -> int:
        """Server `toys` has one tool, `echo`, that returns its arguments."""
        if server != "toys":
            raise Refused("no-such-server", f"no mcp server {server!r}")
        schema = json.dumps({"type": "object"})
        return self.future([record(name="echo", description="Echoes.", input_schema=schema)])

    def call_tool(self, server: str, name: str, arguments: str, timeout_ms: int | None) -> int:
        if server != "toys":
            raise Refused("no-such-server", f"no mcp server {server!r}")
        content = json.dumps([{"type": "text", "text": arguments}])
        return self.future(
            record(content=content, text=arguments, structured=None, is_error=name != "echo")
        )

    def discard(self, handle: int) -> None:
        self.futures.pop(handle, None)

    def poll(self, pending: list[int]) -> list[int]:
        self.poll_sizes.append(len(pending))
        if not pending:
            raise Refused("invalid", "poll of no futures")
        return list(range(len(pending)))

    def push(self, queue: str, message: str) -> None:
        self.queues.setdefault(queue, []).append(message)

    def receive(self) -> int:
        if not self.inbox:
            raise Refused("closed", "no client message")
        return self.future(self.inbox.pop(0))

    # wiring ----------------------------------------------------------------------------------
    def interfaces(self) -> dict[str, dict[str, Callable[..., Any]]]:
        h = self
        return {
            "model": {
                "models": lambda: ["toy"],
                "load": lambda name: 1,
                "info": lambda m: record(
                    name="toy",
                    vocab_size=VOCAB,
                    page_size=PAGE,
                    max_batch_tokens=1024,
                    adapters=[],
                    inputs=["text"],
                    outputs=["text"],
                ),
                "encode": lambda m, text: h.encode(text),
                "decode": lambda m, ids: h.decode(ids),
                "token-texts": lambda m, ids: [h.decode([t]) for t in ids],
                "special-tokens": lambda m: [record(id=i, text=t) for t, i in SPECIALS.items()],
                "stop-tokens": lambda m: [SPECIALS["<|endoftext|>"], EOT],
                "format-chat": lambda m, msgs, cue: h.format_chat(msgs, cue),
            },
            "context": {
                "create": lambda m: h.new_context([]),
                "open": lambda m, name: h.new_context(h.snapshot(name)),
                "take": h.take_snapshot,
                "delete": h.delete_snapshot,
                "fork": lambda c: h.new_context(h.ctx(c)),
                "save": h.save,
                "destroy": h.destroy,
                "truncate": h.truncate,
                "reserve": lambda c, n: h.check(c),
                "mask-pages": lambda c, pages, masked: h.check(c),
                "release-pages": lambda c, pages: h.check(c),
                "info": h.context_info,
                "tokens": lambda c: list(h.ctx(c)),
            },
            "forward": {
                "execute": h.execute,
                "outputs": h.take,
                "step": lambda p: h.take(h.execute(p)),
            },
            "generate": {
                "start": h.start_run,
                "next": h.next_run_output,
                "output": h.run_output,
                "cancel": lambda run: h.runs[run].cancel(),
            },
            "grammar": {name: h.no_grammar for name in GRAMMAR_CALLS},
            "futures": {
                "poll": h.poll,
                "ready": lambda f: f in h.futures,
                "discard": h.discard,
            },
            "session": {
                "send": h.sent.append,
                "receive": h.receive,
                "received": h.take,
            },
            "messaging": {
                "push": h.push,
                "pull": lambda q: h.future(h.queues.get(q, ["(empty)"]).pop(0)),
                "broadcast": lambda t, m: h.push(t, m),
                "subscribe": lambda t: next(h._ids),
                "next": lambda sub: h.future(f"message {sub}"),
                "unsubscribe": lambda sub: None,
                "message": h.take,
            },
            "runtime": {
                "version": lambda: "fake",
                "instance-id": lambda: "fake-1",
                "user": lambda: "tester",
                "launch": lambda program, input: next(h._ids),
                "wait": lambda child: h.future(f"child says {child}"),
                "child-result": h.take,
                "terminate": lambda child: None,
                "detach": lambda child: None,
            },
            "http": {"fetch": h.fetch, "fetched": h.take},
            "media": {
                name: _no_media
                for name in (
                    "image-from-bytes",
                    "video-from-bytes",
                    "audio-from-bytes",
                    "info",
                    "free",
                    "append",
                )
            },
            "speech": {
                name: _no_speech
                for name in (
                    "voices",
                    "max-seconds",
                    "speak",
                    "spoken",
                    "info",
                    "wav",
                    "samples",
                    "free",
                )
            },
            "mcp": {
                "servers": lambda: ["toys"],
                "list-tools": h.list_tools,
                "tools": h.take,
                "call-tool": h.call_tool,
                "called": h.take,
            },
        }


def _no_media(*args: Any) -> Any:
    raise Refused("unsupported-media", "the toy model reads text only")


def _no_speech(*args: Any) -> Any:
    raise Refused("unsupported-media", "model 'toy' does not speak (it produces text)")


GRAMMAR_CALLS = (
    "compile",
    "new-matcher",
    "mask",
    "consume",
    "rollback",
    "forced",
    "status",
    "free",
)

TAGGED = {
    ("model", "info"),
    ("context", "info"),
    ("http", "fetched"),
    ("mcp", "called"),
    ("generate", "output"),
    ("media", "info"),
}
"""Results whose ok value is a record: wasmtime-py then wants Variant('ok'/'err', ...)."""


def _adapt(iface: str, name: str, fn: Callable[..., Any], host: FakeHost) -> Callable[..., Any]:
    tagged = (iface, name) in TAGGED

    def call(store: Any, *args: Any) -> Any:
        host.calls[f"{iface}.{name}"] += 1
        try:
            value = fn(*args)
        except Refused as err:
            error = record(kind=err.kind, message=str(err))
            return Variant("err", error) if tagged else error
        return Variant("ok", value) if tagged else value

    return call


_ENGINE_LOCK = threading.Lock()
_COMPILED: dict[Path, tuple[wasmtime.Engine, Component]] = {}


def compiled(wasm: Path) -> tuple[wasmtime.Engine, Component]:
    """Compiles a component once (seconds) and keeps the machine code next to it (.cwasm), so
    later sessions load it in milliseconds."""
    with _ENGINE_LOCK:
        if wasm not in _COMPILED:
            engine = wasmtime.Engine()
            _COMPILED[wasm] = (engine, _load(engine, wasm))
        return _COMPILED[wasm]


def _load(engine: wasmtime.Engine, wasm: Path) -> Component:
    artifact = wasm.with_suffix(".cwasm")
    if artifact.is_file():
        try:
            return Component.deserialize_file(engine, str(artifact))
        except wasmtime.WasmtimeError:
            pass  # made by another wasmtime version or config: compile again
    component = Component.from_file(engine, str(wasm))
    artifact.write_bytes(component.serialize())
    return component


def run_guest(wasm: Path, input: str, host: FakeHost, out_dir: Path) -> tuple[str, str]:
    """Runs the guest's `run` export; returns ("ok" | "err", value). Its stdout and stderr go
    to files in `out_dir`."""
    engine, component = compiled(wasm)
    linker = Linker(engine)
    linker.add_wasip2()
    with linker.root() as root:
        for iface, funcs in host.interfaces().items():
            with root.add_instance(WIT.format(iface)) as inst:
                for name, fn in funcs.items():
                    inst.add_func(name, _adapt(iface, name, fn, host))

    store = wasmtime.Store(engine)
    wasi = wasmtime.WasiConfig()
    wasi.stdout_file = str(out_dir / "stdout.txt")
    wasi.stderr_file = str(out_dir / "stderr.txt")
    store.set_wasi(wasi)
    instance = linker.instantiate(store, component)
    run = instance.get_func(store, "run")
    assert run is not None
    result = run(store, input)
    run.post_return(store)
    return result.tag, result.payload
