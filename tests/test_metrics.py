"""Prometheus metrics, /health and /ready: the scrape parses and its values move as the engine
works (passes, tokens, pages, an HTTP 404, a trap, latencies), the probes answer by state, auth
guards /metrics, and `pie serve --metrics-port` serves them all."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
import wasmtime
from prometheus_client.parser import text_string_to_metric_families

from pie.cli import main
from pie.client.local import LocalServer
from pie.config import EngineConfig, MetricsConfig, with_overrides
from pie.drivers import factory
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from pie.eventlog import EventLog
from pie.events.batching import ForwardCompleted
from pie.events.inferlet import InferletFinished, InferletLaunched, LaunchInferlet
from pie.events.sampling import Argmax, SamplingSlot, TokenOutput
from pie.events.speculation import LanePassApplied, LanePassesApplied
from pie.server.auth import UserStore
from pie.server.http import HttpFront
from pie.server.main import bind_ports, serve
from pie.server.mounts import Mounts
from pie.server.observe import starting
from pie.server.observe.metrics import EngineMetrics
from pie.server.observe.probes import Readiness, Unready, probe_routes, server_readiness
from pie.server.observe.token_times import LogTail, TokenTimes
from pie.wire import messages as msg
from tests.inferlet_fixtures import EXAMPLES
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, Raw, connect, serving

HOST_CALLS = Path(__file__).parent / "wat_guests" / "host_calls.wat"


@pytest.fixture(scope="module")
def completion(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(EXAMPLES / "text-completion").read_bytes()


@pytest.fixture(scope="module")
def components() -> Path:
    """Compiled components, kept in pytest's cache between runs (a compile takes seconds)."""
    return PYTEST_CACHE / "pie-components"


class Probed:
    """A state for /ready that the test moves."""

    def __init__(self) -> None:
        self.state: Unready | None = Unready(state="starting", reason="loading")

    def __call__(self) -> Unready | None:
        return self.state


@contextlib.asynccontextmanager
async def front(
    tokenizer: Tokenizer,
    components: Path,
    *,
    readiness: Readiness = lambda: None,
    users: UserStore | None = None,
    public: bool = False,
) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """An engine on the synthetic driver and a front serving only the metrics routes."""
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(components)})
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        metrics = EngineMetrics(engine, MetricsConfig(min_scrape_ms=0))
        routes = probe_routes(metrics, readiness, public_metrics=public)
        http = with_overrides(config, http={"port": 0}).http
        served = HttpFront(engine, http, Mounts({}), host="127.0.0.1", users=users, routes=routes)
        metrics.watch_http(served)
        async with trio.open_nursery() as nursery:
            await nursery.start(served.run)
            async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
                yield engine, client
            served.stop()
            nursery.cancel_scope.cancel()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by (name, sorted labels)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = await client.get("/metrics")
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain")
    undocumented = [name for name in exposed(reply.text) if f"`{name}`" not in DOCUMENTED]
    assert not undocumented, f"metrics missing from docs/observability.md: {undocumented}"
    return samples(reply.text)


DOCUMENTED = (Path(__file__).parents[1] / "docs" / "observability.md").read_text()


def exposed(text: str) -> list[str]:
    """The names of a scrape's families as the docs spell them (counters with `_total`), the
    process's own figures and the client library's `_created` stamps left out."""
    return [
        f"{family.name}_total" if family.type == "counter" else family.name
        for family in text_string_to_metric_families(text)
        if not family.name.startswith("process_") and not family.name.endswith("_created")
    ]


MODEL = (("model", "synthetic"),)


