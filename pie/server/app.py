"""The WebSocket server: one Session per connection, inferlets launched for them through one
engine requester, their events fanned out to attached connections, and a graceful stop."""

from __future__ import annotations

import collections
import ipaddress
import itertools
import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import trio_websocket
from attrs import frozen

from pie import __version__
from pie.actors.inferlet.programs import NameTaken, ProgramError, ProgramInfo
from pie.actors.requester import InferletRun, Requester, RequestRefused
from pie.config import ServerConfig
from pie.events import inferlet as inf_ev
from pie.events import kv as kv_ev
from pie.sandbox import InvalidProgram
from pie.server.hub import Hub, Refused
from pie.server.installed import InstalledPrograms
from pie.server.session import CLOSE_POLICY, Session
from pie.server.status import engine_status, model_card
from pie.server.uploads import PendingBytes, Upload, check_hash
from pie.wire import messages as msg

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pie.cluster.programs import SharedPrograms
    from pie.engine import Engine
    from pie.server.auth import UserChecks
    from pie.server.placing import Placer

SWEEP_SECONDS = 0.5
STOP_WAIT_SECONDS = 10.0
"""After the grace period: how long terminated inferlets get to report their end."""


@frozen(kw_only=True)
class ServerStatistics:
    connections: int
    inferlets_live: int
    inferlets_retained: int
    connections_accepted: int = 0
    replies: tuple[tuple[str, int], ...] = ()
    """Requests answered, by outcome: "ok", or the kind of the `Failure` that refused them."""
    events_sent: int = 0
    """Frames sent that answer no request (inferlet and bus events, the welcome)."""


