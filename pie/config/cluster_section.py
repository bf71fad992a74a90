"""The [cluster] section: joining other nodes through Redis (docs/scale-out.md). Empty `redis`
(the default) is one node on its own, with no Redis needed."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import attrs
from attrs import field, frozen

from pie.config.checks import at_least, choice, positive

NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
REDIS_SCHEMES = ("redis", "rediss")


def redis_url_problem(url: str) -> str | None:
    """Why `url` is not a Redis URL pie can use, or None when it is."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (reading it checks the port is a number in range)
    except ValueError as exc:
        return f"cluster.redis is not a valid URL ({exc}): {url!r}"
    if parts.scheme not in REDIS_SCHEMES or not parts.hostname:
        return f"cluster.redis must be redis://HOST:PORT[/DB] (or rediss://), got {url!r}"
    database = parts.path.strip("/")
    if database and not database.isdigit():
        return f"cluster.redis names database {database!r}: a database is a number, e.g. /0"
    return None


def _redis(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    problem = redis_url_problem(value) if value else None
    if problem is not None:
        raise ValueError(problem)


def _advertised(*schemes: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        parts = urlsplit(value)
        if value and (parts.scheme not in schemes or not parts.hostname):
            wanted = " or ".join(f"{s}://" for s in schemes)
            raise ValueError(f"cluster.{attribute.name} must be a {wanted} URL, got {value!r}")

    return check


def _node_id(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value and not NODE_ID.fullmatch(value):
        raise ValueError(
            f"cluster.node_id must be 1-64 letters, digits, '-', '_' and '.', got {value!r}"
        )


@frozen(kw_only=True)
class ClusterConfig:
    redis: str = field(default="", validator=_redis)
    """The Redis every node of the cluster shares, redis://HOST:PORT[/DB]; empty: no cluster."""
    advertise_ws: str = field(default="", validator=_advertised("ws", "wss"))
    """The WebSocket URL other nodes and clients should use; empty: the bound host and port."""
    advertise_http: str = field(default="", validator=_advertised("http", "https"))
    """The HTTP URL other nodes and routers should use; empty: the HTTP front's bound host and
    port (none without one)."""
    node_id: str = field(default="", validator=_node_id)
    """This node's name in the cluster; empty: a new random one each start."""
    ttl_seconds: float = field(default=5.0, validator=positive)
    """A node's record expires this long after its last renewal: a node that stops renewing
    drops out of the cluster within it."""
    renew_seconds: float = field(default=1.0, validator=positive)
    """How often a node rewrites its record (with its current load)."""
    connect_timeout_seconds: float = field(default=3.0, validator=positive)
    """The longest connecting to Redis, or one command, may take."""
    reconnect_max_seconds: float = field(default=5.0, validator=positive)
    """While Redis does not answer, a node's loops (its registration, its users' poll, its bus)
    try again after their usual interval, doubling at each failure up to this long apart."""
    max_nodes: int = field(default=256, validator=at_least(1))
    """Nodes a cluster may hold: one more is refused when it joins, and `pie cluster status`
    reads no more than this many."""
    max_program_mb: int = field(default=64, validator=at_least(1))
    """The largest program (its component's bytes) the cluster store takes at an install."""
    max_user_programs_mb: int = field(default=512, validator=at_least(1))
    """A user's programs together in the cluster store (each program's bytes counted once per
    user): an install past it is refused."""
    max_users: int = field(default=10000, validator=at_least(1))
    """Users the cluster store holds: `pie auth add` of one more is refused, and a node reads no
    more than this many."""
    users_poll_seconds: float = field(default=0.25, validator=positive)
    """How often a node asks Redis whether the users changed (a revocation reaches every node
    within about this long)."""

    bus_poll_seconds: float = field(default=1.0, validator=positive)
    """How often a node looks in Redis for messages on the queues its pulls wait on, besides
    being told of each push on the stream (a Redis restart may lose that word)."""

    bus_stream_entries: int = field(default=1024, validator=at_least(16))
    """About how many entries the bus's Redis stream keeps (each push's queue name, each
    published message whole): a node more than this many behind misses the oldest."""

    bus_max_name_bytes: int = field(default=1024, validator=at_least(1))
    """The longest queue or topic name (UTF-8) a push or broadcast may use on a cluster's bus,
    which keeps names in Redis."""

    placement: str = field(default="load", validator=choice("load", "local"))
    """Where a WebSocket launch runs: `load`, on the node holding the snapshots it names, else
    on the least-loaded live node (the client is redirected there); `local`, on the node the
    client reached."""

    placement_slack: int = field(default=1, validator=at_least(0))
    """How many more inferlets this node may run than the least-loaded node before `load`
    placement sends a launch there, so launches do not bounce on small differences."""

    placement_max_snapshots: int = field(default=16, validator=at_least(1))
    """The most snapshot names one launch may give for placement (each is one Redis read)."""

    max_user_snapshots: int = field(default=1024, validator=at_least(1))
    """Entries a user may hold in the cluster's directory of named snapshots: a save of one
    more is refused `quota` (the directory lives in Redis, shared by every user)."""

    remote_snapshots: str = field(default="place", validator=choice("place", "copy"))
    """Opening a snapshot another node holds: "place" refuses the open naming the holder (a
    launch that names its snapshots runs there); "copy" copies its KV pages from the holder."""

    max_snapshot_copy_mb: int = field(default=256, validator=at_least(1))
    """The largest snapshot (its KV pages) a node copies from another, or serves to one."""

    snapshot_copies: int = field(default=2, validator=at_least(1))
    """Copies a node makes at once, and copies it serves at once: each holds up to
    max_snapshot_copy_mb in memory while it travels."""

    def __attrs_post_init__(self) -> None:
        if self.renew_seconds >= self.ttl_seconds:
            raise ValueError(
                f"cluster.renew_seconds ({self.renew_seconds:g}) must be less than "
                f"cluster.ttl_seconds ({self.ttl_seconds:g}), or records expire between renewals"
            )