@pytest.mark.integration
async def test_values_move_as_the_engine_works(
    tokenizer: Tokenizer, components: Path, completion: bytes
) -> None:
    async with front(tokenizer, components) as (engine, client):
        with trio.fail_after(60):
            before = await scrape(client)
            program = engine.programs.add(completion, name="text-completion").hash
            request = {"prompt": "Count with me.", "max_tokens": 12, "temperature": 0}
            done = await engine.run_inferlet(program, json.dumps(request))
            assert done.ok, done.error
            trapping = engine.programs.add(bytes(wasmtime.wat2wasm(HOST_CALLS.read_text())))
            trapped = await engine.run_inferlet(trapping.hash, "c")
            missing = await client.get("/nowhere")
            async with engine.requester() as requester:
                context = await requester.create_context()
                await requester.forward(
                    context, list(range(40)), (SamplingSlot(index=39, op=Argmax()),)
                )
                await requester.fork(context)
                await requester.save(context, "kept")
                during = await scrape(client)
            after = await scrape(client)
    assert trapped.status == "trapped" and missing.status_code == 404

    def moved(name: str, labels: tuple[tuple[str, str], ...] = MODEL) -> float:
        return during[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("pie_passes_total") >= 12
    assert moved("pie_pass_duration_seconds_count") == moved("pie_passes_total")
    assert moved("pie_decode_tokens_total") >= 10  # the generation's plain decodes, on lanes
    assert moved("pie_prefill_tokens_total") >= 40
    assert moved("pie_time_to_first_token_seconds_count") == 1  # the one launch that sampled
    assert moved("pie_time_per_output_token_seconds_count") >= 10
    assert during[("pie_http_requests_total", (("code", "4xx"),))] == 1
    assert during[("pie_inferlets_finished_total", (("status", "trapped"),))] == 1
    assert during[("pie_inferlets_finished_total", (("status", "returned"),))] == 1
    assert during[("pie_inferlets_ended_total", (("outcome", "failed"),))] == 1
    assert during[("pie_kv_pages_used", MODEL)] == 3  # 40 tokens in pages of 16
    assert during[("pie_kv_pages_shared", MODEL)] == 3  # the fork holds them too
    assert during[("pie_kv_pages_saved", MODEL)] == 3
    assert during[("pie_kv_contexts", MODEL)] == 2
    assert after[("pie_kv_contexts", MODEL)] == 0  # the requester's contexts went with it
    assert after[("pie_kv_pages_saved", MODEL)] == 3  # the snapshot outlives them
    assert during[("pie_mailbox_received_events_total", (("actor", "kv"),))] > 0
    assert ("pie_mailbox_queued_events", (("actor", "instances"),)) in during
    assert during[("pie_metrics_missed_events_total", ())] == 0


@pytest.mark.integration
async def test_health_always_answers_and_ready_follows_the_engine_state(
    tokenizer: Tokenizer, components: Path
) -> None:
    state = Probed()
    async with front(tokenizer, components, readiness=state) as (_, client):
        with trio.fail_after(30):
            health = await client.get("/health")
            starting = await client.get("/ready")
            state.state = None
            ready = await client.get("/ready")
            state.state = Unready(state="stopping", reason="the server is stopping")
            stopping = await client.get("/ready")
            posted = await client.post("/metrics")
            below = await client.get("/health/deeper")
            still = await client.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert starting.status_code == 503 and starting.json()["status"] == "starting"
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert stopping.status_code == 503 and stopping.json()["reason"] == "the server is stopping"
    assert posted.status_code == 405 and posted.headers["allow"] == "GET"
    assert below.status_code == 404
    assert still.status_code == 200


@pytest.mark.security
async def test_metrics_need_credentials_when_auth_is_on_unless_public(
    tokenizer: Tokenizer, components: Path, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("ops")
    assert token is not None
    good = {"authorization": f"Bearer ops:{token}"}
    async with front(tokenizer, components, users=users) as (_, client):
        with trio.fail_after(30):
            bare = await client.get("/metrics")
            wrong = await client.get("/metrics", headers={"authorization": "Bearer ops:nope"})
            served = await client.get("/metrics", headers=good)
            ready = await client.get("/ready")
    async with front(tokenizer, components, users=users, public=True) as (_, client):
        with trio.fail_after(30):
            public = await client.get("/metrics")
    assert bare.status_code == 401 and wrong.status_code == 401
    assert served.status_code == 200 and "pie_passes_total" in served.text
    assert ready.status_code == 200
    assert public.status_code == 200 and "pie_build_info" in public.text


@pytest.mark.integration
async def test_websocket_requests_are_counted_by_outcome(tmp_path: Path) -> None:
    async with serving(tmp_path) as server, await connect(server.url) as ws:
        metrics = EngineMetrics(server.engine, MetricsConfig(min_scrape_ms=0))
        metrics.watch_server(server)
        raw = Raw(ws)
        with trio.fail_after(30):
            await raw.next()  # the welcome
            await ws.send_message("not json")
            await raw.next()
            await raw.call(msg.QueryProgram, program="nothing-here")
            await raw.call(msg.QueryStatistics)
            scraped = samples(metrics.scrape().decode())
    requests = "pie_websocket_requests_total"
    assert scraped[(requests, (("outcome", "bad-frame"),))] == 1
    assert scraped[(requests, (("outcome", "no-such-program"),))] == 1
    assert scraped[(requests, (("outcome", "ok"),))] == 1
    assert scraped[("pie_websocket_connections", ())] == 1
    assert scraped[("pie_websocket_connections_total", ())] == 1
    assert scraped[("pie_websocket_event_frames_total", ())] == 1


@pytest.mark.integration
async def test_scrapes_closer_than_the_interval_get_the_last_text(
    tokenizer: Tokenizer, components: Path
) -> None:
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(components)})
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        held = EngineMetrics(engine, MetricsConfig(min_scrape_ms=60_000))
        fresh = EngineMetrics(engine, MetricsConfig(min_scrape_ms=0))
        first, before = held.scrape(), fresh.scrape()
        async with engine.requester() as requester:
            await requester.forward(await requester.create_context(), [1, 2, 3])
        again, after = held.scrape(), fresh.scrape()
    passes = ("pie_passes_total", MODEL)
    assert again is first
    assert samples(after.decode())[passes] == samples(before.decode())[passes] + 1


