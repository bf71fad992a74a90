"""The Trio client: one WebSocket to a pie server, requests matched to replies by `corr`, and
each followed inferlet's events kept in its own bounded queue until read."""

from __future__ import annotations

import builtins
import hashlib
import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from pie.client.bus import Watch, Watches
from pie.client.errors import (
    AuthenticationFailed,
    CannotConnect,
    ConnectionLost,
    EventsOverflowed,
    NoSuchProgram,
    PieError,
    server_error,
)
from pie.client.files import file_message, program_info, upload
from pie.client.inferlet import FINAL_EVENTS, ProgramInfo, RemoteInferlet, Subscription
from pie.client.peers import Peers, attach_where_it_runs, followed, launch_placed
from pie.wire import messages as msg
from pie.wire.frames import FrameError, decode_server_frame, encode_frame

DEFAULT_URL = "ws://127.0.0.1:8080"
CHUNK_SIZE = 1 << 20
CONNECT_SECONDS = 30.0
_REPLY_BUFFER = 4  # every request gets one reply; a little slack costs nothing


class Client:
    """A connection to a pie server; made by `connect`. Methods may be called from any number
    of tasks at once."""

    def __init__(self, ws: WebSocketConnection, url: str, max_frame: int) -> None:
        self.url = url
        self.welcome: msg.Welcome | None = None
        self.user: str | None = None
        self._ws = ws
        self._max_frame = max_frame
        self._corrs = itertools.count(1)
        self._waiters: dict[int, trio.MemorySendChannel[Any]] = {}
        self._launching: dict[int, Subscription] = {}
        self._subs: dict[str, Subscription] = {}
        self._watches = Watches()
        self._lost: ConnectionLost | None = None
        self._nursery: trio.Nursery | None = None
        self._peers: Peers | None = None
        """Connections to the nodes of a cluster this one redirected requests to."""

    @property
    def where(self) -> str:
        """The server, for messages: its URL, and its node id in a cluster."""
        node = self.welcome.node if self.welcome is not None else ""
        return f"node {node} at {self.url}" if node else self.url

    @property
    def lost(self) -> ConnectionLost | None:
        """Why the connection is gone, or None while it is open."""
        return self._lost

    async def query_program(self, ref: str) -> ProgramInfo | None:
        """The installed program named by `ref` (content hash, name or name@version), or None."""
        try:
            found = await self._call(msg.QueryProgram(corr=self._corr(), program=ref))
        except NoSuchProgram:
            return None
        return program_info(found)

    async def install(
        self,
        wasm: bytes | Path,
        *,
        name: str | None = None,
        version: str = "0.1.0",
        chunk_size: int = CHUNK_SIZE,
        progress: Callable[[int, int], None] | None = None,
    ) -> ProgramInfo:
        """Installs a program, uploading it only when the server lacks it (under `name@version`
        when a name is given). `progress(sent, total)` is called per uploaded chunk."""
        data = wasm.read_bytes() if isinstance(wasm, Path) else bytes(wasm)
        digest = hashlib.sha256(data).hexdigest()
        found = await self.query_program(digest if name is None else f"{name}@{version}")
        if found is not None and found.hash == digest:
            return found
        if name is None:
            name = wasm.stem if isinstance(wasm, Path) else digest[:12]
        return await upload(self, data, digest, name, version, chunk_size, progress)

    async def launch(
        self,
        program: str,
        input: str | dict[str, Any] = "",
        *,
        snapshots: Sequence[str] = (),
        here: bool = False,
    ) -> RemoteInferlet:
        """Starts `program` (hash, name or name@version) and follows its events from seq 1.
        In a cluster it runs where the node places it (on the node holding the named
        `snapshots`, else the least-loaded): the returned inferlet may live on another node,
        reached through a connection of this client's own. With `here`, it runs on the node
        this client is connected to."""
        text = input if isinstance(input, str) else json.dumps(input)
        return await launch_placed(self, program, text, tuple(snapshots), here=here)

    async def _launch(
        self, program: str, text: str, snapshots: tuple[str, ...], *, placed: bool
    ) -> RemoteInferlet | msg.Redirect:
        corr = self._corr()
        sub = self._launching[corr] = Subscription("")
        request = msg.Launch(
            corr=corr, program=program, input=text, snapshots=snapshots, placed=placed
        )
        try:
            launched = await self._call(request)
        finally:
            del self._launching[corr]
        if isinstance(launched, msg.Redirect):
            return launched
        return RemoteInferlet(self, sub, queued=launched.queued)

    async def attach(self, instance: str, after: int = 0) -> RemoteInferlet:
        """Follows a running (or recently ended) inferlet, replaying its events after `after`;
        in a cluster, through a connection to the node that runs it."""
        return await attach_where_it_runs(self, instance, after)

    async def _attach(self, instance: str, after: int) -> RemoteInferlet | msg.Redirect:
        sub = self._subscribe(Subscription(instance))
        try:
            reply = await self._call(msg.Attach(corr=self._corr(), instance=instance, after=after))
        except BaseException:
            self._unsubscribe(sub)
            raise
        if isinstance(reply, msg.Redirect):
            self._unsubscribe(sub)
            return reply
        inferlet = RemoteInferlet(self, sub)
        inferlet.last_seq = after
        return inferlet

    async def send(self, instance: str, message: str | bytes) -> None:
        text, data = (message, None) if isinstance(message, str) else (None, bytes(message))
        await followed(
            self, lambda corr: msg.SendMessage(corr=corr, instance=instance, text=text, data=data)
        )

    async def send_file(self, instance: str, path: Path | str) -> None:
        """Sends a file's bytes as one message; `MessageTooLarge` before anything is sent when
        it cannot fit in a frame (`connect(max_frame=)`, as large as the server's)."""
        await followed(self, lambda corr: file_message(corr, instance, Path(path), self._max_frame))

    async def detach(self, instance: str) -> None:
        """Stops following an inferlet; it keeps running."""
        await followed(self, lambda corr: msg.Detach(corr=corr, instance=instance))
        sub = self._subs.get(instance)
        if sub is not None:
            self._unsubscribe(sub)

    async def terminate(self, instance: str) -> None:
        """Asks the server to stop an inferlet; its final event follows to attached clients."""
        await followed(self, lambda corr: msg.Terminate(corr=corr, instance=instance))

    async def _peer(self, redirect: msg.Redirect) -> Client:
        if redirect.url == self.url or self._peers is None:
            return self
        return await self._peers.get(redirect)

    async def statistics(self) -> msg.EngineStatus:
        reply: msg.EngineStatus = await self._call(msg.QueryStatistics(corr=self._corr()))
        return reply

    async def watch(self, topic: str) -> Watch:
        """Follows every message broadcast on `topic` (by inferlets or clients) from now on.
        Messages wait in the returned `Watch` until read, up to 65536."""
        watch = self._watches.open(topic, self._stop_watch)
        try:
            await self._call(msg.Watch(corr=self._corr(), topic=topic))
        except BaseException:
            self._watches.close(watch)
            raise
        return watch

    async def publish(self, topic: str, message: str) -> None:
        """Broadcasts `message` to the topic's current subscribers, as an inferlet would."""
        await self._call(msg.Publish(corr=self._corr(), topic=topic, message=message))

    async def push(self, queue: str, message: str) -> None:
        """Appends `message` to a queue, for one inferlet's `messaging.pull`."""
        await self._call(msg.Push(corr=self._corr(), queue=queue, message=message))

    async def close(self) -> None:
        await self._ws.aclose()

    async def list(self) -> builtins.list[msg.InferletSummary]:
        """This user's inferlets that are queued, running or stopping."""
        reply = await self._call(msg.ListInferlets(corr=self._corr()))
        return list(reply.inferlets)

    # -- plumbing ----------------------------------------------------------------------------

    def _corr(self) -> int:
        return next(self._corrs)

    async def _call(self, request: Any, progress: Callable[[int], None] | None = None) -> Any:
        """Sends `request` and returns its reply; `UploadProgress` replies go to `progress`
        until the one that ends the exchange."""
        replies = self._expect_replies(request.corr)
        try:
            await self._send(request)
            while True:
                reply = await self._next_reply(replies)
                if isinstance(reply, msg.Failure):
                    raise server_error(reply.kind, reply.message)
                if not isinstance(reply, msg.UploadProgress) or progress is None:
                    return reply
                progress(reply.received)
        finally:
            del self._waiters[request.corr]

    def _expect_replies(self, corr: int) -> trio.MemoryReceiveChannel[Any]:
        if self._lost is not None:
            raise self._lost
        send, receive = trio.open_memory_channel[Any](_REPLY_BUFFER)
        self._waiters[corr] = send
        return receive

    async def _send(self, request: Any) -> None:
        try:
            await self._ws.send_message(encode_frame(request))
        except ConnectionClosed as exc:
            self._lose(ConnectionLost(f"connection to {self.where} closed: {_why(exc)}"))
            raise self._lost from None  # type: ignore[misc]

    async def _next_reply(self, replies: trio.MemoryReceiveChannel[Any]) -> Any:
        try:
            return await replies.receive()
        except trio.EndOfChannel:
            raise self._lost or ConnectionLost("connection closed") from None

    async def _start(self, nursery: trio.Nursery) -> None:
        try:
            first = decode_server_frame(await self._ws.get_message(), self._max_frame)
        except (ConnectionClosed, FrameError) as exc:
            raise CannotConnect(self.url, f"no welcome from the server ({exc})") from None
        if not isinstance(first, msg.Welcome):
            raise CannotConnect(self.url, f"expected Welcome, got {type(first).__name__}")
        if first.protocol != msg.PROTOCOL_VERSION:
            raise CannotConnect(self.url, f"the server speaks protocol {first.protocol}")
        self.welcome = first
        self._nursery = nursery
        nursery.start_soon(self._read_loop)

    async def _authenticate(
        self, user: str | None, token: str | None, key: Path | None, password: str | None
    ) -> None:
        if user is None:
            return
        signature = None
        if key is not None:
            challenge = await self._call(msg.RequestChallenge(corr=self._corr(), user=user))
            signature = _sign(key, challenge.nonce, password)
        request = msg.Authenticate(corr=self._corr(), user=user, token=token, signature=signature)
        self.user = (await self._call(request)).user

    async def _read_loop(self) -> None:
        try:
            while True:
                frame = await self._ws.get_message()
                self._dispatch(decode_server_frame(frame, self._max_frame))
        except ConnectionClosed as exc:
            self._lose(ConnectionLost(f"connection to {self.where} closed: {_why(exc)}"))
        except FrameError as exc:
            self._lose(ConnectionLost(f"unreadable frame from {self.where}: {exc}"))
            await self._ws.aclose()

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, msg.InferletEvent):
            self._deliver(message)
            return
        if isinstance(message, msg.WatchedMessage):
            overflowed = self._watches.deliver(message)
            if overflowed is not None:
                self._later(msg.Unwatch(corr=self._corr(), topic=overflowed.topic))
            return
        corr = getattr(message, "corr", None)
        if isinstance(message, msg.Launched) and corr in self._launching:
            sub = self._launching[corr]
            sub.instance = message.instance
            self._subscribe(sub)
        waiter = self._waiters.get(corr)  # type: ignore[arg-type]
        if waiter is not None:
            try:
                waiter.send_nowait(message)
            except trio.WouldBlock:
                pass  # more replies than any request gets: the server is wrong, not this one

    def _deliver(self, message: msg.InferletEvent) -> None:
        sub = self._subs.get(message.instance)
        if sub is None:
            return  # an inferlet this client no longer follows
        try:
            sub.send.send_nowait(message)
        except trio.WouldBlock:
            # Blocking here would stall every reply and every other inferlet on this connection.
            self._unsubscribe(sub, EventsOverflowed(sub.instance, message.seq - 1))
            self._later(msg.Detach(corr=self._corr(), instance=sub.instance))
            return
        if isinstance(message.event, FINAL_EVENTS):
            sub.ended = True
            self._unsubscribe(sub)

    def _later(self, request: msg.Detach | msg.Unwatch) -> None:
        """Sends a request from a task of its own, for the reader task, which must not wait."""
        assert self._nursery is not None
        self._nursery.start_soon(self._call_quietly, request)

    async def _call_quietly(self, request: msg.Detach | msg.Unwatch) -> None:
        with trio.move_on_after(CONNECT_SECONDS):
            try:
                await self._call(request)
            except PieError:
                pass  # it ended meanwhile or the connection went: nothing is left to stop

    async def _stop_watch(self, watch: Watch) -> None:
        self._watches.close(watch)
        await self._call(msg.Unwatch(corr=self._corr(), topic=watch.topic))

    def _subscribe(self, sub: Subscription) -> Subscription:
        old = self._subs.get(sub.instance)
        if old is not None:
            old.close(PieError(f"{sub.instance} was attached again on this connection"))
        self._subs[sub.instance] = sub
        return sub

    def _unsubscribe(self, sub: Subscription, error: PieError | None = None) -> None:
        if self._subs.get(sub.instance) is sub:
            del self._subs[sub.instance]
        sub.close(error)

    def _lose(self, error: ConnectionLost) -> None:
        """Fails every waiting request and event stream; later calls raise `error` at once."""
        if self._lost is not None:
            return
        self._lost = error
        for waiter in self._waiters.values():
            waiter.close()
        for sub in list(self._subs.values()) + list(self._launching.values()):
            self._unsubscribe(sub, error)
        self._watches.close_all(error)


def _why(exc: ConnectionClosed) -> str:
    reason = exc.reason
    return f"{reason.code} {reason.reason or reason.name}" if reason is not None else "closed"


def _sign(key: Path, nonce: str, password: str | None) -> str:
    from pie.wire.challenge import AuthError, sign_nonce

    try:
        return sign_nonce(key, nonce, password)
    except AuthError as exc:
        raise AuthenticationFailed("unauthenticated", str(exc)) from None
