"""A live server for tests: an engine on the synthetic driver (or a given one) behind the
WebSocket server on 127.0.0.1, port 0."""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from pie.config import EngineConfig, with_overrides
from pie.drivers.loader.resolve import resolve_model
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.events import inferlet as ev
from pie.sandbox import WasmRuntime
from pie.server.app import Server
from pie.server.http import HttpFront
from pie.server.mounts import Mounts
from pie.server.routes import Route
from pie.wire import messages as msg
from pie.wire.frames import decode_server_frame, encode_frame

PYTEST_CACHE = Path(__file__).resolve().parents[1] / ".pytest_cache" / "d"
"""Where `pytestconfig.cache.mkdir(name)` puts its folders."""


def precompiled(wasm: bytes) -> bytes:
    """`wasm`, compiled now into the component cache `serving` engines use: for module-scoped
    fixtures, so that a test that measures its process (the security tests) never counts the
    compiler's few hundred MiB, kept by the allocator afterwards, against what it checks."""
    WasmRuntime(PYTEST_CACHE / "pie-components").cache.load(wasm)
    return wasm


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer, read once per test run from the model converted into
    pytest's cache folder (where tests/model_fixtures.py puts it)."""
    return Tokenizer.from_folder(resolve_model(None, cache_dir=PYTEST_CACHE / "pie-models"))


@contextlib.asynccontextmanager
async def serving(
    tmp_path: Path,
    *,
    driver: Any = None,
    tokenizer: Any = None,
    config: EngineConfig | None = None,
    users: Any = None,
    shared_programs: Any = None,
    bus: Any = None,
    placer: Callable[[Any], Any] | None = None,
    **server: Any,
) -> AsyncIterator[Server]:
    """Yields the running Server (`.url`, `.engine`); stops it gracefully on exit.

    Keyword arguments override [server] keys; without `config`, compiled components are cached
    in pytest's cache folder, as the other inferlet tests do. `bus` is open_engine's (a
    clustered node's bus); `placer` makes a clustered node's Placer for the engine.
    """
    tokenizer = tokenizer or default_tokenizer()
    components = PYTEST_CACHE / "pie-components"
    driver = driver or SyntheticDriver(vocab_size=tokenizer.vocab_size)
    config = config or with_overrides(EngineConfig(), sandbox={"cache_dir": str(components)})
    programs = str(tmp_path / "programs")  # installed programs kept per test, not shared
    config = with_overrides(
        config, server={"host": "127.0.0.1", "port": 0, "programs_dir": programs, **server}
    )
    async with open_engine(config, driver=driver, tokenizer=tokenizer, bus=bus) as engine:
        server_ = Server(
            engine,
            config.server,
            users=users,
            shared_programs=shared_programs,
            placer=placer(engine) if placer is not None else None,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(server_.run)
            try:
                yield server_
            finally:
                with trio.CancelScope(shield=True):
                    await server_.stop(grace=5)


@contextlib.asynccontextmanager
async def http_front(
    tokenizer: Tokenizer,
    components: Path,
    programs: dict[str, bytes],
    *,
    users: Any = None,
    num_pages: int = 4096,
    sandbox: dict[str, Any] | None = None,
    routes: tuple[Route, ...] = (),
    engine_routes: Callable[[Any], tuple[Route, ...]] = lambda engine: (),
    **http: Any,
) -> AsyncIterator[tuple[Any, HttpFront, Any]]:
    """An engine serving `programs` ({prefix: wasm}), `routes` and the routes `engine_routes`
    makes for the engine over HTTP on a free port, and an httpx client for it; keyword arguments
    override [http] keys, `sandbox` [sandbox] keys."""
    import httpx

    sandbox = {"cache_dir": str(components), **(sandbox or {})}
    config = with_overrides(EngineConfig(), sandbox=sandbox)
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size, num_pages=num_pages)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        mounts = {
            p: engine.programs.add(w, name=p.strip("/").replace("/", "-") or "root").hash
            for p, w in programs.items()
        }
        http_config = with_overrides(config, http={"port": 0, **http}).http
        routes += engine_routes(engine)
        front = HttpFront(
            engine, http_config, Mounts(mounts), host="127.0.0.1", users=users, routes=routes
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            async with httpx.AsyncClient(base_url=front.url, timeout=60) as client:
                yield engine, front, client
            front.stop()
            nursery.cancel_scope.cancel()


class Raw:
    """A bare protocol client: numbered requests, every frame decoded."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.corr = 0
        self.pending: list[Any] = []

    async def send(self, make: Any, **fields: Any) -> int:
        self.corr += 1
        await self.ws.send_message(encode_frame(make(corr=self.corr, **fields)))
        return self.corr

    async def next(self) -> Any:
        if self.pending:
            return self.pending.pop(0)
        return decode_server_frame(await self.ws.get_message())

    async def reply(self, corr: int) -> Any:
        """The reply to `corr`; events that come first are kept for `next`."""
        skipped = []
        while True:
            message = decode_server_frame(await self.ws.get_message())
            if getattr(message, "corr", None) == corr:
                self.pending.extend(skipped)
                return message
            skipped.append(message)

    async def call(self, make: Any, **fields: Any) -> Any:
        return await self.reply(await self.send(make, **fields))

    async def until_end(self, instance: str) -> list[msg.InferletEvent]:
        seen = []
        while True:
            message = await self.next()
            if isinstance(message, msg.InferletEvent) and message.instance == instance:
                seen.append(message)
                if isinstance(message.event, ev.InferletEnd):
                    return seen


async def connect(url: str) -> Any:
    return open_websocket_url(url, max_message_size=64 << 20)


def durable_config(tmp_path: Path) -> Path:
    """A `pie serve` config whose lasting state (installed programs, named snapshots) lives in
    `tmp_path`, with the shared compiled-components cache."""
    config = tmp_path / "pie.toml"
    config.write_text(
        f'[sandbox]\ncache_dir = "{PYTEST_CACHE / "pie-components"}"\n'
        f'[server]\nprograms_dir = "{tmp_path / "programs"}"\n'
        f'[kv]\nsnapshots_dir = "{tmp_path / "snapshots"}"\n'
    )
    return config


@contextlib.asynccontextmanager
async def served_process(model_dir: Path, config: Path) -> AsyncIterator[Any]:
    """`pie serve --config CONFIG` in a child process (a LocalServer), killed on exit."""
    from pie.client.local import LocalServer

    def start() -> LocalServer:
        return LocalServer.start(model_dir, args=["--config", str(config)])

    server = await trio.to_thread.run_sync(start)
    try:
        yield server
    finally:
        server.kill()


async def kill_hard(server: Any) -> None:
    """SIGKILL, as a crash or an OOM killer would: nothing gets to clean up."""
    server.process.send_signal(signal.SIGKILL)
    await trio.to_thread.run_sync(server.process.wait)
