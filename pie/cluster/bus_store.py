"""Where the clustered bus keeps its queues in Redis: a list per queue, its bytes and each user's
bytes as counters, changed together by Lua scripts so that the bounds hold across nodes; and
one stream, capped in length, that every node reads: each push names its queue there and each
published message is there whole."""

from __future__ import annotations

import json
from typing import Any

import coredis
import trio
from attrs import frozen

from pie.actors.bus import BusLimits
from pie.cluster.store import RedisStore

# A push lands only if the queue has room in messages and bytes and its user in bytes; it is
# appended with its charge and user, and the queue's name goes on the stream for every node.
PUSH = """
local held = redis.call('LLEN', KEYS[1])
if held >= tonumber(ARGV[3]) then return {1, held} end
local bytes = tonumber(redis.call('GET', KEYS[3]) or '0')
local charge = tonumber(ARGV[2])
if bytes + charge > tonumber(ARGV[4]) then return {2, bytes} end
local owned = tonumber(redis.call('GET', KEYS[4]) or '0')
if owned + charge > tonumber(ARGV[5]) then return {3, owned} end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[2] .. '\\t' .. KEYS[4])
redis.call('INCRBY', KEYS[3], charge)
redis.call('INCRBY', KEYS[4], charge)
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[6], '*', 'q', ARGV[7])
return {0, 0}
"""

# The oldest message, its charge given back to the queue and to the user who pushed it; a
# counter that reaches zero is deleted, so an empty queue and an idle user hold no key.
POP = """
local message = redis.call('LPOP', KEYS[1])
if not message then return false end
local entry = redis.call('LPOP', KEYS[2])
local charge, user = string.match(entry, '^(%d+)\\t(.*)$')
if redis.call('DECRBY', KEYS[3], charge) <= 0 then redis.call('DEL', KEYS[3]) end
if redis.call('DECRBY', user, charge) <= 0 then redis.call('DEL', user) end
return message
"""


def encoded(text: str) -> bytes:
    """Names and messages as bytes (an inferlet's text may hold lone surrogates)."""
    return text.encode("utf-8", "surrogatepass")


def decoded(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


STREAM = b"pie:bus:stream"
"""Every push's queue name and every published message, oldest first."""


def queue_keys(name: str) -> list[bytes]:
    """The queue's messages, their charges and its byte counter."""
    key = encoded(name)
    return [b"pie:bus:q:" + key, b"pie:bus:qc:" + key, b"pie:bus:qb:" + key]


def user_key(name: str) -> bytes:
    return b"pie:bus:u:" + encoded(name)


@frozen(kw_only=True)
class Refused:
    """Why Redis refused a push: `full` (messages), `bytes` (the queue's) or `quota` (the
    user's), with what was held."""

    reason: str
    held: int


REASONS = {1: "full", 2: "bytes", 3: "quota"}


class RedisQueues:
    """The clustered bus's queues in the Redis of `store`, bounded by `limits`; its stream
    keeps at most about `stream_entries` entries."""

    def __init__(self, store: RedisStore, limits: BusLimits, stream_entries: int) -> None:
        self.store = store
        self.limits = limits
        self.stream_entries = stream_entries
        self._push = store.client.register_script(PUSH)
        self._pop = store.client.register_script(POP)

    async def push(self, queue: str, message: str, user: str, charge: int) -> Refused | None:
        limits = self.limits
        keys = [*queue_keys(queue), user_key(user), STREAM]
        args: list[Any] = [encoded(message), charge, limits.max_queue_messages]
        args += [limits.max_queue_bytes, limits.max_user_bytes]
        args += [self.stream_entries, encoded(queue)]
        with trio.fail_after(self.store.timeout):
            code, held = await self._push(keys=keys, args=args)
        return Refused(reason=REASONS[int(code)], held=int(held)) if code else None

    async def pop(self, queue: str) -> str | None:
        with trio.fail_after(self.store.timeout):
            message = await self._pop(keys=queue_keys(queue), args=[])
        return None if message is None else decoded(message)

    async def publish(self, origin: str, sender: str, topic: str, message: str) -> None:
        frame = topic_frame(origin, sender, topic, message)
        with trio.fail_after(self.store.timeout):
            await self.store.client.xadd(
                STREAM,
                {b"t": frame},
                trim_strategy=coredis.PureToken.MAXLEN,
                threshold=self.stream_entries,
                trim_operator=coredis.PureToken.APPROXIMATELY,
            )

    async def last_entry(self) -> bytes:
        """The id of the stream's newest entry (0-0 when it has none): reading after it sees
        only what comes next."""
        with trio.fail_after(self.store.timeout):
            newest = await self.store.client.xrevrange(STREAM, "+", "-", count=1)
        return _bytes(newest[0].identifier) if newest else b"0-0"

    async def read_after(self, last: bytes, wait_ms: int) -> list[tuple[bytes, dict[Any, Any]]]:
        """The stream's entries after `last`, waiting up to `wait_ms` for one."""
        with trio.fail_after(self.store.timeout + wait_ms / 1000):
            found = await self.store.client.xread({STREAM: last}, count=256, block=wait_ms)
        if not found:
            return []
        return [(_bytes(e.identifier), dict(e.field_values)) for e in found[STREAM]]


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def topic_frame(origin: str, sender: str, topic: str, message: str) -> bytes:
    """A published message on the wire: a JSON line naming where it came from, then the text."""
    head = json.dumps([origin, sender, topic]).encode()
    return head + b"\n" + encoded(message)


@frozen(kw_only=True)
class TopicFrame:
    origin: str
    sender: str
    topic: str
    message: str

    @classmethod
    def parse(cls, data: bytes) -> TopicFrame:
        head, _, body = data.partition(b"\n")
        origin, sender, topic = json.loads(head)
        return cls(origin=origin, sender=sender, topic=topic, message=decoded(body))
