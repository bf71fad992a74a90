"""One inferlet instance's recording, gathered from a log file: how it was launched (program
hash, input, HTTP request), its recorded host calls in order, what it printed and how it
ended; and whether the recording is whole."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from attrs import frozen

from pie.eventlog.log import read_entries
from pie.eventlog.records import Envelope
from pie.events import inferlet as ev
from pie.events.recording import HostCallsRecorded


class RecordingError(ValueError):
    """A log that holds no usable recording of the instance (the text says why)."""


@frozen(kw_only=True)
class InstanceRecording:
    instance: str
    program: str
    """The program's content hash."""
    input: str
    request: ev.IncomingRequest | None
    user: str
    calls: tuple[Any, ...]
    """[function, arguments, result] of each host call, in order."""
    cut: str | None
    """Why the recording holds no calls past its last though the instance went on (a size cap,
    a hole in the log), or None when it is whole."""
    finished: ev.InferletFinished | None
    """How the instance ended, when the log says."""
    output: str
    """What the instance wrote to stdout and stderr."""


def read_recording(path: str | Path, instance: str) -> InstanceRecording:
    """The recording of `instance` in the log file at `path`; RecordingError when there is none
    to replay."""
    found = _Found(instance)
    for entry in read_entries(path):
        if isinstance(entry, Envelope):
            found.take(entry)
    return found.recording()


class _Found:
    """What the log says about one instance, gathered in one pass."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.launches: dict[tuple[str, int], ev.LaunchInferlet] = {}
        self.launch: ev.LaunchInferlet | None = None
        self.program: str | None = None
        self.chunks: list[HostCallsRecorded] = []
        self.finished: ev.InferletFinished | None = None
        self.output: list[str] = []
        self.recorded: set[str] = set()

    def take(self, envelope: Envelope) -> None:
        event = envelope.event
        match event:
            case ev.LaunchInferlet():
                self.launches[(event.requester, event.corr)] = event
            case ev.InferletLaunched(instance=self.instance):
                self.launch = self.launches.get((envelope.dst, event.corr))
            case ev.InferletStarted(instance=self.instance):
                self.program = event.program
            case HostCallsRecorded():
                self.recorded.add(event.instance)
                if event.instance == self.instance:
                    self.chunks.append(event)
            case ev.InferletOutput(instance=self.instance) if envelope.dst == "inferlets":
                self.output.append(event.text)
            case ev.InferletFinished(instance=self.instance):
                self.finished = event

    def recording(self) -> InstanceRecording:
        if not self.chunks:
            raise RecordingError(self._why_none())
        if self.launch is None or self.program is None:
            raise RecordingError(
                f"the log lacks the launch of inferlet {self.instance} (its program and input)"
            )
        calls, cut = _assemble(self.chunks)
        return InstanceRecording(
            instance=self.instance,
            program=self.program,
            input=self.launch.input,
            request=self.launch.request,
            user=self.launch.user,
            calls=tuple(calls),
            cut=cut,
            finished=self.finished,
            output="".join(self.output),
        )

    def _why_none(self) -> str:
        if self.recorded:
            listed = ", ".join(sorted(self.recorded, key=_instance_order)[:20])
            return f"the log holds no recording of inferlet {self.instance}; recorded: {listed}"
        return (
            "the log holds no recorded host calls: record them with [event_log] "
            "record_inferlets = true"
        )


def _instance_order(instance: str) -> tuple[int, str]:
    digits = instance.lstrip("i")
    return (int(digits), instance) if digits.isdigit() else (0, instance)


def _assemble(chunks: Iterable[HostCallsRecorded]) -> tuple[list[Any], str | None]:
    """The calls of the chunks in order, and why they stop early, if they do."""
    calls: list[Any] = []
    for chunk in sorted(chunks, key=lambda c: c.first):
        if chunk.first != len(calls):
            return calls, f"calls {len(calls)} to {chunk.first - 1} are not in the log"
        calls.extend(_calls_of(chunk))
        if chunk.stopped:
            return calls, f"the recording stopped there: {chunk.stopped}"
        if chunk.final:
            return calls, None
    return calls, "the log ends before the instance did"


def _calls_of(chunk: HostCallsRecorded) -> list[Any]:
    try:
        calls = json.loads(chunk.calls)
    except json.JSONDecodeError as exc:
        raise RecordingError(f"calls from {chunk.first} of {chunk.instance}: {exc}") from exc
    if not all(isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) for c in calls):
        raise RecordingError(f"calls from {chunk.first} of {chunk.instance} are malformed")
    return list(calls)
