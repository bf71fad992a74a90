"""The client for code without Trio: the same operations as plain blocking methods, run on a
Trio loop in a background thread."""

from __future__ import annotations

import builtins
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import trio

from pie.client.bus import Watch
from pie.client.connection import CHUNK_SIZE, DEFAULT_URL, Client
from pie.client.errors import ConnectionLost
from pie.client.inferlet import Outcome, ProgramInfo, RemoteInferlet
from pie.client.opening import connect
from pie.wire import messages as msg

T = TypeVar("T")


class _Loop:
    """A thread running `connect(...)` until `stop`; calls hop onto it through its token."""

    def __init__(self) -> None:
        self._ready: queue.Queue[Client | BaseException] = queue.Queue(maxsize=1)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self, url: str, options: dict[str, Any]) -> Client:
        self._thread = threading.Thread(
            target=trio.run, args=(self._serve, url, options), name="pie-client", daemon=True
        )
        self._thread.start()
        started = self._ready.get()
        if isinstance(started, BaseException):
            self._thread.join()
            raise started
        return started

    async def _serve(self, url: str, options: dict[str, Any]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        started = False
        try:
            async with connect(url, **options) as client:
                self._ready.put(client)
                started = True
                await self._stop.wait()
        except BaseException as exc:
            if started:
                raise
            self._ready.put(exc)  # raised again in the thread that called `start`

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise ConnectionLost("the client is closed") from None

    def stop(self) -> None:
        assert self._stop is not None and self._thread is not None
        try:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        except trio.RunFinishedError:
            pass  # the loop already ended
        self._thread.join()


class SyncInferlet:
    """A followed inferlet, as `RemoteInferlet` but blocking."""

    def __init__(self, loop: _Loop, remote: RemoteInferlet) -> None:
        self._loop = loop
        self._remote = remote
        self.instance = remote.instance
        self.queued = remote.queued

    @property
    def last_seq(self) -> int:
        return self._remote.last_seq

    @property
    def outcome(self) -> Outcome | None:
        return self._remote.outcome

    def next_event(self) -> msg.StreamedEvent | None:
        return self._loop.run(self._remote.next_event)

    def events(self) -> Iterator[msg.StreamedEvent]:
        """The lifecycle events, ending after the final one."""
        while (event := self.next_event()) is not None:
            yield event

    def result(self) -> Outcome:
        return self._loop.run(self._remote.result)

    def send(self, message: str | bytes) -> None:
        self._loop.run(self._remote.send, message)

    def send_file(self, path: Path | str) -> None:
        self._loop.run(self._remote.send_file, path)

    def terminate(self) -> None:
        self._loop.run(self._remote.terminate)

    def detach(self) -> None:
        self._loop.run(self._remote.detach)


class SyncWatch:
    """A watched topic, as `Watch` but blocking: iterate it, or call `next()`."""

    def __init__(self, loop: _Loop, watch: Watch) -> None:
        self._loop = loop
        self._watch = watch
        self.topic = watch.topic

    def next(self) -> msg.WatchedMessage | None:
        return self._loop.run(self._watch.next)

    def __iter__(self) -> Iterator[msg.WatchedMessage]:
        while (message := self.next()) is not None:
            yield message

    def stop(self) -> None:
        self._loop.run(self._watch.stop)

    def __enter__(self) -> SyncWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncClient:
    """A connection to a pie server for code without Trio. Make one with `SyncClient.connect`
    and close it (or use it as a context manager)."""

    def __init__(self, loop: _Loop, client: Client) -> None:
        self._loop = loop
        self._client = client

    @classmethod
    def connect(cls, url: str = DEFAULT_URL, **options: Any) -> SyncClient:
        """Takes `connect`'s keyword arguments: user, token, key, key_password, max_frame."""
        loop = _Loop()
        return cls(loop, loop.start(url, options))

    @property
    def welcome(self) -> msg.Welcome | None:
        return self._client.welcome

    @property
    def user(self) -> str | None:
        return self._client.user

    def query_program(self, ref: str) -> ProgramInfo | None:
        return self._loop.run(self._client.query_program, ref)

    def install(
        self,
        wasm: bytes | Path,
        *,
        name: str | None = None,
        version: str = "0.1.0",
        chunk_size: int = CHUNK_SIZE,
        progress: Callable[[int, int], None] | None = None,
    ) -> ProgramInfo:
        async def install() -> ProgramInfo:
            return await self._client.install(
                wasm, name=name, version=version, chunk_size=chunk_size, progress=progress
            )

        return self._loop.run(install)

    def launch(
        self, program: str, input: str | dict[str, Any] = "", *, snapshots: Sequence[str] = ()
    ) -> SyncInferlet:
        async def launch() -> RemoteInferlet:
            return await self._client.launch(program, input, snapshots=snapshots)

        return SyncInferlet(self._loop, self._loop.run(launch))

    def attach(self, instance: str, after: int = 0) -> SyncInferlet:
        return SyncInferlet(self._loop, self._loop.run(self._client.attach, instance, after))

    def send(self, instance: str, message: str | bytes) -> None:
        self._loop.run(self._client.send, instance, message)

    def send_file(self, instance: str, path: Path | str) -> None:
        self._loop.run(self._client.send_file, instance, path)

    def detach(self, instance: str) -> None:
        self._loop.run(self._client.detach, instance)

    def terminate(self, instance: str) -> None:
        self._loop.run(self._client.terminate, instance)

    def statistics(self) -> msg.EngineStatus:
        return self._loop.run(self._client.statistics)

    def watch(self, topic: str) -> SyncWatch:
        return SyncWatch(self._loop, self._loop.run(self._client.watch, topic))

    def publish(self, topic: str, message: str) -> None:
        self._loop.run(self._client.publish, topic, message)

    def push(self, queue: str, message: str) -> None:
        self._loop.run(self._client.push, queue, message)

    def close(self) -> None:
        self._loop.stop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def list(self) -> builtins.list[msg.InferletSummary]:
        return self._loop.run(self._client.list)
