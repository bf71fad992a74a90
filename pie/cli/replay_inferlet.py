"""`pie replay FILE --inferlet ID [--program PATH]`: run a recorded inferlet again against its
recorded host-call results (no model, no network) and say whether it did the same: exit 0 on an
exact replay, 1 when it diverged, 2 when the log cannot be replayed."""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Any

from wasmtime.component import Component, Record

from pie.actors.inferlet.actor import request_record
from pie.config import default_cache_dir
from pie.eventlog.inferlet_replay import InstanceRecording, read_recording
from pie.events.inferlet import InferletFinished
from pie.sandbox import InvalidProgram, RunOutcome, SandboxLimits, WasmRuntime
from pie.sandbox.host import HostFailure
from pie.sandbox.host.serving import MAX_CHUNK_BYTES, check_head
from pie.sandbox.replaying import Divergence, Replayed, Replayer, replay, stop_of

SHOWN_CHARS = 200
REPLAY_MEMORY = 512 << 20
"""The guest's memory cap ([sandbox] memory_mb's default)."""


class ProgramNotFound(Exception):
    """Neither --program nor the recorded program's hash names a program here."""


def run_inferlet_replay(args: argparse.Namespace) -> int:
    try:
        recording = read_recording(args.file, args.inferlet)
    except ValueError as err:  # a RecordingError, or a file that is not a log
        print(f"pie: cannot replay: {err}", file=sys.stderr)
        return 2
    with WasmRuntime(default_cache_dir() / "components") as runtime:
        try:
            digest, component = _program(runtime, recording, args.program)
        except (ProgramNotFound, InvalidProgram, OSError) as err:
            print(f"pie: cannot replay: {err}", file=sys.stderr)
            return 2
        _describe(recording, digest)
        replayer = _replayer(recording)
        replayed = replay(
            runtime,
            component,
            replayer,
            recording.input,
            request=None if recording.request is None else request_record(recording.request),
            on_output=_echo,
            limits=_limits(recording),
        )
    return _report(recording, replayer, replayed)


def _limits(recording: InstanceRecording) -> SandboxLimits:
    """A replay waits for nothing, so it needs no more time than the recorded run took: twice
    that and 10 s more, which also ends a program that computes on where the recorded one was
    stopped."""
    seconds = recording.finished.seconds if recording.finished else 1800.0
    return SandboxLimits(budget_seconds=2 * seconds + 10, memory_bytes=REPLAY_MEMORY)


def _program(
    runtime: WasmRuntime, recording: InstanceRecording, path: str | None
) -> tuple[str, Component]:
    """The sha256 and compiled component of `--program`, else of the recorded program, found
    among the programs `pie serve` keeps or the compiled components."""
    if path is not None:
        return runtime.cache.load(Path(path).read_bytes())
    digest = recording.program
    kept = default_cache_dir() / "programs" / f"{digest}.wasm"
    if kept.exists():
        wasm = kept.read_bytes()
        if hashlib.sha256(wasm).hexdigest() == digest:
            return runtime.cache.load(wasm, digest)
    if any(runtime.cache.directory.glob(f"{digest}-*.cwasm")):
        # Only the compiled form is kept: the cache reads it and never compiles these bytes.
        return runtime.cache.load(b"", digest)
    raise ProgramNotFound(
        f"program {digest[:12]} is neither in {kept.parent} nor compiled in "
        f"{runtime.cache.directory}: give it with --program"
    )


def _replayer(recording: InstanceRecording) -> Replayer:
    finished = recording.finished
    stop = stop_of(finished.status, finished.error or "") if finished else None
    return Replayer(recording.calls, past_end=recording.cut, stopped_at_end=stop)


def _echo(stream: str, data: bytes) -> None:
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write(data.decode("utf-8", errors="replace"))
    out.flush()


def _describe(recording: InstanceRecording, digest: str) -> None:
    program = digest[:12]
    if digest != recording.program:
        program += f" (recorded: {recording.program[:12]})"
    print(
        f"inferlet {recording.instance} of user {recording.user!r}: program {program}, "
        f"{len(recording.calls)} host calls recorded"
    )
    print(f"input: {_cut(recording.input)}")