@pytest.mark.unit
def test_a_served_engine_is_ready_between_listening_and_stopping() -> None:
    server: Any = SimpleNamespace(port=0, stopping=False)
    readiness = server_readiness(server)
    starting = readiness()
    server.port = 8080
    ready = readiness()
    server.stopping = True
    stopping = readiness()
    assert starting is not None and starting.state == "starting"
    assert ready is None
    assert stopping is not None and stopping.state == "stopping"


@pytest.mark.unit
def test_first_and_per_token_latencies_follow_launches_and_contexts() -> None:
    token = (TokenOutput(token=7),)
    two = token * 2
    rows = [
        (1, 10.0, "client", "inferlets", None, _launch(corr=1)),
        (2, 10.1, "inferlets", "client", None, InferletLaunched(corr=1, instance="i1")),
        (
            3,
            10.5,
            "inference",
            "inferlet:i1",
            None,
            ForwardCompleted(corr=2, context=5, outputs=token),
        ),
        (4, 10.504, "inference", "kv", None, LanePassesApplied(passes=(_lane(5),))),
        (
            5,
            10.654,
            "inference",
            "inferlet:i1",
            None,
            ForwardCompleted(corr=3, context=5, outputs=two),
        ),
        (
            6,
            11.0,
            "inferlets",
            "inferlets",
            None,
            InferletFinished(instance="i1", status="trapped"),
        ),
    ]
    times = TokenTimes({"inference": "m"})
    times.fold(rows)
    first, per_token = times.first_token["m"], times.per_token["m"]
    assert first.count == 1 and first.sum == pytest.approx(0.5)
    assert ("0.5", 1.0) in first.cumulative() and ("0.25", 0.0) in first.cumulative()
    # 4 ms to the lane's token, then 150 ms to a delivery of two: 75 ms each.
    assert per_token.count == 3 and per_token.sum == pytest.approx(0.154)
    assert ("0.005", 1.0) in per_token.cumulative() and ("0.1", 3.0) in per_token.cumulative()
    assert times.finished == {"trapped": 1}
    times.fold([(7, 12.0, "inference", "kv", None, LanePassesApplied(passes=(_lane(5),)))])
    assert per_token.count == 3  # the context ended with its inferlet: a fresh start


