"""The wire protocol's frames: every message type round-trips, and bad frames are refused with
a message naming what is wrong (and the request's corr when it can be read)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pie.events import inferlet as ev
from pie.wire import messages as m
from pie.wire.frames import (
    FrameError,
    decode_client_frame,
    decode_server_frame,
    encode_frame,
)

pytestmark = pytest.mark.unit

CLIENT_SAMPLES = (
    m.Authenticate(corr=1, user="ada", token="s3cret"),
    m.Authenticate(corr=2, user="ada", signature="c2lnbmVk"),
    m.RequestChallenge(corr=3, user="ada"),
    m.QueryProgram(corr=4, program="text-completion@0.1.0"),
    m.UploadProgram(
        corr=5, name="tc", version="1.0", hash="ab" * 32, size=3, index=0, count=1, data=b"\0as"
    ),
    m.Launch(corr=6, program="tc", input='{"prompt": "hi"}'),
    m.Launch(corr=18, program="tc", snapshots=("system-prompt",), placed=True),
    m.Attach(corr=7, instance="i1", after=12),
    m.Detach(corr=8, instance="i1"),
    m.SendMessage(corr=9, instance="i1", text="hello"),
    m.SendMessage(corr=10, instance="i1", data=b"\x00\xff"),
    m.Terminate(corr=11, instance="i1"),
    m.ListInferlets(corr=12),
    m.QueryStatistics(corr=13),
    m.Watch(corr=14, topic="swarm/plan"),
    m.Unwatch(corr=15, topic="swarm/plan"),
    m.Publish(corr=16, topic="news", message="hello"),
    m.Push(corr=17, queue="jobs", message="job-1"),
)

SERVER_SAMPLES = (
    m.Welcome(
        protocol=m.PROTOCOL_VERSION, server="pie 0.1.0", model="smollm2", auth_required=False
    ),
    m.Welcome(
        protocol=m.PROTOCOL_VERSION, server="pie", model="m", auth_required=True, node="node-a"
    ),
    m.Done(corr=1),
    m.Failure(corr=2, kind="no-such-program", message="no program 'x'"),
    m.ChallengeIssued(corr=3, nonce="bm9uY2U="),
    m.Authenticated(corr=4, user="ada"),
    m.ProgramFound(corr=5, hash="ab" * 32, name="tc", version="1.0", size=19_000_000),
    m.UploadProgress(corr=6, received=1 << 20),
    m.Launched(corr=7, instance="i3", queued=True),
    m.Redirect(corr=7, node="node-3f2a9c01", url="ws://10.0.0.5:8080"),
    m.InferletList(
        corr=8,
        inferlets=(
            m.InferletSummary(
                instance="i3", program="tc", user="ada", state="running", attached=True
            ),
        ),
    ),
    m.EngineStatus(
        corr=9,
        model="smollm2",
        pages_total=1456,
        pages_free=1400,
        contexts=3,
        passes=120,
        mean_batch_size=7.5,
        last_pass_ms=48.0,
        inferlets_running=3,
        inferlets_queued=0,
        driver_threads=1,
    ),
    m.InferletEvent(instance="i3", seq=1, event=ev.InferletStarted(instance="i3", program="ab")),
    m.InferletEvent(
        instance="i3", seq=2, event=ev.InferletOutput(instance="i3", stream="stdout", text="x\n")
    ),
    m.InferletEvent(instance="i3", seq=3, event=ev.SessionMessage(instance="i3", data=b"\x01")),
    m.InferletEvent(
        instance="i3", seq=4, event=ev.InferletReturned(instance="i3", result="ok", seconds=1.0)
    ),
    m.InferletEvent(
        instance="i3",
        seq=5,
        event=ev.InferletFailed(instance="i3", status="timeout", error="late", seconds=2.0),
    ),
    m.InferletEvent(
        instance="i3",
        seq=6,
        event=ev.InferletTerminated(instance="i3", reason="stopped", seconds=0.5),
    ),
    m.WatchedMessage(topic="news", sender="inferlet:i3", message="hello"),
)


def test_the_samples_cover_every_message_type() -> None:
    assert {type(s) for s in CLIENT_SAMPLES} == set(m.CLIENT_MESSAGES)
    assert {type(s) for s in SERVER_SAMPLES} == set(m.SERVER_MESSAGES)


@pytest.mark.parametrize("message", CLIENT_SAMPLES, ids=lambda x: type(x).__name__)
def test_client_messages_round_trip(message: object) -> None:
    assert decode_client_frame(encode_frame(message)) == message


@pytest.mark.parametrize("message", SERVER_SAMPLES, ids=lambda x: type(x).__name__)
def test_server_messages_round_trip(message: object) -> None:
    assert decode_server_frame(encode_frame(message)) == message


def test_an_engine_status_without_driver_threads_reads_as_zero() -> None:
    status = next(s for s in SERVER_SAMPLES if isinstance(s, m.EngineStatus))
    frame = json.loads(encode_frame(status))
    del frame["driver_threads"]  # as a server from before the field sends it
    assert decode_server_frame(json.dumps(frame)).driver_threads == 0


def test_frames_are_tagged_json_objects() -> None:
    frame = json.loads(encode_frame(m.Launch(corr=6, program="tc", input="{}")))
    assert frame == {"type": "Launch", "corr": 6, "program": "tc", "input": "{}"}


@pytest.mark.parametrize(
    ("frame", "words", "corr"),
    [
        ("{not json", "not JSON", 0),
        ("[1, 2]", "expected an object", 0),
        ('{"type": "Explode", "corr": 4}', "unknown message type 'Explode'", 4),
        ('{"type": "Launched", "corr": 4, "instance": "i", "queued": false}', "unknown", 4),
        ('{"type": "Launch", "corr": 5}', "program", 5),
        ('{"type": "Launch", "corr": 5, "program": 7}', "program", 5),
        ('{"type": "Launch", "corr": 5, "program": "x", "extra": 1}', "extra", 5),
        ('{"type": "Attach", "corr": "7", "instance": "i1"}', "corr", 0),
        ('{"type": "SendMessage", "corr": 8, "instance": "i", "data": "no, no."}', "data", 8),
    ],
)
def test_bad_frames_are_refused_with_a_reason(frame: str, words: str, corr: int) -> None:
    with pytest.raises(FrameError) as refused:
        decode_client_frame(frame)
    assert refused.value.kind == "bad-frame"
    assert words in str(refused.value)
    assert refused.value.corr == corr


def test_oversized_frames_are_refused_before_parsing() -> None:
    with pytest.raises(FrameError) as refused:
        decode_client_frame("x" * 101, max_size=100)
    assert refused.value.kind == "too-large"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
def test_random_frames_never_raise_anything_but_frame_errors(frame: str | bytes) -> None:
    try:
        decode_client_frame(frame)
    except FrameError:
        pass
