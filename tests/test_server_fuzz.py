"""Random, malformed and hostile frames from several connections at once are each answered with one
well-formed reply and never close a connection or stop the server, while a well-behaved client gets
exact results; a client that vanishes mid-stream disturbs no other."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import socket
import struct
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from attrs import frozen
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage
from wsproto.events import Message as WsMessage

from pie.events import inferlet as ev
from pie.wire import messages as msg
from pie.wire.frames import decode_server_frame, encode_frame
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import serving

pytestmark = pytest.mark.integration

LIMIT = 1 << 20
"""The frame limit the fuzzed server runs with (max_frame_mb=1)."""
FUZZERS = 4
FRAMES = 300
"""Frames each fuzzing connection sends, at least."""
GOOD = "good"
"""The well-behaved client's user; no fuzzer ever authenticates as it."""
MAX_PROGRAM = 256 << 20
UPLOAD_CASES = 6
KINDS = frozenset(
    {
        "bad-frame",
        "too-large",
        "unauthenticated",
        "bad-upload",
        "hash-mismatch",
        "invalid-program",
        "no-such-program",
        "no-such-inferlet",
        "not-owner",
        "shutting-down",
        "busy",
    }
)
"""The failure kinds docs/protocol.md lists."""
ABOUT_INSTANCES = frozenset({"no-such-inferlet", "not-owner"})
UPLOAD_KINDS = frozenset({"bad-upload", "too-large", "hash-mismatch", "invalid-program"})
REPLIES: dict[type, tuple[type, ...]] = {
    msg.Authenticate: (msg.Authenticated,),
    msg.RequestChallenge: (msg.ChallengeIssued,),
    msg.QueryProgram: (msg.ProgramFound,),
    msg.UploadProgram: (msg.UploadProgress, msg.ProgramFound),
    msg.Launch: (msg.Launched,),
    msg.Attach: (msg.Done,),
    msg.Detach: (msg.Done,),
    msg.SendMessage: (msg.Done,),
    msg.Terminate: (msg.Done,),
    msg.ListInferlets: (msg.InferletList,),
    msg.QueryStatistics: (msg.EngineStatus,),
}
"""The reply each request gets when it succeeds."""
CHARS = [
    *"abcXYZ019 _-.@/{}[]:,",
    '"',
    "\\",
    "\0",
    "\x7f",
    "\n",
    "é",
    "✓",
    "😀",
    "\ud800",
    "\udfff",
]
"""Characters for random strings: NULs, escapes, multi-byte ones and lone surrogates."""


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


@pytest.fixture
def seed() -> int:
    """PIE_FUZZ_SEED, or a fresh one; printed so a failing run can be replayed."""
    value = int(os.environ.get("PIE_FUZZ_SEED") or random.randrange(1 << 32))
    print(f"fuzz seed {value}: rerun with PIE_FUZZ_SEED={value}")
    return value


# -- what a frame must be answered with --------------------------------------------------------


@frozen
class Expect:
    corrs: tuple[int, ...]
    """The `corr` the answer may carry."""
    replies: tuple[type, ...] = ()
    """Successful answers that are legitimate."""
    kinds: frozenset[str] = frozenset()
    """Failure kinds that are legitimate."""
    check: Callable[[Any], bool] | None = None
    """A further test of a successful answer."""


Frame = str | bytes


@frozen
class ToLatest:
    """A request to the inferlet this connection launched last: sent once every earlier frame
    is answered, with the instance id of the last `Launched` put in."""

    request: Any

    def frame(self, instance: str) -> str:
        return encode_frame(attrs.evolve(self.request, instance=instance))


Plan = list[tuple[Frame | ToLatest, Expect]]

BAD = frozenset({"bad-frame"})


def _not_unicode(text: str | None) -> bool:
    """Text with a lone surrogate, which the server refuses rather than pass to an inferlet."""
    try:
        if text is not None:
            json.loads(json.dumps(text)).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def refused(corrs: tuple[int, ...], kinds: frozenset[str] = BAD) -> Expect:
    return Expect(corrs=corrs, kinds=kinds)