@pytest.mark.unit
def test_the_log_tail_reads_each_row_once_and_counts_those_the_ring_dropped() -> None:
    log = EventLog(ring_size=3)
    tail = LogTail(log)
    for corr in range(1, 9):
        log.append("client", "inferlets", _launch(corr=corr))
    assert [row[0] for row in tail.take()] == [6, 7, 8] and tail.missed == 5
    log.append("client", "inferlets", _launch(corr=9))
    assert [row[0] for row in tail.take()] == [9] and tail.missed == 5
    assert tail.take() == []


def _launch(corr: int) -> LaunchInferlet:
    return LaunchInferlet(corr=corr, requester="client", program="p", input="")


def _lane(context: int) -> LanePassApplied:
    return LanePassApplied(
        lease=1,
        context=context,
        corr=3,
        token=1,
        position=1,
        page=0,
        staged=True,
        outputs=(TokenOutput(token=1),),
    )


@pytest.mark.integration
def test_pie_serve_metrics_port_answers_metrics_health_and_ready(
    tmp_path: Path,
    default_model_dir: Path,  # noqa: F811
) -> None:
    config = tmp_path / "pie.toml"
    config.write_text(f'[kv]\nnum_pages = 16\n[server]\nprograms_dir = "{tmp_path}/programs"\n')
    args = ["--config", str(config), "--metrics-port", "0"]
    with LocalServer.start(default_model_dir, args=args, timeout=120) as server:
        found = re.search(r"pie: metrics at (http://\S+)/metrics", server.log_tail(50))
        assert found, server.log_tail()
        with httpx.Client(base_url=found[1], timeout=30) as client:
            metrics = client.get("/metrics")
            health = client.get("/health")
            ready = client.get("/ready")
    assert metrics.status_code == 200
    assert samples(metrics.text)[("pie_kv_pages", (("model", server.model),))] == 16
    assert health.json() == {"status": "ok"} and ready.status_code == 200


@pytest.mark.integration
def test_pie_serve_refuses_a_metrics_port_beside_the_http_front(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--http", "0", "--metrics-port", "0"]) == 2
    assert "--metrics-port" in capsys.readouterr().err


@pytest.mark.integration
async def test_the_metrics_port_says_starting_while_the_model_loads(
    tmp_path: Path,
    default_model_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    real = factory.build_drivers

    def slow_load(config: EngineConfig) -> Any:
        gate.wait(60)
        return real(config)

    monkeypatch.setattr(factory, "build_drivers", slow_load)
    config = with_overrides(
        EngineConfig(),
        model={"path": str(default_model_dir)},
        kv={"num_pages": 16},
        server={"host": "127.0.0.1", "port": 0, "programs_dir": str(tmp_path / "programs")},
        metrics={"port": 0},
        sandbox={"cache_dir": str(PYTEST_CACHE / "pie-components")},
    )
    ports = bind_ports(config)
    host, port = ports.http[0].getsockname()[:2]
    served = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(serve, config, announce=lambda _: served.set(), ports=ports)
            )
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as client:
                health = await client.get("/health")
                starting = await client.get("/ready")
                metrics = await client.get("/metrics")
                gate.set()
                await served.wait()
                ready = await client.get("/ready")
            os.kill(os.getpid(), signal.SIGINT)  # `pie serve`'s graceful stop
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert starting.status_code == 503 and starting.json()["status"] == "starting"
    assert "loading its model" in starting.json()["reason"]
    assert metrics.status_code == 503 and metrics.headers["retry-after"] == "5"
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


@pytest.mark.unit
async def test_while_starting_idle_connections_past_the_bound_are_closed_and_others_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(starting, "MAX_CONNECTIONS", 1)
    listening = socket.create_server(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            loaded = await nursery.start(starting.answer_while_starting, [listening])
            idle = await trio.open_tcp_stream("127.0.0.1", port)  # sends nothing
            await trio.sleep(0.1)
            refused = await trio.open_tcp_stream("127.0.0.1", port)
            assert await refused.receive_some(1024) == b""
            await idle.aclose()  # its slot comes free once its answer is sent
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                while True:
                    try:
                        health = await client.get("/health")
                        break
                    except httpx.TransportError:
                        await trio.sleep(0.05)
            loaded()
    assert health.status_code == 200
    assert listening.fileno() != -1  # the front still has the port
    listening.close()