def auth_required(config: ServerConfig) -> bool:
    if config.auth != "auto":
        return config.auth == "on"
    return not _is_loopback(config.host)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """Start with `await nursery.start(server.run)` (it reports the bound port); `stop()` ends
    it gracefully. It serves on `sockets` when given them listening (see bind_ports)."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        *,
        users: UserChecks | None = None,
        sockets: Sequence[socket.socket] = (),
        shared_programs: SharedPrograms | None = None,
        placer: Placer | None = None,
    ) -> None:
        self.engine = engine
        self.placer = placer
        """On a clustered node: where launches go and which node runs an inferlet."""
        self.config = config
        self.auth_required = auth_required(config)
        if users is None and self.auth_required:
            from pie.server.auth import UserStore, default_users_dir

            users = UserStore(Path(config.users_dir) if config.users_dir else default_users_dir())
        self.users = users
        self.hub = Hub(
            event_buffer=config.event_buffer,
            event_buffer_bytes=int(config.event_buffer_mb * (1 << 20)),
            user_buffer_bytes=int(config.event_buffer_user_mb * (1 << 20)),
            orphan_seconds=config.orphan_seconds,
            retain_seconds=config.retain_seconds,
        )
        self.sessions: dict[int, Session] = {}
        self.stopping = False
        self.port = 0
        self._sockets = list(sockets)
        self._connection_ids = itertools.count(1)
        self._accepted = 0
        self._replies = collections.Counter[str]()
        self._events_sent = 0
        self._listening = trio.CancelScope()
        self._stopped = trio.Event()
        self._compiles = trio.CapacityLimiter(config.max_compiles)
        self._compiles_of: dict[str, trio.CapacityLimiter] = {}
        self.pending_uploads = PendingBytes(config.max_pending_upload_mb_per_user << 20)
        programs_dir = config.programs_dir or engine.wasm.cache.directory.parent / "programs"
        self.installed = InstalledPrograms(Path(programs_dir))
        self.node_programs = None
        if shared_programs is not None:
            from pie.server.shared_programs import NodePrograms

            self.node_programs = NodePrograms(
                shared_programs, engine, self.installed, self._compiles
            )
        self._requester: Requester | None = None
        self._nursery: trio.Nursery | None = None

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"ws://{host}:{self.port}"

    async def run(self, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await trio.to_thread.run_sync(self.installed.restore, self.engine.programs)
            async with self.engine.requester("server") as requester, trio.open_nursery() as nursery:
                self._requester, self._nursery = requester, nursery
                listener = await nursery.start(self._listen)
                self.port = listener.port
                nursery.start_soon(self._sweep_forever)
                nursery.start_soon(self._check_credentials_forever)
                task_status.started(self)
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            # Whatever ended the server, nobody may wait on it to stop any more.
            self.stopping = True
            self._stopped.set()

    async def _listen(self, *, task_status: trio.TaskStatus[Any]) -> None:
        assert self._nursery is not None
        limit = self.config.max_frame_mb << 20
        bound = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in self._sockets]
        server = trio_websocket.WebSocketServer(
            self._connected,
            bound or await trio.open_tcp_listeners(self.config.port, host=self.config.host),
            handler_nursery=self._nursery,
            # Frames up to twice the limit are read and refused with `too-large`; beyond that
            # the WebSocket layer closes the connection (1009).
            max_message_size=2 * limit,
            receive_buffer_size=1 << 16,
        )
        with self._listening:
            await server.run(task_status=task_status)

    async def stop(self, grace: float | None = None) -> None:
        """Stops accepting, lets inferlets finish for `grace` seconds, terminates the rest,
        delivers every remaining event and closes the connections."""
        if self.stopping:
            await self._stopped.wait()
            return
        self.stopping = True
        self._listening.cancel()
        with trio.move_on_after(self.config.shutdown_seconds if grace is None else grace):
            await self._until(lambda: not self.hub.live_instances())
        for instance in self.hub.live_instances():
            await self._terminate_quietly(instance)
        with trio.move_on_after(STOP_WAIT_SECONDS):
            await self._until(lambda: not self.hub.live_instances())
        for session in list(self.sessions.values()):
            session.finish()
        with trio.move_on_after(STOP_WAIT_SECONDS):
            await self._until(lambda: not self.sessions)
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def _until(self, condition: Any) -> None:
        while not condition():
            await trio.sleep(0.02)

    # -- connections ---------------------------------------------------------------------------

    async def _connected(self, request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        if self.stopping:
            await ws.aclose(1001, "server stopping")
            return
        connection = next(self._connection_ids)
        self._accepted += 1
        session = _CountedSession(self, ws, connection)
        self.sessions[connection] = session
        try:
            await session.run()
        finally:
            del self.sessions[connection]
            self.hub.disconnected(connection, trio.current_time())
            self._sweep()

    def welcome(self) -> msg.Welcome:
        return msg.Welcome(
            protocol=msg.PROTOCOL_VERSION,
            server=f"pie {__version__}",
            model=self.engine.info.model_name,
            auth_required=self.auth_required,
            node=self.placer.node_id if self.placer is not None else "",
            models=tuple(
                model_card(m.name, m.info.inputs, m.info.outputs) for m in self.engine.models
            ),
        )

    def new_nonce(self) -> str:
        from pie.wire.challenge import new_nonce

        return new_nonce()

    # -- inferlets -----------------------------------------------------------------------------

    async def launch(self, session: Session, request: msg.Launch) -> msg.Launched | msg.Redirect:
        """Runs the launch here, or on a clustered node may send the client to the node it
        belongs on (never a launch that was sent here: `placed`)."""
        if self.stopping:
            raise Refused("shutting-down", "the server is stopping")
        if self.placer is not None and not request.placed:
            target = await self.placer.place(session.user, request.snapshots)
            if target is not None:
                return msg.Redirect(corr=request.corr, node=target.node_id, url=target.ws_url)
        info = await self._resolve(request.program, session.user)
        assert self._requester is not None and self._nursery is not None
        run = await self._requester.launch(info.hash, request.input, user=session.user)
        instance = run.instance if self.placer is None else self.placer.cluster_id(run.instance)
        self.hub.launched(
            instance,
            user=session.user,
            program=f"{info.name}@{info.version}",
            connection=session.connection,
            queued=run.queued,
            engine_id=run.instance,
        )
        self._nursery.start_soon(self._forward_events, run)
        return msg.Launched(corr=request.corr, instance=instance, queued=run.queued)

    async def _forward_events(self, run: InferletRun) -> None:
        try:
            async for event in run.stream():
                for connection, message in self.hub.record(event, trio.current_time()):
                    session = self.sessions.get(connection)
                    if session is not None:
                        session.post(message)
        except RuntimeError:  # the engine stopped first; nothing more will come
            pass

    async def send(self, user: str, request: msg.SendMessage) -> None:
        try:
            inf_ev.check_one_payload(request.text, request.data)
        except ValueError as err:
            raise Refused("bad-frame", f"bad SendMessage: {err}") from None
        tracked = self.hub.live(user, request.instance)
        assert self._requester is not None
        await self._requester.call(
            "inferlets",
            inf_ev.SendToInferlet,
            instance=tracked.engine_id,
            text=request.text,
            data=request.data,
        )

    async def terminate(self, user: str, instance: str) -> None:
        tracked = self.hub.live(user, instance)
        self.hub.stopping(instance)
        assert self._requester is not None
        await self._requester.call(
            "inferlets", inf_ev.TerminateInferlet, instance=tracked.engine_id
        )

    async def _terminate_quietly(self, instance: str) -> None:
        assert self._requester is not None
        engine_id = self.hub.engine_id(instance)
        try:
            await self._requester.call("inferlets", inf_ev.TerminateInferlet, instance=engine_id)
        except RequestRefused:  # it ended meanwhile
            pass

    async def _check_credentials_forever(self) -> None:
        known = self.users.names() if self.users is not None else set()
        while True:
            await trio.sleep(self.config.credential_check_seconds)
            self.check_credentials()
            if self.users is not None:
                now = self.users.names()
                for user in sorted(known - now):
                    await self.forget_user(user)
                known = now

    async def forget_user(self, user: str) -> None:
        """A removed user's named snapshots are deleted and their pages freed (their
        connections are closed by `check_credentials`)."""
        assert self._requester is not None
        log.info("user %r was removed: deleting their snapshots", user)
        for model in self.engine.models:
            await self._requester.call(model.kv_address, kv_ev.DropSnapshots, user=user)

    def check_credentials(self) -> None:
        """Closes the connections whose user was removed or whose token or key was replaced;
        their inferlets are left as any disconnected client's are (the orphan rule)."""
        if self.users is None:
            return
        verdicts: dict[Any, bool] = {}
        for session in list(self.sessions.values()):
            credential = session.credential
            if credential is None:
                continue
            if credential not in verdicts:
                verdicts[credential] = self.users.holds(credential)
            if not verdicts[credential]:
                session.close(CLOSE_POLICY, f"the credentials of {credential.user!r} were revoked")

    async def _sweep_forever(self) -> None:
        while True:
            await trio.sleep(SWEEP_SECONDS)
            self._sweep()

    def _sweep(self) -> None:
        """Terminates inferlets left alone too long; forgets ended ones past retention."""
        if self._nursery is None:
            return
        for instance in self.hub.due(trio.current_time()):
            self._nursery.start_soon(self._terminate_quietly, instance)

    # -- programs and statistics ---------------------------------------------------------------

    async def _resolve(self, reference: str, user: str) -> Any:
        if self.node_programs is not None:
            return await self.node_programs.resolve(reference, user)
        try:
            return self.engine.programs.resolve(reference, user).info
        except ProgramError as err:
            raise Refused("no-such-program", str(err)) from None

    async def find_program(self, corr: int, reference: str, user: str) -> msg.ProgramFound:
        return _found(corr, await self._resolve(reference, user))

    async def install(self, corr: int, upload: Upload, user: str) -> msg.ProgramFound:
        """Checks the name, the hash and compiles the component off the event loop (one user's
        compiles wait for each other), then adds it to `user`'s names and keeps it on disk."""
        programs = self.engine.programs
        try:
            programs.check_free(upload.name, upload.version, upload.hash, owner=user)
            limiter = self._compiles_of.setdefault(
                user, trio.CapacityLimiter(self.config.max_compiles_per_user)
            )
            async with limiter, self._compiles:
                await trio.to_thread.run_sync(self._check_and_compile, upload)
            if self.node_programs is not None:
                size = len(upload.wasm)
                label = ProgramInfo(
                    hash=upload.hash, name=upload.name, version=upload.version, size=size
                )
                await self.node_programs.bind(user, label, upload.wasm)
            info = programs.add(
                upload.wasm, upload.name, upload.version, owner=user, digest=upload.hash
            )
        except NameTaken as err:
            raise Refused("name-taken", str(err)) from None
        except ProgramError as err:
            raise Refused("bad-upload", str(err)) from None
        finally:
            self._forget_idle_limiter(user)
        await trio.to_thread.run_sync(self.installed.record, user, info, upload.wasm)
        return _found(corr, info)

    def _forget_idle_limiter(self, user: str) -> None:
        limiter = self._compiles_of.get(user)
        if (
            limiter is not None
            and not limiter.borrowed_tokens
            and not limiter.statistics().tasks_waiting
        ):
            del self._compiles_of[user]

    def _check_and_compile(self, upload: Upload) -> None:
        check_hash(upload)
        try:
            self.engine.wasm.cache.load(upload.wasm, upload.hash)
        except InvalidProgram as err:
            raise Refused("invalid-program", str(err)) from None

    def engine_status(self, corr: int) -> msg.EngineStatus:
        return engine_status(self.engine, corr)

    def count_frame(self, message: Any) -> None:
        """Counts a frame sent to a client: a reply by its outcome, or an event."""
        if isinstance(message, msg.Failure):
            self._replies[message.kind] += 1
        elif hasattr(message, "corr"):
            self._replies["ok"] += 1
        else:
            self._events_sent += 1

    def statistics(self) -> ServerStatistics:
        live = len(self.hub.live_instances())
        return ServerStatistics(
            connections=len(self.sessions),
            inferlets_live=live,
            inferlets_retained=len(self.hub.tracked) - live,
            connections_accepted=self._accepted,
            replies=tuple(sorted(self._replies.items())),
            events_sent=self._events_sent,
        )


class _CountedSession(Session):
    """A session whose every frame out is counted (see `Server.count_frame`)."""

    def post(self, message: Any) -> None:
        self.server.count_frame(message)
        super().post(message)


def _found(corr: int, info: Any) -> msg.ProgramFound:
    return msg.ProgramFound(
        corr=corr, hash=info.hash, name=info.name, version=info.version, size=info.size
    )
