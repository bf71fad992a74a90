"""Authentication through the live server: off for loopback by default, on when configured;
tokens and signed challenges let a user in, anything else is refused and three failures close
the connection. Also the server's pure bookkeeping: the hub and chunked uploads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from trio_websocket import ConnectionClosed

from pie.config import ServerConfig
from pie.events import inferlet as ev
from pie.server.app import auth_required
from pie.server.auth import UserStore
from pie.server.hub import Hub, Refused
from pie.server.uploads import PendingBytes, Uploads, check_hash
from pie.wire import messages as msg
from pie.wire.challenge import sign_nonce
from tests.server_fixtures import Raw, connect, serving


@pytest.mark.unit
def test_auth_is_off_for_loopback_by_default_and_on_elsewhere() -> None:
    assert not auth_required(ServerConfig(host="127.0.0.1"))
    assert not auth_required(ServerConfig(host="::1"))
    assert auth_required(ServerConfig(host="0.0.0.0"))
    assert auth_required(ServerConfig(host="127.0.0.1", auth="on"))
    assert not auth_required(ServerConfig(host="0.0.0.0", auth="off"))


def _key(tmp_path: Path) -> tuple[Path, str]:
    key = ed25519.Ed25519PrivateKey.generate()
    private = tmp_path / "id_ed25519"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public.decode()


@pytest.mark.integration
async def test_with_auth_on_only_a_good_token_or_signature_lets_a_user_in(
    tmp_path: Path,
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("ada")
    private, public = _key(tmp_path)
    users.add("bob", token=False, public_key=public)
    async with serving(tmp_path, auth="on", users=users) as server:
        with trio.fail_after(30):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                assert (await raw.next()).auth_required
                assert (await raw.call(msg.ListInferlets)).kind == "unauthenticated"
                refused = await raw.call(msg.Authenticate, user="ada", token="wrong")
                assert refused.kind == "unauthenticated"
                welcome = await raw.call(msg.Authenticate, user="ada", token=token)
                assert welcome == msg.Authenticated(corr=raw.corr, user="ada")
                assert (await raw.call(msg.ListInferlets)).inferlets == ()
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                nonce = (await raw.call(msg.RequestChallenge, user="bob")).nonce
                signature = sign_nonce(private, nonce)
                # A signature answers one challenge only.
                assert (await raw.call(msg.Authenticate, user="bob", signature=signature)).user
                replayed = await raw.call(msg.Authenticate, user="bob", signature=signature)
                assert replayed.kind == "unauthenticated"


@pytest.mark.integration
async def test_three_failed_authentications_close_the_connection(tmp_path: Path) -> None:
    users = UserStore(tmp_path / "users")
    users.add("ada")
    async with serving(tmp_path, auth="on", users=users) as server:
        with trio.fail_after(30):
            async with await connect(server.url) as ws:
                raw = Raw(ws)
                await raw.next()
                with pytest.raises(ConnectionClosed) as closed:
                    for _ in range(4):
                        await raw.call(msg.Authenticate, user="ada", token="guess")
        assert closed.value.reason.code == 1008


# -- the hub ------------------------------------------------------------------------------------


def _started(instance: str) -> ev.InferletStarted:
    return ev.InferletStarted(instance=instance, program="p")


@pytest.mark.unit
def test_the_hub_keeps_the_newest_events_and_always_the_final_one() -> None:
    hub = Hub(event_buffer=3)
    hub.launched("i1", user="u", program="p", connection=1, queued=False)
    for n in range(5):
        hub.record(ev.SessionMessage(instance="i1", text=str(n)), now=0)
    hub.record(ev.InferletReturned(instance="i1", result="r", seconds=1), now=1)
    replay = hub.attach(2, "u", "i1", after=0)
    assert [m.seq for m in replay] == [4, 5, 6]
    assert isinstance(replay[-1].event, ev.InferletReturned)


@pytest.mark.unit
def test_the_hub_delivers_to_every_attached_connection_and_checks_owners() -> None:
    hub = Hub()
    hub.launched("i1", user="u", program="p", connection=1, queued=True)
    hub.attach(2, "u", "i1", after=0)
    deliveries = hub.record(_started("i1"), now=0)
    assert sorted(c for c, _ in deliveries) == [1, 2]
    assert hub.of_user("u")[0].state == "running"
    with pytest.raises(Refused) as refused:
        hub.attach(3, "someone-else", "i1", after=0)
    assert refused.value.kind == "not-owner"


@pytest.mark.unit
def test_an_orphan_is_due_once_and_an_ended_record_is_forgotten_after_retention() -> None:
    hub = Hub(orphan_seconds=10, retain_seconds=5)
    hub.launched("i1", user="u", program="p", connection=1, queued=False)
    hub.disconnected(1, now=100)
    assert hub.due(now=109) == []
    assert hub.due(now=110) == ["i1"]
    assert hub.due(now=111) == []  # marked stopping, not terminated twice
    hub.record(ev.InferletTerminated(instance="i1", reason="orphan", seconds=1), now=112)
    assert hub.of_user("u") == [] and "i1" in hub.tracked
    hub.due(now=117)
    assert "i1" not in hub.tracked


# -- uploads ------------------------------------------------------------------------------------


def _chunk(data: bytes, index: int, count: int, size: int, digest: str) -> msg.UploadProgram:
    return msg.UploadProgram(
        corr=1, name="n", version="1", hash=digest, size=size, index=index, count=count, data=data
    )


@pytest.mark.unit
def test_an_upload_in_chunks_reports_progress_then_yields_the_bytes() -> None:
    data = b"\0asm" + bytes(range(200))
    digest = hashlib.sha256(data).hexdigest()
    users = PendingBytes(per_user=1000)
    uploads = Uploads(max_size=1000, max_pending=1000, users=users)
    assert uploads.add(_chunk(data[:100], 0, 3, len(data), digest), "u") == 100
    assert uploads.add(_chunk(data[100:200], 1, 3, len(data), digest), "u") == 200
    done = uploads.add(_chunk(data[200:], 2, 3, len(data), digest), "u")
    assert not isinstance(done, int) and done.wasm == data
    check_hash(done)
    assert users.held("u") == len(data)
    uploads.installed(done)
    assert len(uploads) == 0 and users.held("u") == 0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("index", "size", "kind"),
    [(1, 4, "bad-upload"), (0, 5000, "too-large"), (0, 3, "bad-upload")],
)
def test_a_bad_upload_is_refused_and_forgotten(index: int, size: int, kind: str) -> None:
    users = PendingBytes(per_user=1000)
    uploads = Uploads(max_size=1000, max_pending=1000, users=users)
    with pytest.raises(Refused) as refused:
        uploads.add(_chunk(b"abcd", index, 1, size, "a" * 64), "u")
    assert refused.value.kind == kind
    assert len(uploads) == 0 and users.held("u") == 0


@pytest.mark.unit
def test_the_hub_bounds_buffered_bytes_per_inferlet_and_per_user() -> None:
    hub = Hub(event_buffer_bytes=3000, user_buffer_bytes=5000)
    for instance in ("i1", "i2"):
        hub.launched(instance, user="u", program="p", connection=1, queued=False)
    hub.launched("i3", user="other", program="p", connection=1, queued=False)
    for n in range(10):
        hub.record(ev.SessionMessage(instance="i1", text=str(n) * 1000), now=0)
    assert [m.event.text[0] for m in hub.tracked["i1"].events] == ["8", "9"]
    for _ in range(3):
        hub.record(ev.SessionMessage(instance="i2", data=bytes(1000)), now=0)
    hub.record(ev.SessionMessage(instance="i3", text="x" * 2000), now=0)
    big = ev.InferletReturned(instance="i2", result="r" * 4000, seconds=1)
    hub.record(big, now=1)
    # The user's older buffers went first; each inferlet keeps its newest event.
    assert [m.event for m in hub.attach(2, "u", "i2", after=0)] == [big]
    assert len(hub.tracked["i1"].events) == 1
    assert (
        hub.user_bytes["u"] == hub.tracked["i1"].buffered_bytes + hub.tracked["i2"].buffered_bytes
    )
    assert len(hub.tracked["i3"].events) == 1  # another user's buffer is untouched
    hub.due(now=1000)
    assert hub.user_bytes["u"] == hub.tracked["i1"].buffered_bytes
