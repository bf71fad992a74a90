"""One client connection: reads frames, answers each request in order, and writes replies and
inferlet events through a bounded outbox (a reader too slow to keep up is disconnected)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from pie.actors.requester import RequestRefused
from pie.server.auth import Credential
from pie.server.bus import BusAccess
from pie.server.hub import Refused
from pie.server.uploads import Uploads
from pie.wire import messages as msg
from pie.wire.frames import FrameError, decode_client_frame, encode_frame

if TYPE_CHECKING:
    from pie.server.app import Server

MAX_AUTH_FAILURES = 3
ABOUT_AN_INFERLET = (msg.Attach, msg.Detach, msg.SendMessage, msg.Terminate)
"""Requests that name an inferlet, which another node of a cluster may run."""
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008


class Session:
    def __init__(self, server: Server, ws: WebSocketConnection, connection: int) -> None:
        self.server = server
        self.ws = ws
        self.connection = connection
        self.user = "local"
        self.authenticated = not server.auth_required
        self.credential: Credential | None = None
        """What this connection authenticated with, read again now and then (revocation)."""
        self._auth_failures = 0
        self._nonce: tuple[str, str] | None = None
        self._uploads = Uploads(
            server.config.max_program_mb << 20,
            max_pending=server.config.max_pending_upload_mb << 20,
            users=server.pending_uploads,
        )
        self._outbox, self._outgoing = trio.open_memory_channel[Any](server.config.send_buffer)
        self._close_code = CLOSE_GOING_AWAY
        self._close_reason = "server stopping"
        self._cancel = trio.CancelScope()
        self._bus = BusAccess(server.engine, connection, self.post)

    async def run(self) -> None:
        with self._cancel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop)
                await nursery.start(self._bus.run)
                if not self.authenticated:
                    nursery.start_soon(self._login_deadline)
                self.post(self.server.welcome())
                await self._read_loop()
                nursery.cancel_scope.cancel()
        self._uploads.close()
        with trio.move_on_after(2, shield=True):
            await self.ws.aclose(self._close_code, self._close_reason)

    async def _login_deadline(self) -> None:
        seconds = self.server.config.login_seconds
        await trio.sleep(seconds)
        if not self.authenticated:
            self.close(CLOSE_POLICY, f"not authenticated within {seconds:g} s")

    def post(self, message: Any) -> None:
        """Queues a frame; a full outbox means the client does not keep up, and it goes."""
        try:
            self._outbox.send_nowait(message)
        except trio.WouldBlock:
            self.close(CLOSE_POLICY, "too slow: events were not read in time")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def close(self, code: int, reason: str) -> None:
        self._close_code, self._close_reason = code, reason
        self._cancel.cancel()

    def finish(self) -> None:
        """Sends what is queued, then closes the connection as the server goes away."""
        self._outbox.close()

    async def _write_loop(self) -> None:
        async with self._outgoing:
            async for message in self._outgoing:
                try:
                    await self.ws.send_message(encode_frame(message))
                except ConnectionClosed:
                    break
        self._cancel.cancel()

    async def _read_loop(self) -> None:
        limit = self.server.config.max_frame_mb << 20
        while True:
            try:
                frame = await self.ws.get_message()
            except ConnectionClosed:
                return
            try:
                request = decode_client_frame(frame, limit)
            except FrameError as err:
                self.post(msg.Failure(corr=err.corr, kind=err.kind, message=str(err)))
                continue
            await self._answer(request)

    async def _answer(self, request: Any) -> None:
        try:
            reply = await self._dispatch(request)
        except Refused as err:
            reply = msg.Failure(corr=request.corr, kind=err.kind, message=err.message)
        except RequestRefused as err:
            kind = err.kind.replace("_", "-")
            reply = msg.Failure(corr=request.corr, kind=kind, message=err.message)
        if reply is not None:
            self.post(reply)

    async def _dispatch(self, request: Any) -> Any:
        if not self.authenticated and not isinstance(
            request, msg.Authenticate | msg.RequestChallenge
        ):
            raise Refused("unauthenticated", "authenticate first")
        server = self.server
        if server.placer is not None and isinstance(request, ABOUT_AN_INFERLET):
            redirect = await server.placer.redirect(request.corr, request.instance)
            if redirect is not None:
                return redirect
        match request:
            case msg.Authenticate():
                return self._authenticate(request)
            case msg.RequestChallenge():
                self._nonce = (request.user, server.new_nonce())
                return msg.ChallengeIssued(corr=request.corr, nonce=self._nonce[1])
            case msg.QueryProgram():
                return await server.find_program(request.corr, request.program, self.user)
            case msg.UploadProgram():
                return await self._upload(request)
            case msg.Launch():
                _check_text("input", request.input)
                return await server.launch(self, request)
            case msg.Attach():
                self._attach(request)
                return None
            case msg.Detach():
                server.hub.detach(self.connection, self.user, request.instance, trio.current_time())
            case msg.SendMessage():
                _check_text("text", request.text)
                await server.send(self.user, request)
            case msg.Terminate():
                await server.terminate(self.user, request.instance)
            case msg.ListInferlets():
                return msg.InferletList(
                    corr=request.corr, inferlets=tuple(server.hub.of_user(self.user))
                )
            case msg.QueryStatistics():
                return server.engine_status(request.corr)
            case msg.Watch():
                await self._bus.watch(request.topic)
            case msg.Unwatch():
                await self._bus.unwatch(request.topic)
            case msg.Publish():
                await self._bus.publish(request.topic, request.message)
            case msg.Push():
                await self._bus.push(request.queue, request.message, self.user)
        return msg.Done(corr=request.corr)

    def _attach(self, request: msg.Attach) -> None:
        hub = self.server.hub
        replay = hub.attach(self.connection, self.user, request.instance, request.after)
        self.post(msg.Done(corr=request.corr))
        for event in replay:
            self.post(event)

    def _authenticate(self, request: msg.Authenticate) -> Any:
        credential = self._credential(request)
        if self.server.auth_required and credential is None:
            self._auth_failures += 1
            if self._auth_failures >= MAX_AUTH_FAILURES:
                self.close(CLOSE_POLICY, "too many failed authentications")
            raise Refused("unauthenticated", f"credentials for {request.user!r} do not check out")
        self.user, self.authenticated = request.user, True
        self.credential = credential
        return msg.Authenticated(corr=request.corr, user=request.user)

    def _credential(self, request: msg.Authenticate) -> Credential | None:
        users = self.server.users
        if users is None or not self.server.auth_required:
            return None
        if request.token is not None:
            return users.token_credential(request.user, request.token)
        if request.signature is not None and self._nonce is not None:
            user, nonce = self._nonce
            self._nonce = None  # one signature per challenge
            if user != request.user:
                return None
            return users.signature_credential(request.user, nonce, request.signature)
        return None

    async def _upload(self, chunk: msg.UploadProgram) -> Any:
        done = self._uploads.add(chunk, self.user)
        if isinstance(done, int):
            return msg.UploadProgress(corr=chunk.corr, received=done)
        try:
            return await self.server.install(chunk.corr, done, self.user)
        finally:
            self._uploads.installed(done)


def _check_text(field: str, text: str | None) -> None:
    """JSON may carry lone surrogates, which are not text an inferlet could receive."""
    try:
        if text is not None:
            text.encode("utf-8")
    except UnicodeEncodeError:
        raise Refused("bad-frame", f"{field} is not valid Unicode (a lone surrogate)") from None