def answered(request: Any, kinds: frozenset[str] = frozenset(), **extra: Any) -> Expect:
    return Expect(corrs=(request.corr,), replies=REPLIES[type(request)], kinds=kinds, **extra)


def readable_corr(frame: Frame) -> int:
    """The corr a refusal names: a JSON object's integer `corr`, else 0."""
    try:
        data = json.loads(frame)
    except (ValueError, RecursionError):
        return 0
    corr = data.get("corr") if isinstance(data, dict) else None
    return corr if type(corr) is int else 0


def check_answer(frame: Frame, expect: Expect, reply: Any) -> None:
    shown = repr(frame[:160]) + (f"... ({len(frame)} long)" if len(frame) > 160 else "")
    where = f"frame {shown} was answered {reply!r:.400}"
    assert not isinstance(reply, msg.Welcome | msg.InferletEvent), where
    assert reply.corr in expect.corrs, where
    if isinstance(reply, msg.Failure):
        assert reply.kind in KINDS and reply.kind in expect.kinds, where
    else:
        assert isinstance(reply, expect.replies), where
        assert expect.check is None or expect.check(reply), where


# -- random frames -------------------------------------------------------------------------------


class Frames:
    """Frames drawn from one seeded generator, each with the answer it must get."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.corr = 0

    def plan(self, count: int) -> Plan:
        """Frames of every sort (and every bad upload) first, then random sorts until `count`."""
        makers = self.makers()
        plan = [pair for make, _ in makers for pair in make()]
        plan += [pair for pick in range(UPLOAD_CASES) for pair in self.bad_uploads(pick)]
        # One lookup that finds a program, so that every seed sees each kind of success.
        found = msg.QueryProgram(corr=self.next_corr(), program="relay")
        plan.append((encode_frame(found), self.expect_of(found)))
        weights = [weight for _, weight in makers]
        while len(plan) < count:
            make = self.rng.choices([make for make, _ in makers], weights)[0]
            plan.extend(make())
        return plan

    def makers(self) -> list[tuple[Callable[[], Plan], int]]:
        return [
            (self.garbage_text, 8),
            (self.random_json, 8),
            (self.wrong_type, 10),
            (self.missing_field, 6),
            (self.extra_key, 5),
            (self.unknown_type, 5),
            (self.deeply_nested, 3),
            (self.long_number, 2),
            (self.hostile_values, 20),
            (self.to_unknown_instance, 8),
            (self.bad_uploads, 4),
            (self.authenticate, 3),
            (self.binary, 4),
            (self.over_limit, 2),
            (self.at_limit, 1),
            (self.own_inferlet, 4),
        ]

    # -- values

    def next_corr(self) -> int:
        self.corr += 1
        return self.corr

    def text(self, longest: int = 12) -> str:
        return "".join(self.rng.choice(CHARS) for _ in range(self.rng.randrange(longest + 1)))

    def integer(self) -> int:
        rng = self.rng
        return rng.choice(
            [
                rng.randrange(-3, 40),
                -(1 << 63),
                1 << 64,
                10 ** rng.randrange(19, 400),
                -(10 ** rng.randrange(19, 400)),
            ]
        )

    def json_value(self, depth: int = 0) -> Any:
        rng = self.rng
        pick = rng.randrange(7 if depth < 4 else 5)
        if pick == 0:
            return rng.choice([None, True, False])
        if pick == 1:
            return self.integer()
        if pick == 2:
            return rng.choice([rng.uniform(-1e9, 1e9), 0.5, -0.0, 1e308, float("nan")])
        if pick in (3, 4):
            return self.text()
        if pick == 5:
            return [self.json_value(depth + 1) for _ in range(rng.randrange(5))]
        return {self.text(6): self.json_value(depth + 1) for _ in range(rng.randrange(5))}

    def instance(self) -> str:
        """Mostly ids the server hands out (other users' and this user's inferlets)."""
        return f"i{self.rng.randrange(1, 41)}" if self.rng.random() < 0.7 else self.text()

    def sample(self, cls: type) -> Any:
        """A well-formed request of `cls` with plausible, harmless values."""
        rng, corr = self.rng, self.next_corr()
        digest = hashlib.sha256(rng.randbytes(8)).hexdigest()
        values: dict[type, dict[str, Any]] = {
            msg.Authenticate: {"user": "fuzz", "token": rng.choice([None, "t"])},
            msg.RequestChallenge: {"user": "fuzz"},
            msg.QueryProgram: {"program": rng.choice(["relay", "nothing", digest])},
            msg.UploadProgram: {
                "name": "p",
                "version": "1",
                "hash": digest,
                "size": 4,
                "index": 1,
                "count": 2,
                "data": b"\0asm",
            },
            msg.Launch: {"program": "nothing", "input": "{}"},
            msg.Attach: {"instance": self.instance(), "after": 0},
            msg.Detach: {"instance": self.instance()},
            msg.SendMessage: {"instance": self.instance(), "text": "hi"},
            msg.Terminate: {"instance": self.instance()},
        }
        return cls(corr=corr, **values.get(cls, {}))

    def any_sample(self) -> Any:
        return self.sample(self.rng.choice(list(REPLIES)))

    @staticmethod
    def fields(request: Any) -> dict[str, Any]:
        return json.loads(encode_frame(request))

    # -- frames no server could read

    def garbage_text(self) -> Plan:
        frame = self.rng.randbytes(self.rng.randrange(300)).decode("latin-1")
        return [(frame, refused((readable_corr(frame),)))]

    def random_json(self) -> Plan:
        value = self.json_value()
        if isinstance(value, dict) and self.rng.random() < 0.5:
            value["corr"] = self.next_corr()
        frame = json.dumps(value)
        return [(frame, refused((readable_corr(frame),)))]

    def wrong_type(self) -> Plan:
        request = self.any_sample()
        data = self.fields(request)
        hints = typing.get_type_hints(type(request))
        name = self.rng.choice([f.name for f in attrs.fields(type(request))])
        required = attrs.fields_dict(type(request))[name].default is attrs.NOTHING
        wrong: list[Any] = [{"a": 1}, 1.5]
        if hints[name] is int:
            wrong += [[], "1", 1.0, True]
        elif hints[name] in (str, str | None):
            wrong += [[], 1, False]
        elif typing.get_origin(hints[name]) is tuple:  # an empty array is a good one
            wrong += ["a", [1], [None], [["a"]]]
        else:  # bytes: not a number, not base64; bool: not a number, not a string
            wrong += [[], 7, "not base64!", "QUI"]
        if required:
            wrong.append(None)
        data[name] = self.rng.choice(wrong)
        corr = request.corr if name != "corr" else 0
        return [(json.dumps(data), refused((corr,)))]

    def missing_field(self) -> Plan:
        request = self.any_sample()
        data = self.fields(request)
        required = [f.name for f in attrs.fields(type(request)) if f.default is attrs.NOTHING]
        name = self.rng.choice(required)
        del data[name]
        return [(json.dumps(data), refused((request.corr if name != "corr" else 0,)))]

    def extra_key(self) -> Plan:
        request = self.any_sample()
        data = self.fields(request)
        data[self.rng.choice(["extra", "Corr", "user_id", ""])] = self.json_value()
        return [(json.dumps(data), refused((request.corr,)))]

    def unknown_type(self) -> Plan:
        request = self.any_sample()
        data = self.fields(request)
        tag = data["type"]
        choices: list[Any] = [tag.lower(), tag + "s", self.text(), 5, None, [tag], {"type": tag}]
        if self.rng.random() < 0.2:
            del data["type"]
        else:
            data["type"] = self.rng.choice(choices)
        return [(json.dumps(data), refused((request.corr,)))]

    def deeply_nested(self) -> Plan:
        depth = self.rng.choice([50, 900, 3000, 100_000])
        nest = self.rng.choice(["[]", "{}"])
        inner = '{"a":' * depth + "1" + "}" * depth if nest == "{}" else "[" * depth + "]" * depth
        corr = self.next_corr()
        frame = self.rng.choice(
            [inner, f'{{"type":"Launch","corr":{corr},"program":{inner},"input":""}}']
        )
        # Whether a nesting this deep can still be read depends on the reader's stack.
        return [(frame, refused((0, corr)))]

    def long_number(self) -> Plan:
        digits = "9" * self.rng.choice([4301, 5000, 20_000])
        corr = self.next_corr()
        frame = self.rng.choice(
            [
                f'{{"type":"QueryStatistics","corr":{digits}}}',
                f'{{"type":"Attach","corr":{corr},"instance":"i1","after":{digits}}}',
            ]
        )
        return [(frame, refused((0, corr)))]

    # -- frames that read well and ask for odd things

    def hostile_values(self) -> Plan:
        """A well-typed request whose ints and strings are drawn from the hostile pools."""
        rng, cls = self.rng, self.rng.choice(list(REPLIES))
        values: dict[str, Any] = {}
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            kind = hints[field.name]
            if kind is int:
                values[field.name] = self.integer() if rng.random() < 0.5 else self.next_corr()
            elif kind is str:
                values[field.name] = self.text(40)
            elif kind == str | None:
                values[field.name] = rng.choice([None, self.text(40)])
            elif kind is bytes:
                values[field.name] = rng.randbytes(rng.randrange(40))
            elif kind is bool:
                values[field.name] = rng.random() < 0.5
            elif kind == tuple[str, ...]:
                values[field.name] = tuple(self.text(40) for _ in range(rng.randrange(3)))
            else:
                values[field.name] = rng.choice([None, rng.randbytes(rng.randrange(40))])
        if cls is msg.QueryProgram and rng.random() < 0.3:
            values["program"] = "relay"
        if cls is msg.Launch and rng.random() < 0.5:
            values["program"] = "relay"
            values["input"] = rng.choice(
                [
                    '{"mode":"relay"}',
                    '{"mode":"count","n":3}',
                    '{"mode":"count","n":-1}',
                    '{"mode":"nope"}',
                    '{"mode":"relay"',
                    self.text(),
                ]
            )
        if cls in (msg.Attach, msg.Detach, msg.SendMessage, msg.Terminate):
            values["instance"] = self.instance()
        if cls is msg.Authenticate and values["user"] == GOOD:
            values["user"] += "!"
        request = cls(**values)
        return [(encode_frame(request), self.expect_of(request))]

    def expect_of(self, request: Any) -> Expect:
        match request:
            case msg.Authenticate():
                # A high then a low surrogate escape read as JSON are one character.
                user = json.loads(json.dumps(request.user))
                return answered(request, check=lambda reply: reply.user == user)
            case msg.QueryProgram():
                return answered(request, frozenset({"no-such-program"}))
            case msg.UploadProgram():
                return answered(request, UPLOAD_KINDS)
            case msg.Launch() if _not_unicode(request.input):
                return refused((request.corr,))
            case msg.Launch():
                return answered(request, frozenset({"no-such-program", "busy"}))
            case msg.SendMessage() if (request.text is None) == (request.data is None):
                return refused((request.corr,))
            case msg.SendMessage() if _not_unicode(request.text):
                return refused((request.corr,))
            case msg.Attach() | msg.Detach() | msg.SendMessage() | msg.Terminate():
                return answered(request, ABOUT_INSTANCES)
            case msg.ListInferlets():
                return answered(request, check=lambda reply: _none_of(GOOD, reply))
        return answered(request)

    def own_inferlet(self) -> Plan:
        """Launches the relay guest, then sends it odd messages, re-attaches with odd `after`s,
        detaches or terminates it."""
        rng = self.rng
        launch = msg.Launch(corr=self.next_corr(), program="relay", input='{"mode":"relay"}')
        plan: Plan = [(encode_frame(launch), answered(launch, frozenset({"busy"})))]
        first = msg.SendMessage(corr=self.next_corr(), instance="", text="hello")
        plan.append((ToLatest(first), answered(first, ABOUT_INSTANCES)))
        for _ in range(rng.randrange(6)):
            corr, cls = self.next_corr(), rng.choice([msg.SendMessage] * 4 + [msg.Attach] * 2)
            if cls is msg.SendMessage:
                text = rng.choice([None, "bye", self.text(40)])
                data = rng.choice([None, rng.randbytes(rng.randrange(40))])
                request: Any = msg.SendMessage(corr=corr, instance="", text=text, data=data)
            else:
                request = msg.Attach(corr=corr, instance="", after=self.integer())
            plan.append((ToLatest(request), self.expect_of(request)))
        last = rng.choice([msg.Detach, msg.Terminate, None])
        if last is not None:
            request = last(corr=self.next_corr(), instance="")
            plan.append((ToLatest(request), answered(request, ABOUT_INSTANCES)))
        return plan

    def to_unknown_instance(self) -> Plan:
        cls = self.rng.choice([msg.Attach, msg.Detach, msg.SendMessage, msg.Terminate])
        request = attrs.evolve(self.sample(cls), instance=f"nope-{self.text()}")
        return [(encode_frame(request), refused((request.corr,), frozenset({"no-such-inferlet"})))]

    def authenticate(self) -> Plan:
        user = self.text(30)
        user = user + "!" if user == GOOD else user
        request = msg.Authenticate(
            corr=self.next_corr(), user=user, token=self.text(), signature=self.text()
        )
        return [(encode_frame(request), self.expect_of(request))]

    def bad_uploads(self, pick: int | None = None) -> Plan:
        """Uploads out of order, with a bad hash, oversized, mismatched or not a component."""
        rng = self.rng
        pick = rng.randrange(UPLOAD_CASES) if pick is None else pick

        def upload(expect_kind: str | None, received: int = 0, **fields: Any) -> Any:
            request = msg.UploadProgram(corr=self.next_corr(), **fields)
            if expect_kind is None:
                expect = Expect(
                    corrs=(request.corr,),
                    replies=(msg.UploadProgress,),
                    check=lambda reply: reply.received == received,
                )
            else:
                expect = refused((request.corr,), frozenset({expect_kind}))
            return (encode_frame(request), expect)

        data = rng.randbytes(rng.randrange(1, 64))
        fresh = hashlib.sha256(rng.randbytes(16)).hexdigest()
        base = {"name": "fuzzed", "version": "1", "hash": fresh}
        if pick == 0:  # a chunk of an upload that never started
            chunk = {**base, "size": 8, "index": rng.randrange(1, 5), "count": 5, "data": data}
            return [upload("bad-upload", **chunk)]
        if pick == 1:  # a hash that is no sha256
            bad_hash = rng.choice(["", "zz" * 32, fresh.upper(), fresh[:-1], self.text()])
            chunk = {**base, "hash": bad_hash, "size": 8, "index": 0, "count": 1, "data": data}
            return [upload("bad-upload", **chunk)]
        if pick == 2:  # over max_program_mb
            size = rng.choice([MAX_PROGRAM + 1, 1 << 62, 10**200])
            return [
                upload("too-large", **{**base, "size": size, "index": 0, "count": 1, "data": data})
            ]
        if pick == 3:  # the bytes do not hash to the announced sha256
            chunk = {**base, "size": len(data), "index": 0, "count": 1, "data": data}
            return [upload("hash-mismatch", **chunk)]
        if pick == 4:  # the right hash of bytes that are no component
            junk = rng.choice([b"", b"\0asm", b"\0asm\x0d\x00\x01\x00"]) + data
            chunk = {**base, "hash": hashlib.sha256(junk).hexdigest(), "size": len(junk)}
            return [upload("invalid-program", **chunk, index=0, count=1, data=junk)]
        # Two chunks of four, a restart at 0, then a chunk that skips one, changes the size or
        # count, or brings more than the announced size.
        first = {**base, "size": 16, "count": 4, "data": b"abcd"}
        wrong = rng.choice([{"index": 2}, {"size": 20}, {"count": 5}, {"data": b"x" * 20}])
        return [
            upload(None, 4, **first, index=0),
            upload(None, 8, **first, index=1),
            upload(None, 4, **first, index=0),
            upload("bad-upload", **{**first, "index": 1, **wrong}),
        ]

    def binary(self) -> Plan:
        if self.rng.random() < 0.5:
            frame = self.rng.randbytes(self.rng.randrange(1, 300))
            return [(frame, refused((readable_corr(frame),)))]
        request = msg.QueryStatistics(corr=self.next_corr())
        frame = encode_frame(request).encode()
        # Text frames are the protocol; a binary one may be read or refused, never ignored.
        return [(frame, Expect(corrs=(0, request.corr), replies=(msg.EngineStatus,), kinds=BAD))]

    def over_limit(self) -> Plan:
        """Over the limit, but under twice it: refused, and the connection stays."""
        size = LIMIT + self.rng.choice([1, self.rng.randrange(2, LIMIT // 2)])
        if self.rng.random() < 0.25:
            return [(self.rng.randbytes(size), refused((0,), frozenset({"too-large"})))]
        corr = self.next_corr()
        frame = self.padded(corr, size)
        return [(frame, refused((0, corr), frozenset({"too-large"})))]

    def at_limit(self) -> Plan:
        """Exactly at the limit: read, and answered as any request is."""
        corr = self.next_corr()
        frame = self.padded(corr, LIMIT)
        return [(frame, refused((corr,), frozenset({"no-such-inferlet"})))]

    @staticmethod
    def padded(corr: int, size: int) -> str:
        """A SendMessage to an unknown instance, exactly `size` characters long."""
        head = f'{{"type":"SendMessage","corr":{corr},"instance":"nope","text":"'
        frame = head + "x" * (size - len(head) - 2) + '"}'
        assert len(frame) == size
        return frame


def _none_of(user: str, listing: msg.InferletList) -> bool:
    return all(summary.user != user for summary in listing.inferlets)


# -- clients -------------------------------------------------------------------------------------


async def connect(url: str) -> Any:
    return open_websocket_url(url, max_message_size=64 << 20)


class Client:
    """A well-behaved client: numbered requests, every frame decoded, events kept in order."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.corr = 0
        self.pending: list[Any] = []

    async def next(self) -> Any:
        if self.pending:
            return self.pending.pop(0)
        return decode_server_frame(await self.ws.get_message())

    async def call(self, make: Any, **fields: Any) -> Any:
        self.corr += 1
        await self.ws.send_message(encode_frame(make(corr=self.corr, **fields)))
        while True:
            message = decode_server_frame(await self.ws.get_message())
            if getattr(message, "corr", None) == self.corr:
                return message
            self.pending.append(message)

    async def until_end(self, instance: str) -> list[msg.InferletEvent]:
        seen = []
        while True:
            message = await self.next()
            assert isinstance(message, msg.InferletEvent), message
            assert message.instance == instance, message
            seen.append(message)
            if isinstance(message.event, ev.InferletEnd):
                return seen

    async def counts(self, n: int) -> None:
        """Launches the relay guest counting to `n` and checks every event it streams."""
        request = json.dumps({"mode": "count", "n": n})
        launched = await self.call(msg.Launch, program="relay", input=request)
        assert isinstance(launched, msg.Launched), launched
        seen = await self.until_end(launched.instance)
        assert [m.seq for m in seen] == list(range(1, n + 3))
        assert isinstance(seen[0].event, ev.InferletStarted)
        assert [m.event.text for m in seen[1:-1]] == [str(k) for k in range(n)]
        end = seen[-1].event
        assert isinstance(end, ev.InferletReturned) and end.result == "counted", end

    async def relays(self, texts: list[str]) -> None:
        """Talks to the relay guest and checks each answer and the count it returns."""
        launched = await self.call(msg.Launch, program="relay", input='{"mode":"relay"}')
        assert isinstance(launched, msg.Launched), launched
        for text in [*texts, "bye"]:
            sent = await self.call(msg.SendMessage, instance=launched.instance, text=text)
            assert sent == msg.Done(corr=self.corr)
        seen = await self.until_end(launched.instance)
        assert [m.seq for m in seen] == list(range(1, len(texts) + 3)), seen
        answers = [m.event.text for m in seen[1:-1]]
        assert answers == [f"{k}:{text}" for k, text in enumerate(texts, 1)]
        end = seen[-1].event
        assert isinstance(end, ev.InferletReturned) and end.result == str(len(texts)), end


