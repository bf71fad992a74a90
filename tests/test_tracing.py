"""OpenTelemetry spans on the synthetic driver: a launch is one span with its host calls (forward
passes, a generation run, HTTP fetches with the engine's request under each) as children, the
passes that carried its requests link to it, and every `pie.corr` names a request in the event
log; the per-launch bound, sampling, and tracing off make no spans."""

from __future__ import annotations

import http.server
import importlib.machinery
import json
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pie.config import ConfigError, EngineConfig, config_from_dict, with_overrides
from pie.config.tracing_section import OTLP_EXPORTER
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from pie.events.kv import SubmitForward
from pie.events.speculation import LanePassesApplied
from pie.observe.tracing import Tracing
from tests.inferlet_fixtures import GUESTS, CompiledGuest, compile_guest
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

PROMPT = [100, 101, 102, 103, 104]
TOKENS = 6


@pytest.fixture(scope="module")
def guests(
    built: Callable[[Path], Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, CompiledGuest]:
    """The guests these tests run, by folder name, each built and compiled once."""
    names = ("run_probe", "fetcher", "toolbox")
    return {name: compile_guest(built, tmp_path_factory, GUESTS / name) for name in names}


@pytest.fixture
def server() -> Iterator[str]:
    """http://127.0.0.1:PORT, answering every GET with 200 and a short body."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def engine_for(
    tokenizer: Tokenizer, guest: CompiledGuest, *, tracing: dict[str, Any], **sections: Any
) -> Any:
    config = with_overrides(
        EngineConfig(),
        sandbox={"cache_dir": str(guest.components)},
        tracing=tracing,
        **sections,
    )
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size, pass_seconds=0.001)
    return open_engine(config, driver=driver, tokenizer=tokenizer)


def traced(engine: Engine) -> InMemorySpanExporter:
    assert engine.tracing is not None
    exporter = InMemorySpanExporter()
    engine.tracing.export_to(exporter)
    return exporter


async def run(engine: Engine, guest: CompiledGuest, request: dict[str, Any]) -> Any:
    program = engine.programs.add(guest.wasm).hash
    with trio.fail_after(60):
        outcome = await engine.run_inferlet(program, json.dumps(request))
    assert outcome.ok, outcome.error
    return json.loads(outcome.result or "null")


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def the_launch(spans: tuple[ReadableSpan, ...]) -> ReadableSpan:
    launches = named(spans, "pie.launch")
    assert len(launches) == 1
    return launches[0]


def children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> list[ReadableSpan]:
    """The spans whose parent is `parent`, each checked to be in its trace."""
    context = parent.context
    assert context is not None
    found = [s for s in spans if s.parent is not None and s.parent.span_id == context.span_id]
    assert all(s.context is not None and s.context.trace_id == context.trace_id for s in found)
    return found


def forward_corrs(engine: Engine) -> set[int]:
    """The correlation ids of every forward pass the log holds: each SubmitForward, and each
    pass on the fast path (inside the LanePassesApplied that told the kv actor of it)."""
    assert engine.log is not None
    corrs = set()
    for envelope in engine.log.records():
        match envelope.event:
            case SubmitForward():
                corrs.add(envelope.corr)
            case LanePassesApplied():
                corrs.update(applied.corr for applied in envelope.event.passes)
    return corrs


def launch_corr(engine: Engine) -> int:
    assert engine.log is not None
    corrs = [e.corr for e in engine.log.records() if type(e.event).__name__ == "LaunchInferlet"]
    assert len(corrs) == 1
    return corrs[0]


@pytest.mark.integration
async def test_a_launch_is_a_tree_of_its_forward_passes_linked_from_the_passes(
    guests: dict[str, CompiledGuest], tokenizer: Tokenizer
) -> None:
    probe = guests["run_probe"]
    async with engine_for(tokenizer, probe, tracing={"enabled": True}) as engine:
        exporter = traced(engine)
        got = await run(engine, probe, {"mode": "stepped", "prompt": PROMPT, "tokens": TOKENS})
        assert len(got["tokens"]) == TOKENS
        spans = exporter.get_finished_spans()
        logged = forward_corrs(engine)
        launch = the_launch(spans)
        assert launch.attributes is not None and launch.context is not None
        assert launch.attributes["pie.corr"] == launch_corr(engine)
        assert launch.attributes["pie.outcome"] == "returned"
        assert launch.status.status_code is not StatusCode.ERROR
        forwards = children(spans, launch)
        # The prompt's pass, then one per token but the last (which no pass writes).
        assert [f.name for f in forwards] == ["pie.forward"] * TOKENS
        corrs = {f.attributes["pie.corr"] for f in forwards if f.attributes}
        assert len(corrs) == TOKENS and corrs <= logged
        passes = named(spans, "pie.pass")
        served = [p for p in passes if any(k.context == launch.context for k in p.links)]
        assert served and all(p.attributes and p.attributes["pie.batch_size"] >= 1 for p in served)
        carried = {c for p in served if p.attributes for c in p.attributes["pie.corrs"]}
        assert carried & corrs
    assert engine.tracing is not None and not engine.tracing.by_corr


@pytest.mark.integration
async def test_a_generation_run_is_one_span_named_by_its_first_pass(
    guests: dict[str, CompiledGuest], tokenizer: Tokenizer
) -> None:
    probe = guests["run_probe"]
    async with engine_for(tokenizer, probe, tracing={"enabled": True}) as engine:
        exporter = traced(engine)
        got = await run(engine, probe, {"mode": "whole", "prompt": PROMPT, "tokens": TOKENS})
        spans = exporter.get_finished_spans()
        launch = the_launch(spans)
        (generate,) = children(spans, launch)
        assert generate.name == "pie.generate" and generate.attributes is not None
        assert generate.attributes["pie.finished"] == got["stop"] == "length"
        assert generate.attributes["pie.generated"] == TOKENS
        assert generate.attributes["pie.corr"] in forward_corrs(engine)


@pytest.mark.integration
async def test_a_fetch_holds_the_engines_request_and_a_refusal_is_marked(
    guests: dict[str, CompiledGuest], tokenizer: Tokenizer, server: str
) -> None:
    fetcher = guests["fetcher"]
    network = {"allow": ("127.0.0.1",), "timeout_seconds": 5.0}
    async with engine_for(tokenizer, fetcher, tracing={"enabled": True}, network=network) as engine:
        exporter = traced(engine)
        requests = [{"url": f"{server}/a?token=secret"}, {"url": "http://10.1.2.3/"}]
        got = await run(engine, fetcher, {"requests": requests})
        assert got[0]["status"] == 200 and got[1]["error"] == "denied"
        spans = exporter.get_finished_spans()
        launch = the_launch(spans)
        fetches = sorted(children(spans, launch), key=lambda s: s.start_time or 0)
        assert [f.name for f in fetches] == ["pie.http.fetch"] * 2
        for fetch, status in zip(fetches, (StatusCode.UNSET, StatusCode.ERROR), strict=True):
            (request,) = children(spans, fetch)
            assert request.name == "pie.http.request" and request.attributes and fetch.attributes
            assert request.attributes["pie.corr"] == fetch.attributes["pie.corr"]
            assert fetch.status.status_code is status and request.status.status_code is status
        ok = children(spans, fetches[0])[0].attributes
        assert ok and ok["http.response.status_code"] == 200
        assert ok["server.address"] == "127.0.0.1"
        assert "secret" not in json.dumps([dict(s.attributes or {}) for s in spans])
        assert engine.log is not None
        logged = {e.corr for e in engine.log.records() if type(e.event).__name__ == "HttpFetch"}
        assert {f.attributes["pie.corr"] for f in fetches if f.attributes} == logged


@pytest.mark.integration
async def test_an_mcp_call_holds_the_mcp_actors_work_and_both_say_why_it_failed(
    guests: dict[str, CompiledGuest], tokenizer: Tokenizer
) -> None:
    toolbox = guests["toolbox"]
    async with engine_for(tokenizer, toolbox, tracing={"enabled": True}) as engine:
        exporter = traced(engine)
        step = {"op": "call", "server": "nowhere", "tool": "echo", "arguments": {}}
        (got,) = await run(engine, toolbox, {"steps": [step]})
        assert got["error"] == "no-such-server"
        spans = exporter.get_finished_spans()
        (called,) = children(spans, the_launch(spans))
        (request,) = children(spans, called)
        assert (called.name, request.name) == ("pie.mcp.call_tool", "pie.mcp.request")
        for span in (called, request):
            assert span.status.status_code is StatusCode.ERROR and span.attributes
            assert span.attributes["pie.error"] == "no-such-server"
            assert span.attributes["pie.mcp.tool"] == "echo"
        assert called.attributes and request.attributes
        assert called.attributes["pie.corr"] == request.attributes["pie.corr"]


@pytest.mark.integration
async def test_a_launch_keeps_at_most_its_bound_of_spans_and_counts_the_rest(
    guests: dict[str, CompiledGuest], tokenizer: Tokenizer
) -> None:
    probe = guests["run_probe"]
    tracing = {"enabled": True, "max_spans_per_inferlet": 2}
    async with engine_for(tokenizer, probe, tracing=tracing) as engine:
        exporter = traced(engine)
        await run(engine, probe, {"mode": "stepped", "prompt": PROMPT, "tokens": TOKENS})
        spans = exporter.get_finished_spans()
        launch = the_launch(spans)
        assert len(children(spans, launch)) == 2
        assert launch.attributes and launch.attributes["pie.spans_dropped"] == TOKENS - 2
        # A second launch has a bound of its own.
        await run(engine, probe, {"mode": "stepped", "prompt": PROMPT, "tokens": 2})
        assert len(named(exporter.get_finished_spans(), "pie.forward")) == 4


@pytest.mark.integration
async def test_tracing_off_or_sampled_out_makes_no_spans(
    guests: dict[str, CompiledGuest], tokenizer: Tokenizer
) -> None:
    probe = guests["run_probe"]
    request = {"mode": "stepped", "prompt": PROMPT, "tokens": TOKENS}
    tracing = {"enabled": True, "sample_ratio": 0.0}
    async with engine_for(tokenizer, probe, tracing=tracing) as engine:
        exporter = traced(engine)
        sampled_out = await run(engine, probe, request)
        assert exporter.get_finished_spans() == ()
    async with engine_for(tokenizer, probe, tracing={}) as engine:
        assert engine.tracing is None
        assert await run(engine, probe, request) == sampled_out


@pytest.mark.unit
def test_an_otlp_endpoint_without_its_exporter_is_a_config_error_naming_the_package() -> None:
    with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-http"):
        config_from_dict({"tracing": {"enabled": True, "otlp_endpoint": "http://collector:4318"}})
    with pytest.raises(ConfigError, match="sample_ratio"):
        config_from_dict({"tracing": {"sample_ratio": 1.5}})
    assert config_from_dict({"tracing": {"enabled": True}}).tracing.enabled


@pytest.mark.unit
def test_an_otlp_endpoint_sends_the_spans_through_the_exporter_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[str] = []

    class Exporter:
        def __init__(self, endpoint: str) -> None:
            self.endpoint = endpoint

        def export(self, spans: Any) -> SpanExportResult:
            sent.extend(f"{self.endpoint} {span.name}" for span in spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    package = types.ModuleType(OTLP_EXPORTER)
    package.__spec__ = importlib.machinery.ModuleSpec(OTLP_EXPORTER, None)
    package.OTLPSpanExporter = Exporter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, OTLP_EXPORTER, package)
    endpoint = "http://collector:4318/v1/traces"
    config = config_from_dict({"tracing": {"enabled": True, "otlp_endpoint": endpoint}})
    tracing = Tracing(config.tracing)
    launch = {"address": "inferlet:i1", "launcher": "client:1", "program": "p", "user": "u"}
    tracing.launched("i1", corr=7, **launch)
    tracing.ended("i1", "returned", None)
    tracing.shutdown()
    assert sent == [f"{endpoint} pie.launch"]