def _report(recording: InstanceRecording, replayer: Replayer, replayed: Replayed) -> int:
    recorded = recording.finished
    ended = _ending(recorded.status, recorded.result, recorded.error) if recorded else "?"
    print(f"recorded: {ended}")
    outcome = _served(recording, replayer, replayed.outcome)
    print(f"replayed: {_ending(outcome.status, outcome.value, outcome.error)}")
    print(
        f"replayed {replayed.calls} of {len(recording.calls)} host calls in "
        f"{replayed.seconds:.3f} s ({replayer.calls_per_second:.0f} calls/s from the first to "
        "the last)"
    )
    if replayer.divergence is not None:
        _print_divergence(replayer.divergence, len(recording.calls))
        return 1
    if replayer.ran_out:
        print(f"cannot replay past call {replayed.calls}: {recording.cut}")
        return 2
    if recorded is not None and not _same_ending(recorded.status, recorded.result, outcome):
        if replayer.exhausted and replayer.stopped_at_end and outcome.status == "timeout":
            print(f"stopped after the last call, as the recorded run was ({recorded.status})")
            return 0
        _print_other_ending(recorded, outcome)
        return 1
    print("exact replay")
    return 0


def _served(recording: InstanceRecording, replayer: Replayer, outcome: RunOutcome) -> RunOutcome:
    """An HTTP-served program's outcome after the checks the engine makes of the response it
    returned (the head, unless a recorded `respond` sent it, and the last body piece)."""
    if recording.request is None or not outcome.returned:
        return outcome
    replayed = recording.calls[: replayer.position]
    started = any(fn == "serving.respond" and got == {"ok": None} for fn, _, got in replayed)
    response = outcome.value
    try:
        if not started:
            check_head(response.status, response.headers)
        if len(response.body) > MAX_CHUNK_BYTES:
            raise HostFailure(
                "invalid", f"a body piece of {len(response.body)} bytes is over the limit"
            )
    except HostFailure as failure:
        return RunOutcome(status="failed", error=failure.message, seconds=outcome.seconds)
    return outcome


def _same_ending(status: str, result: str | None, outcome: RunOutcome) -> bool:
    """The same status, and the same result when the program returned one (an HTTP-served
    program's response went out through its recorded calls)."""
    if status != outcome.status:
        return False
    return status != "returned" or not isinstance(outcome.value, str) or outcome.value == result


def _ending(status: str, result: Any, error: str | None) -> str:
    if status != "returned":
        return f"{status}: {_cut(error or '')}"
    if isinstance(result, Record):
        body = getattr(result, "body", b"")
        return f"returned a response, status {getattr(result, 'status', '?')}, {len(body)} bytes"
    return f"returned {_cut(str(result))}"


def _print_other_ending(recorded: InferletFinished, outcome: RunOutcome) -> None:
    print(
        "diverged: every host call matched, but the program ended otherwise (it may depend on "
        "what is not recorded: the monotonic clock, files)"
    )
    if recorded.status == outcome.status == "returned" and isinstance(outcome.value, str):
        want, got = recorded.result or "", outcome.value
        at = _first_difference(want, got)
        print(f"  recorded result: {_window(want, at)}")
        print(f"  replayed result: {_window(got, at)}")


def _print_divergence(divergence: Divergence, recorded: int) -> None:
    print(f"diverged at call {divergence.index} (of {recorded} recorded):")
    expected, seen = divergence.expected_args, divergence.seen_args
    at = _first_difference(expected, seen) if divergence.expected_fn == divergence.seen_fn else 0
    want = (
        f"{divergence.expected_fn} {_window(expected, at)}"
        if divergence.expected_fn
        else "no call (the recorded program made no more)"
    )
    got = (
        f"{divergence.seen_fn} {_window(seen, at)}"
        if divergence.seen_fn
        else "no call (the program ended)"
    )
    print(f"  expected: {want}")
    print(f"  seen:     {got}")


def _first_difference(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _window(text: str, at: int) -> str:
    """Up to SHOWN_CHARS of `text` around position `at` (where it differs from the other)."""
    if len(text) <= SHOWN_CHARS:
        return text
    start = max(0, min(at - SHOWN_CHARS // 4, len(text) - SHOWN_CHARS))
    head = "..." if start else ""
    tail = "..." if start + SHOWN_CHARS < len(text) else ""
    return f"{head}{text[start : start + SHOWN_CHARS]}{tail}"


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"... ({len(text)} chars)"