async def fuzz(url: str, plan: Plan, answers: collections.Counter[str]) -> None:
    """Sends every frame of `plan` while checking each answer in order, counting answers by
    failure kind or message type. Fails if the server closes the connection."""
    sent: list[Frame] = []
    answered: list[Any] = []
    answer_came = trio.lowlevel.ParkingLot()
    launched = [""]
    async with await connect(url) as ws:
        assert isinstance(decode_server_frame(await ws.get_message()), msg.Welcome)
        async with trio.open_nursery() as nursery:

            async def send_all() -> None:
                for index, (frame, _) in enumerate(plan):
                    if isinstance(frame, ToLatest):
                        while len(answered) < index:  # the latest launch may be among them
                            await answer_came.park()
                        frame = frame.frame(launched[0])
                    sent.append(frame)
                    await ws.send_message(frame)

            nursery.start_soon(send_all)
            for index, (_, expect) in enumerate(plan):
                while True:
                    try:
                        reply = decode_server_frame(await ws.get_message())
                    except ConnectionClosed as closed:
                        pytest.fail(f"closed ({closed.reason}) before answering frame {index}")
                    if not isinstance(reply, msg.InferletEvent):
                        break
                    assert reply.seq >= 1 and reply.instance.startswith("i"), reply
                    answers["InferletEvent"] += 1
                check_answer(sent[index], expect, reply)
                if isinstance(reply, msg.Launched):
                    launched[0] = reply.instance
                answered.append(reply)
                answer_came.unpark_all()
                answers[reply.kind if isinstance(reply, msg.Failure) else type(reply).__name__] += 1


