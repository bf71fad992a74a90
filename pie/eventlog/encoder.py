"""Where the event log's file writer turns records into JSON lines and writes them: on its own
thread (`ThreadSink`, for a file object the caller opened), or in a child process
(`ProcessSink`, what an engine with a log file uses), which takes the records as the ring packs
them, so the engine's process spends a pickle of nested tuples on a record rather than its
encoding.

The child runs `main(FD)`: it reads length-prefixed pickled requests from its standard input
and answers each on its standard output. Only the engine's own process writes to that pipe.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import IO, Any

from attrs import frozen

from pie.eventlog import packed
from pie.eventlog.records import Gap, Row, row_json

_LENGTH = struct.Struct("<I")

YIELD_EVERY = 8
"""Records encoded on a thread of the engine's process between two offers of the GIL (and the
processor). Encoding holds the GIL, about 5 us a record, and a thread that wants it meanwhile
(the Trio thread, the pass loop, a guest's host call) would otherwise wait for the whole batch.
A 5 ms pass that logs 160 records (`scripts/bench_event_log.py --critical`) took 1.4 ms beyond
its 5 ms when the writer never offered the GIL, 0.65 to 0.9 ms when it did every 4 to 32
records, 0.3 ms with no log."""


NICENESS = 15
"""How much the encoder process lowers its priority: on a machine whose cores the engine keeps
busy (guests, the pass loop), the encoding waits rather than delays them; the writer's queue
and its bound (`max_unwritten`) absorb the wait."""


class SinkFailed(Exception):
    """The file (or the process writing it) took no more records; the text says why."""


@frozen
class Written:
    """What one batch came to: records written, and the records that could not be encoded
    (each written as a gap instead), as (seq, reason)."""

    encoded: int
    unencodable: tuple[tuple[int, str], ...] = ()


def _unencodable(exc: Exception) -> str:
    return f"could not encode the record: {type(exc).__name__}: {exc}"


def lines_of(
    items: list[Any], convert: Callable[[Any], Row] | None = None, yield_every: int = 0
) -> tuple[str, Written]:
    """The JSON lines of `items` (rows, or what `convert` makes rows of, and gaps) in order, a
    record that cannot be encoded becoming a gap; with `yield_every`, the GIL is offered after
    every so many records."""
    lines: list[str] = []
    encoded = 0
    unencodable: list[tuple[int, str]] = []
    for item in items:
        if isinstance(item, Gap):
            lines.append(item.to_json())
            continue
        try:
            lines.append(row_json(convert(item) if convert else item))
        except Exception as exc:  # a bug in an event's codec: that record becomes a gap
            reason = _unencodable(exc)
            unencodable.append((item[0], reason))
            lines.append(Gap(first=item[0], last=item[0], reason=reason).to_json())
            continue
        encoded += 1
        if yield_every and encoded % yield_every == 0:
            os.sched_yield()  # releases the GIL: a waiting thread takes it
    return "\n".join(lines) + "\n", Written(encoded, tuple(unencodable))


class ThreadSink:
    """Encodes on the writer's thread and writes to a file object; with `convert`, items are
    made rows by it first. `yield_every` as for `lines_of` (0 in a process of its own)."""

    packed = False

    def __init__(
        self,
        file: IO[str],
        convert: Callable[[Any], Row] | None = None,
        yield_every: int = YIELD_EVERY,
    ) -> None:
        self._file = file
        self._convert = convert
        self._yield_every = yield_every

    def write(self, items: list[Any]) -> Written:
        text, written = lines_of(items, self._convert, self._yield_every)
        try:
            self._file.write(text)
            self._file.flush()
        except Exception as exc:
            raise SinkFailed(f"{type(exc).__name__}: {exc}") from exc
        return written

    def close(self, last: Gap | None) -> None:
        try:
            if last is not None:
                self._file.write("\n" + last.to_json() + "\n")
        finally:
            self._file.close()


class ProcessSink:
    """Hands packed records to a child process that encodes and writes them to `path` (already
    opened for writing as `file`, whose descriptor the child takes over)."""

    packed = True

    def __init__(self, file: IO[str], path: str) -> None:
        """Starts the child; OSError when it cannot be started (`file` is then left open)."""
        self._path = path
        self._adopted = 0
        fd = file.fileno()
        self._child = subprocess.Popen(
            [sys.executable, "-c", f"from pie.eventlog.encoder import main; main({fd})"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(fd,),
            start_new_session=True,  # a Ctrl-C for the engine must not stop its log first
        )
        file.close()  # the child has its own copy
        self._failed = False

    def write(self, items: list[Row | Gap]) -> Written:
        classes = packed.classes_from(self._adopted)
        self._adopted += len(classes)
        try:
            request = _pickled(("write", classes, items))
            refused: list[tuple[int, str]] = []
        except Exception:  # an event that cannot be pickled: it becomes a gap, the rest go
            items, refused = _picklable(items)
            request = _pickled(("write", classes, items))
        answer = self._ask(request)
        if isinstance(answer, str):
            raise SinkFailed(answer)
        assert isinstance(answer, Written)
        if refused:
            return Written(answer.encoded, (*refused, *answer.unencodable))
        return answer

    def close(self, last: Gap | None) -> None:
        if not self._failed:
            try:
                _, error = self._ask(_pickled(("close", last)))
            except SinkFailed:
                pass
            else:
                if error is not None:
                    raise SinkFailed(error)
                return
        if last is not None:  # the child is gone: the gap is written here
            with open(self._path, "a", encoding="utf-8") as file:
                file.write("\n" + last.to_json() + "\n")

    def _ask(self, request: bytes) -> Any:
        """Sends a pickled request (its length first) and waits for the answer."""
        child = self._child
        assert child.stdin is not None and child.stdout is not None
        closing = True
        try:
            child.stdin.write(request)
            child.stdin.flush()
            answer = _receive(child.stdout)
            closing = isinstance(answer, tuple)
            return answer
        except Exception as exc:  # the child died, or answered what cannot be read
            self._failed = True
            code = child.poll()
            raise SinkFailed(
                f"the log's encoder process stopped (exit code {code}): {exc}"
            ) from exc
        finally:
            if closing:
                _close_pipes(child)
                child.wait()


def _pickled(request: tuple[Any, ...]) -> bytes:
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def _picklable(items: list[Row | Gap]) -> tuple[list[Row | Gap], list[tuple[int, str]]]:
    """`items` with each record that cannot be pickled replaced by a gap, and why."""
    kept: list[Row | Gap] = []
    refused: list[tuple[int, str]] = []
    for item in items:
        try:
            pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            assert not isinstance(item, Gap)
            reason = _unencodable(exc)
            refused.append((item[0], reason))
            kept.append(Gap(first=item[0], last=item[0], reason=reason))
            continue
        kept.append(item)
    return kept, refused


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("no answer")
    (size,) = _LENGTH.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("a torn answer")
    return pickle.loads(body)


def _close_pipes(child: subprocess.Popen[bytes]) -> None:
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def _unpacked(item: Any) -> Row:
    seq, time, src, dst, cause, event = item
    return (seq, time, src, dst, cause, packed.unpack(event))


def main(fd: int) -> None:
    """The child: answers each request until told to close or its input ends."""
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    # The answers get standard output to themselves: anything printed goes to standard error.
    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    file = os.fdopen(fd, "w", encoding="utf-8")
    sink = ThreadSink(file, _unpacked, yield_every=0)
    failed = ""
    while True:
        try:
            request = _receive(requests)
        except EOFError:  # the engine's process is gone
            file.close()
            return
        if request[0] == "close":
            try:
                sink.close(request[1])
                error = None
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            _answer(answers, ("closed", error))
            return
        _, classes, items = request
        packed.adopt(classes)
        if failed:
            _answer(answers, failed)
            continue
        try:
            answer: Any = sink.write(items)
        except SinkFailed as exc:
            failed = str(exc)
            answer = failed
        _answer(answers, answer)


def _answer(stream: IO[bytes], answer: Any) -> None:
    data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()
