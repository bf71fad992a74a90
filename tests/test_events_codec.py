"""Every event survives codec.dumps/loads unchanged; malformed messages fail naming the bad path."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pie.events import ALL_EVENTS, codec
from pie.events import batching as batch_ev
from pie.events import bus as bus_ev
from pie.events import http as http_ev
from pie.events import inferlet as inf_ev
from pie.events import kv as kv_ev
from pie.events import mcp as mcp_ev
from pie.events import recording as rec_ev
from pie.events import speculation as spec_ev
from pie.events.forward import ForwardRequest, MediaRun, PageCopy
from pie.events.sampling import (
    PROBES,
    SAMPLERS,
    Argmax,
    Distribution,
    DistributionOutput,
    Entropy,
    EntropyOutput,
    LogitBias,
    LogitsOutput,
    LogProbs,
    LogProbsOutput,
    MinP,
    Multinomial,
    Penalty,
    RawLogits,
    SamplingSlot,
    SlotOp,
    TokenOutput,
    TopK,
    TopKTopP,
    TopP,
)

pytestmark = pytest.mark.unit

OPS: tuple[SlotOp, ...] = (
    Argmax(),
    Multinomial(temperature=0.7, seed=11),
    TopK(temperature=1.5, k=7, seed=3),
    TopP(temperature=0.9, p=0.5),
    MinP(temperature=2.0, p=0.25, seed=99),
    TopKTopP(temperature=0.3, k=4, p=0.75, seed=0),
    Distribution(k=3, temperature=0.5),
    RawLogits(),
    LogProbs(tokens=(1, 5, 9)),
    Entropy(),
)
SLOTS = tuple(SamplingSlot(index=i, op=op) for i, op in enumerate(OPS))
OUTPUTS = (
    TokenOutput(token=42),
    DistributionOutput(tokens=(3, 1), probs=(0.75, 0.25)),
    LogitsOutput(values=(0.5, -1.25, 3.0)),
    LogProbsOutput(values=(-0.1, -2.5)),
    EntropyOutput(value=1.375),
)
LEASE = spec_ev.Lease(
    lease=3,
    context=4,
    requester="client:3",
    pages=(8, 2, 6, 9),
    owned=3,
    masked_pages=(1,),
    next_slot=15,
    next_position=15,
    op=TopP(p=0.9, temperature=0.7, seed=2**62),
    adapter="sql",
)
REQUEST = ForwardRequest(
    corr=7,
    requester="client:3",
    context=4,
    tokens=tuple(range(10)),
    positions=tuple(range(5, 15)),
    kv_start=5,
    pages=(8, 2, 6),
    masked_pages=(1,),
    attention_masks=tuple((0, 6 + i) for i in range(10)),
    logit_mask=(10, 5, 985),
    logit_bias=(LogitBias(mask=(0, 10, 990), value=-2.5),),
    slots=SLOTS,
    copies=(PageCopy(src=3, dst=2),),
    final=False,
    slot_positions=tuple(range(10, 20)),
    adapter="sql",
    lease=LEASE,
)

APPLIED = spec_ev.LanePassApplied(
    lease=3,
    context=4,
    corr=9,
    token=17,
    position=15,
    page=6,
    staged=True,
    outputs=(TokenOutput(token=5),),
)

SAMPLES = (
    LEASE,
    kv_ev.LendSnapshot(corr=3, requester="copy:1", name="plan", user="ada"),
    kv_ev.SnapshotLent(
        corr=3, lease=2, tokens=(5, 9, 33), positions=(0, 1, 2), pages=(7,), plain=True
    ),
    kv_ev.ImportPages(corr=4, requester="copy:1", context=2, tokens=(5, 9), positions=(0, 1)),
    kv_ev.PagesPlaced(corr=4, pages=(3, 8), kv_start=4),
    kv_ev.SnapshotMissing(
        corr=5, requester="inferlet:1", name="plan", user="ada", take=True, message="none"
    ),
    LogitBias(mask=(3, 997), value=7.5),
    Penalty(presence=0.5, frequency=-1.25, tokens=(4, 4, 9)),
    http_ev.HttpFetch(
        corr=4,
        requester="inferlet:1",
        method="POST",
        url="http://127.0.0.1:8000/x?y=1",
        headers=(("content-type", "application/json"),),
        body=b'{"a": 1}\x00\xff',
        timeout_seconds=2.5,
        max_redirects=0,
    ),
    http_ev.HttpFetched(
        corr=4,
        status=200,
        url="http://127.0.0.1:8000/x?y=1",
        headers=(("content-length", "2"),),
        body=b"ok",
    ),
    mcp_ev.McpListServers(corr=5, requester="inferlet:1", user="ann"),
    mcp_ev.McpServerList(corr=5, servers=("files", "search")),
    mcp_ev.McpListTools(corr=6, requester="inferlet:1", user="ann", server="files"),
    mcp_ev.McpToolList(
        corr=6,
        server="files",
        tools=(
            mcp_ev.McpTool(
                name="read", description="Reads a file.", input_schema='{"type": "object"}'
            ),
        ),
    ),
    mcp_ev.McpTool(name="list", description="", input_schema="{}"),
    mcp_ev.McpCallTool(
        corr=7,
        requester="inferlet:1",
        user="ann",
        server="files",
        tool="read",
        arguments='{"path": "a.txt"}',
        timeout_seconds=1.5,
    ),
    mcp_ev.McpToolCalled(
        corr=7,
        content='[{"type": "text", "text": "hé"}]',
        text="hé",
        structured='{"result": "hé"}',
        is_error=True,
    ),
    APPLIED,
    spec_ev.LanePassesApplied(passes=(APPLIED, APPLIED)),
    spec_ev.LeaseReleased(lease=3, context=4),
    kv_ev.CreateContext(corr=1, requester="a"),
    kv_ev.ForkContext(corr=2, requester="a", context=3),
    kv_ev.DestroyContext(corr=3, requester="a", context=3),
    kv_ev.SaveContext(corr=4, requester="a", context=3, name="greeting", user="ann"),
    kv_ev.OpenContext(corr=5, requester="b", name="greeting", user="ann", take=True),
    kv_ev.DeleteSnapshot(corr=6, requester="b", name="greeting", user="ann"),
    kv_ev.DropSnapshots(corr=7, requester="operator", user="ann"),
    kv_ev.TruncateContext(corr=7, requester="a", context=3, count=5),
    kv_ev.MaskPages(corr=8, requester="a", context=3, pages=(0, 2), masked=False),
    kv_ev.ReleasePages(corr=8, requester="a", context=3, pages=(1, 2)),
    kv_ev.DescribeContext(corr=9, requester="a", context=3),
    kv_ev.SubmitForward(
        corr=10,
        requester="a",
        context=3,
        tokens=(4,),
        window=kv_ev.AttentionWindow(sink_pages=1, window_pages=4),
        adapter="sql",
    ),
    kv_ev.SubmitForward(
        corr=10,
        requester="a",
        context=3,
        tokens=(4, 5),
        positions=(9, 10),
        attention_masks=((0, 1), (2,)),
        logit_mask=(500, 500),
        slots=SLOTS[:2],
    ),
    kv_ev.ReleaseRequester(corr=11, requester="a"),
    kv_ev.PassApplied(corr=12, context=3, ok=False),
    kv_ev.ContextCreated(corr=13, context=3),
    kv_ev.ContextInfo(
        corr=14,
        context=3,
        tokens=(1, 2),
        positions=(0, 1),
        pages=1,
        masked_pages=(0,),
    ),
    kv_ev.Done(corr=15),
    kv_ev.RequestFailed(corr=16, kind="out_of_pages", message="need 3 pages"),
    batch_ev.ScheduleForward(request=REQUEST),
    batch_ev.CoresConfigured(kv="{}", scheduler='{"decode_tokens": 16}', bus="{}", admission="{}"),
    batch_ev.FormerSteps(
        model="m",
        steps=(
            batch_ev.FormerSubmit(corr=1, now=0.5),
            batch_ev.FormerDrop(corr=2),
            batch_ev.FormerFinished(seconds=0.01, now=0.51),
            batch_ev.FormerDeadline(ready=1, awaited=True, at=None),
            batch_ev.FormerNext(
                now=0.52, ready=0, awaited=False, batch=3, requests=((1, 4, True),), lanes=2
            ),
        ),
    ),
    batch_ev.FormerSubmit(corr=1, now=0.5),
    batch_ev.FormerDrop(corr=2),
    batch_ev.FormerFinished(seconds=0.01, now=0.51),
    batch_ev.FormerDeadline(ready=1, awaited=True, at=0.6),
    batch_ev.FormerNext(now=0.52, ready=0, awaited=False),
    batch_ev.ForwardCompleted(corr=19, context=3, outputs=OUTPUTS),
    batch_ev.EngineStarted(
        model="synthetic",
        vocab_size=1000,
        page_size=4,
        num_pages=64,
        max_batch_tokens=32,
        max_batch_requests=8,
        adapters=("sql", "chat"),
    ),
    bus_ev.Push(corr=20, requester="a", queue="q", message="hi"),
    bus_ev.Push(corr=21, requester="a", queue="q", message="hi", user="ann"),
    bus_ev.Pull(corr=21, requester="b", queue="q"),
    bus_ev.Publish(corr=22, requester="a", topic="news", message="extra"),
    bus_ev.Subscribe(corr=23, requester="b", topic="news"),
    bus_ev.Unsubscribe(corr=24, requester="b", topic="news"),
    bus_ev.LeaveBus(corr=25, requester="b"),
    bus_ev.Pulled(corr=26, queue="q", message="hi"),
    bus_ev.TopicMessage(corr=27, topic="news", sender="a", message="extra"),
    kv_ev.ReserveTokens(corr=28, requester="a", context=3, count=40),
    inf_ev.LaunchInferlet(corr=29, requester="a", program="demo@1.0", input='{"x": 1}'),
    inf_ev.ProgramRegistered(hash="ab" * 32, name="demo", version="1.0", owner=None, size=9),
    inf_ev.InferletLaunched(corr=29, instance="i1", queued=True),
    inf_ev.TerminateInferlet(corr=30, requester="a", instance="i1"),
    inf_ev.DetachInferlet(corr=31, requester="a", instance="i1"),
    inf_ev.LaunchInferlet(
        corr=32,
        requester="http",
        program="api",
        input="",
        request=inf_ev.IncomingRequest(
            method="POST", path="/x", query="a=1", headers=(("k", "v"),), body=b"\x00{}"
        ),
    ),
    inf_ev.IncomingRequest(method="GET", path="/", query="", headers=(), body=b""),
    inf_ev.ResponseStarted(instance="i1", status=200, headers=(("content-type", "text/plain"),)),
    inf_ev.ResponseBody(instance="i1", chunk=b"data: 1\n\n"),
    inf_ev.SendToInferlet(corr=31, requester="a", instance="i1", data=b"\x00\xffbytes"),
    inf_ev.SessionInput(instance="i1", text="hello"),
    inf_ev.SessionReceived(instance="i1", size=5),
    inf_ev.InferletStarted(instance="i1", program="ab" * 32),
    inf_ev.InferletOutput(instance="i1", stream="stderr", text="warning\n"),
    inf_ev.SessionMessage(instance="i1", data=b"\x01\x02"),
    inf_ev.InferletReturned(instance="i1", result="{}", seconds=0.25),
    inf_ev.InferletOutcome(instance="i1", status="returned", result="{}", seconds=0.25),
    inf_ev.InferletFailed(instance="i1", status="timeout", error="out of time", seconds=300.0),
    inf_ev.InferletTerminated(instance="i1", reason="terminated by a", seconds=1.5),
    inf_ev.InferletFinished(instance="i1", status="returned", result="{}", seconds=0.25),
    PageCopy(src=1, dst=2),
    MediaRun(index=2, count=3, media="9f2c", offset=1),
    kv_ev.AttentionWindow(sink_pages=0, window_pages=2),
    rec_ev.HostCallsRecorded(instance="i1", first=3, calls='[["model.load",[""],{"ok":1}]]'),
    REQUEST,
    *OPS,
    *SLOTS,
    *OUTPUTS,
)


def test_the_samples_cover_every_event_class() -> None:
    assert {type(s) for s in SAMPLES} == set(ALL_EVENTS)
    assert {type(op) for op in OPS} == set(SAMPLERS + PROBES)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_event_round_trips(event: object) -> None:
    text = codec.dumps(event)
    assert json.loads(text)["type"] == type(event).__name__
    assert codec.loads(text) == event


ops = st.one_of(
    st.builds(Argmax),
    st.builds(Multinomial, temperature=st.floats(0.01, 10), seed=st.none() | st.integers(0, 2**32)),
    st.builds(TopK, k=st.integers(1, 100), seed=st.none() | st.integers(0, 2**32)),
    st.builds(TopP, p=st.floats(0.01, 1.0)),
    st.builds(MinP, p=st.floats(0.01, 1.0), temperature=st.floats(0.01, 10)),
    st.builds(TopKTopP, k=st.integers(1, 100), p=st.floats(0.01, 1.0)),
    st.builds(Distribution, k=st.integers(1, 100)),
    st.builds(RawLogits),
    st.builds(LogProbs, tokens=st.tuples(st.integers(0, 999))),
    st.builds(Entropy),
)
token_lists = st.lists(st.integers(0, 10**6), min_size=1, max_size=8).map(tuple)


@settings(max_examples=60, deadline=None)
@given(
    tokens=token_lists,
    slots=st.lists(st.builds(SamplingSlot, index=st.integers(0, 7), op=ops), max_size=4).map(tuple),
    requester=st.text(max_size=12),
    final=st.booleans(),
)
def test_generated_forward_requests_round_trip(
    tokens: tuple[int, ...], slots: tuple[SamplingSlot, ...], requester: str, final: bool
) -> None:
    request = ForwardRequest(
        corr=1,
        requester=requester,
        context=2,
        tokens=tokens,
        positions=tokens,
        kv_start=0,
        pages=(0,),
        slots=slots,
        final=final,
    )
    event = batch_ev.ScheduleForward(request=request)
    assert codec.loads(codec.dumps(event)) == event


def _error(data: object) -> str:
    with pytest.raises(codec.DecodeError) as caught:
        codec.decode(data)
    return str(caught.value)


def _submit(**fields: object) -> dict[str, object]:
    base = {"type": "SubmitForward", "corr": 1, "requester": "a", "context": 1, "tokens": [1]}
    return {**base, **fields}


def test_extra_keys_are_refused_with_their_path() -> None:
    assert "extra fields found (bogus) @ $" in _error({"type": "Done", "corr": 1, "bogus": 2})
    message = _error(_submit(slots=[{"index": 0, "op": {"type": "TopK", "kk": 3}}]))
    assert "extra fields found (kk) @ $.slots[0].op" in message


def test_a_missing_field_is_named() -> None:
    assert "required field missing @ $.corr" in _error({"type": "Done"})


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"type": "Done", "corr": "5"}, "$.corr"),
        ({"type": "Done", "corr": 5.5}, "$.corr"),
        ({"type": "Done", "corr": True}, "$.corr"),
        ({"type": "CreateContext", "corr": 1, "requester": 7}, "$.requester"),
        ({"type": "PassApplied", "corr": 1, "context": 1, "ok": "yes"}, "$.ok"),
        (_submit(tokens="123"), "$.tokens"),
        (_submit(tokens={"1": 1}), "$.tokens"),
        (_submit(tokens=[1, "x"]), "$.tokens[1]"),
        (_submit(positions=[None]), "$.positions"),
        (
            _submit(slots=[{"index": 0, "op": {"type": "TopK", "temperature": "hot"}}]),
            "$.slots[0].op.temperature",
        ),
        (
            {"type": "ForwardCompleted", "corr": 1, "context": 1, "outputs": [{"token": 1.5}]},
            "$.outputs[0]",
        ),
        (
            {
                "type": "ForwardCompleted",
                "corr": 1,
                "context": 1,
                "outputs": [{"type": "TokenOutput", "token": 1.5}],
            },
            "$.outputs[0].token",
        ),
        ({"type": "ScheduleForward", "request": {"corr": 1}}, "$.request.pages"),
    ],
)
def test_wrong_field_types_are_refused_with_their_path(data: dict[str, object], path: str) -> None:
    assert f"@ {path}" in _error(data)


def test_an_unknown_event_type_is_refused() -> None:
    assert "unknown event type 'Nope'" in _error({"type": "Nope", "corr": 1})
    assert "unknown event type None" in _error({"corr": 1})
    assert "expected an object" in _error([1, 2])


def test_an_unknown_sampler_type_is_named_at_its_path() -> None:
    message = _error(_submit(slots=[{"index": 0, "op": {"type": "Beam"}}]))
    assert "'Beam'" in message and "@ $.slots[0].op" in message
    message = _error(_submit(slots=[{"index": 0, "op": {"k": 3}}]))
    assert "'type'" in message and "@ $.slots[0].op" in message


def test_a_validator_failure_says_why() -> None:
    message = _error(_submit(slots=[{"index": 0, "op": {"type": "TopK", "k": 0}}]))
    assert "k must be >= 1, got 0" in message and "@ $.slots[0].op" in message


def test_text_that_is_not_json_is_refused() -> None:
    with pytest.raises(codec.DecodeError, match="not JSON"):
        codec.loads("{nope")


def test_the_lane_passes_of_a_pass_are_written_as_arrays_and_read_in_either_form() -> None:
    applied = spec_ev.LanePassesApplied(passes=(APPLIED,))
    written = json.loads(codec.dumps(applied))["passes"][0]
    assert written[:7] == [
        APPLIED.lease,
        APPLIED.context,
        APPLIED.corr,
        APPLIED.token,
        APPLIED.position,
        APPLIED.page,
        APPLIED.staged,
    ]
    as_object = json.loads(codec.dumps(APPLIED))  # alone, a lane pass stays an object
    del as_object["type"]
    assert codec.decode({"type": "LanePassesApplied", "passes": [as_object]}) == applied
    with pytest.raises(codec.DecodeError, match=r"expected 8 items .* @ \$\.passes\[0\]"):
        codec.decode({"type": "LanePassesApplied", "passes": [written[:3]]})