async def settles(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    """Whether `condition` holds, waiting up to `seconds` for it."""
    with trio.move_on_after(seconds):
        while not condition():
            await trio.sleep(0.02)
    return condition()


RELAYED = ["a", "nul\0inside", "ß ✓ 😀", '{"type":"Launch","corr":1}', ""]
SEEN_KINDS = {
    "bad-frame",
    "too-large",
    "bad-upload",
    "hash-mismatch",
    "invalid-program",
    "no-such-inferlet",
    "no-such-program",
}


async def test_fuzzed_frames_are_each_answered_and_a_good_client_is_served_exactly(
    tmp_path: Path, relay: bytes, seed: int
) -> None:
    plans = [Frames(random.Random(f"{seed}:{k}")).plan(FRAMES) for k in range(FUZZERS)]
    answers: collections.Counter[str] = collections.Counter()
    async with serving(tmp_path, max_frame_mb=1, orphan_seconds=0) as server:
        server.engine.programs.add(relay, "relay")
        async with await connect(server.url) as ws:
            good = Client(ws)
            with trio.fail_after(120):  # from a cold cache the guest is compiled here
                assert isinstance(await good.next(), msg.Welcome)
                welcomed = await good.call(msg.Authenticate, user=GOOD)
                assert welcomed == msg.Authenticated(corr=1, user=GOOD)
                await good.counts(50)
            with trio.fail_after(50):
                rounds_amid_all_fuzzers = 0
                async with trio.open_nursery() as nursery:
                    fuzzing = [len(plans)]

                    async def fuzzer(plan: Plan) -> None:
                        await fuzz(server.url, plan, answers)
                        fuzzing[0] -= 1

                    for plan in plans:
                        nursery.start_soon(fuzzer, plan)
                    while fuzzing[0]:
                        await good.counts(50)
                        await good.relays(RELAYED)
                        rounds_amid_all_fuzzers += fuzzing[0] == len(plans)
                # The fuzzers are gone; the good client is served as before.
                await good.counts(50)
                await good.relays(RELAYED)
                assert await settles(lambda: server.statistics().connections == 1)
                assert await settles(lambda: not server.hub.live_instances())
                listing = await good.call(msg.ListInferlets)
                assert listing == msg.InferletList(corr=good.corr, inferlets=())
        assert await settles(lambda: not server.sessions)
        assert rounds_amid_all_fuzzers >= 1
        assert sum(answers.values()) - answers["InferletEvent"] == sum(map(len, plans))
        assert SEEN_KINDS <= set(answers), answers
        successes = {"UploadProgress", "ProgramFound", "Authenticated", "Launched", "Done"}
        assert successes <= set(answers), answers
        assert server.statistics().connections == 0
        assert server.engine.statistics().kv.contexts == 0


async def vanish_mid_stream(port: int, n: int, after: int) -> str:
    """Launches the relay guest counting to `n` over a bare WebSocket, reads `after` of its
    events and resets the TCP connection without a closing handshake."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host=f"127.0.0.1:{port}", target="/")))
    instance, seen, text = "", 0, ""
    while seen < after:
        data = await stream.receive_some(1 << 16)
        assert data, "the server closed the connection"
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                launch = msg.Launch(
                    corr=1, program="relay", input=json.dumps({"mode": "count", "n": n})
                )
                await stream.send_all(ws.send(WsMessage(data=encode_frame(launch))))
            elif isinstance(event, TextMessage):
                text += event.data
                if not event.message_finished:
                    continue
                message, text = decode_server_frame(text), ""
                if isinstance(message, msg.Launched):
                    instance = message.instance
                elif isinstance(message, msg.InferletEvent):
                    assert not isinstance(message.event, ev.InferletEnd), "ended too soon"
                    seen += 1
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()
    return instance


async def test_a_client_vanishing_mid_stream_leaves_another_streaming_client_whole(
    tmp_path: Path, relay: bytes
) -> None:
    n = 2000
    async with serving(tmp_path) as server:
        server.engine.programs.add(relay, "relay")
        async with await connect(server.url) as ws:
            steady = Client(ws)
            with trio.fail_after(120):  # from a cold cache the guest is compiled here
                assert isinstance(await steady.next(), msg.Welcome)
                await steady.counts(5)
            with trio.fail_after(40):
                gone: list[str] = []
                async with trio.open_nursery() as nursery:

                    async def vanish() -> None:
                        gone.append(await vanish_mid_stream(server.port, n, after=100))

                    nursery.start_soon(vanish)
                    await steady.counts(n)
                assert await settles(lambda: server.statistics().connections == 1)
                assert await settles(lambda: not server.hub.live_instances())
                # The vanished client's inferlet ran on, detached, and kept all it said.
                attached = await steady.call(msg.Attach, instance=gone[0], after=0)
                assert attached == msg.Done(corr=steady.corr)
                kept = await steady.until_end(gone[0])
                assert [m.seq for m in kept] == list(range(1, n + 3))
                assert [m.event.text for m in kept[1:-1]] == [str(k) for k in range(n)]
                assert kept[-1].event.result == "counted"
                await steady.counts(20)
        assert await settles(lambda: not server.sessions)
        assert server.statistics().connections == 0
        assert server.engine.statistics().kv.contexts == 0
