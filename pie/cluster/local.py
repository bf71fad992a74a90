"""A whole cluster on one machine (`pie cluster up`, `pie bench cluster`): a `redis-server` with
its append-only file, N `pie serve --cluster` nodes on free ports and the SGLang router in front
of their /v1; started together, watched, and stopped together in an order that lets every node
leave the cluster cleanly."""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from attrs import field, frozen

from pie.client.local import LocalServer, ServerExited
from pie.cluster.redis_process import RedisProcess, RedisProcessError, free_port
from pie.cluster.router import RouterError, RouterProcess, RouterSettings
from pie.cluster.store import redacted

_HTTP = re.compile(r"pie: metrics at (?P<url>http://\S+)/metrics")
_JOINED = re.compile(r"pie: joined the cluster at \S+ as (?P<node>\S+)")


class ClusterUpError(Exception):
    """A part of the local cluster could not start; the message is one line naming it."""


def _at_least_one(_: object, attribute: Any, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@frozen(kw_only=True)
class LocalClusterSettings:
    state_dir: Path = field(converter=Path)
    """Redis's append-only file (`redis/`) and each node's config, programs and snapshots
    (`node-1/`, ...): kept between runs, so a cluster started again has what it had."""
    nodes: int = field(default=2, validator=_at_least_one)
    redis: str = ""
    """An existing Redis to use; empty: start one (on a free loopback port)."""
    router_port: int = 0
    """0: a free port."""
    policy: str = "cache_aware"
    models: tuple[str, ...] = field(default=(), converter=tuple)
    """`--model` of every node; empty: the configured model."""
    config: str | None = None
    """A config file for every node; pie adds each node's own keys to it."""
    start_timeout_s: float = 600.0
    env: Mapping[str, str] | None = None


@frozen(kw_only=True)
class LocalNode:
    node_id: str
    server: LocalServer
    http_url: str


class LocalCluster:
    """`LocalCluster.start(settings)` returns once Redis answers, every node has joined and the
    router sees them all healthy; `stop()` stops the router, then the nodes (each leaves the
    cluster), then Redis. A part that fails to start stops what had started and raises
    ClusterUpError."""

    def __init__(self, settings: LocalClusterSettings) -> None:
        self.settings = settings
        self.redis: RedisProcess | None = None
        self.redis_url = settings.redis
        self.nodes: list[LocalNode] = []
        self.router: RouterProcess | None = None
        self._lock: IO[str] | None = None

    @classmethod
    def start(cls, settings: LocalClusterSettings) -> LocalCluster:
        cluster = cls(settings)
        try:
            cluster._take_state_dir()
            cluster._start_redis()
            cluster._start_nodes()
            cluster._start_router()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def router_url(self) -> str:
        assert self.router is not None
        return self.router.url

    def urls(self) -> dict[str, Any]:
        """What clients and operators need: Redis, each node's URLs and the router's."""
        return {
            "redis": redacted(self.redis_url),
            "redis_dir": str(self.redis.folder) if self.redis else None,
            "nodes": [
                {"node_id": n.node_id, "ws_url": n.server.url, "http_url": n.http_url}
                for n in self.nodes
            ],
            "router": f"{self.router_url}/v1",
            "policy": self.settings.policy,
        }

    def exited(self) -> dict[str, int]:
        """The parts that have ended, by name ("redis", "router" or a node id), with exit codes."""
        ended = {n.node_id: n.server.process.poll() for n in self.nodes}
        if self.redis is not None:
            ended["redis"] = self.redis.exit_code()
        if self.router is not None:
            ended["router"] = self.router.process.poll()
        return {name: code for name, code in ended.items() if code is not None}

    def restart_redis(self) -> None:
        """Starts the Redis this cluster started again, on its port and folder (its data comes
        back from the append-only file); RedisProcessError when it cannot."""
        assert self.redis is not None
        self.redis.stop()
        self.redis.start()

    def forget_node(self, node: LocalNode) -> None:
        """Takes an ended node out of the router at once, rather than after its failed checks."""
        if self.router is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.router.remove_worker(node.http_url)

    def stop(self) -> None:
        """Stops everything this cluster started; safe to call more than once."""
        if self.router is not None:
            self.router.stop()
            self.router = None
        nodes, self.nodes = self.nodes, []
        _stop_all([node.server for node in nodes])
        if self.redis is not None:
            self.redis.stop()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # -- starting ----------------------------------------------------------------------------

    def _take_state_dir(self) -> None:
        folder = self.settings.state_dir
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(folder / "lock", "w")  # noqa: SIM115 (held for the cluster's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterUpError(f"another `pie cluster up` uses {folder}") from None

    def _start_redis(self) -> None:
        if self.redis_url:
            _check_reachable(self.redis_url)
            return
        self.redis = RedisProcess(self.settings.state_dir / "redis", free_port())
        try:
            self.redis.start()
        except RedisProcessError as err:
            raise ClusterUpError(str(err)) from None
        self.redis_url = self.redis.url

    def _start_nodes(self) -> None:
        names = [f"node-{i}" for i in range(1, self.settings.nodes + 1)]
        spawned: dict[str, LocalServer] = {}
        try:
            for name in names:  # all at once: they load their models side by side
                spawned[name] = self._spawn_node(name)
            self._wait_nodes(spawned)
            self.nodes = [_describe(name, spawned[name]) for name in names]
        except BaseException:
            _stop_all(list(spawned.values()))
            raise

    def _spawn_node(self, name: str) -> LocalServer:
        folder = self.settings.state_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "pie.toml"
        config.write_text(node_config(self.settings.config, name, folder), encoding="utf-8")
        args = ["--config", str(config), "--http", "0", "--openai", "--cluster", self.redis_url]
        for model in self.settings.models:
            args += ["--model", model]
        return LocalServer.spawn(env=self.settings.env, args=args, own_session=True)

    def _wait_nodes(self, spawned: dict[str, LocalServer]) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while not all(server.ready for server in spawned.values()):
            for name, server in spawned.items():
                if server.process.poll() is not None and not server.ready:
                    failed = ServerExited(server.process.returncode, _last_words(server))
                    raise ClusterUpError(
                        f"{name} (pie serve) exited with {failed.code} at start: {failed.last_line}"
                    )
            if time.monotonic() > deadline:
                late = ", ".join(n for n, s in spawned.items() if not s.ready)
                raise ClusterUpError(
                    f"{late} did not start within {self.settings.start_timeout_s:g} s"
                )
            time.sleep(0.1)

    def _start_router(self) -> None:
        settings = RouterSettings(
            workers=tuple(n.http_url for n in self.nodes),
            policy=self.settings.policy,
            port=self.settings.router_port,
            start_timeout_s=120.0,
        )
        try:
            self.router = RouterProcess.start(settings)
        except RouterError as err:
            raise ClusterUpError(str(err)) from None


def node_config(base: str | None, name: str, folder: Path) -> str:
    """The TOML of a node: the config file `base` (if any) with this node's own id, programs
    folder and snapshots folder."""
    data: dict[str, Any] = {}
    if base is not None:
        try:
            data = tomllib.loads(Path(base).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ClusterUpError(f"cannot read config {base}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ClusterUpError(f"{base} is not valid TOML: {exc}") from None
    data.setdefault("server", {})["programs_dir"] = str(folder / "programs")
    data.setdefault("kv", {})["snapshots_dir"] = str(folder / "snapshots")
    data.setdefault("cluster", {})["node_id"] = name
    return to_toml(data)


def to_toml(data: Mapping[str, Any]) -> str:
    """`data` (as tomllib reads it) written back as TOML."""
    return _table(data, (), "")


def _table(data: Mapping[str, Any], path: tuple[str, ...], header: str) -> str:
    """One table: its header (`[a.b]` or `[[a.b]]`), its plain keys, then its sub-tables."""
    plain = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if not _is_table(v)]
    text = header + "\n" if header and (plain or header.startswith("[[")) else ""
    text += "".join(line + "\n" for line in plain)
    for key, value in data.items():
        name = ".".join(map(_key, (*path, key)))
        if isinstance(value, Mapping):
            text += _table(value, (*path, key), f"[{name}]")
        elif _is_table(value):
            text += "".join(_table(entry, (*path, key), f"[[{name}]]") for entry in value)
    return text


def _is_table(value: Any) -> bool:
    tables = isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value)
    return isinstance(value, Mapping) or bool(tables)


def _key(key: str) -> str:
    return json.dumps(key, ensure_ascii=False)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if value == value and abs(value) != float("inf") else _special(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise ClusterUpError(f"cannot write {type(value).__name__} into a node's config")


def _special(value: float) -> str:
    return "nan" if value != value else ("inf" if value > 0 else "-inf")


def _describe(name: str, server: LocalServer) -> LocalNode:
    said = server.log_tail(200)
    http = _HTTP.search(said)
    joined = _JOINED.search(said)
    if http is None or joined is None:
        raise ClusterUpError(f"{name} (pie serve) did not say its HTTP URL and node id")
    return LocalNode(node_id=joined["node"], server=server, http_url=http["url"])


def _last_words(server: LocalServer) -> str:
    server.join_reader()
    return server.log_tail()


def _stop_all(servers: list[LocalServer]) -> None:
    """SIGTERM to every node at once (each leaves the cluster as it stops), then their exits."""
    for server in servers:
        server.terminate()
    for server in servers:
        with contextlib.suppress(TimeoutError):
            server.stop(grace=60.0)


def _check_reachable(url: str) -> None:
    import trio

    from pie.cluster.store import ClusterUnreachable, check_reachable

    try:
        trio.run(check_reachable, url, 3.0)
    except ClusterUnreachable as err:
        raise ClusterUpError(str(err)) from None
