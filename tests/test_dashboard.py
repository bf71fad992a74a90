"""The live dashboard: its pure parts (the tail's filter and bounds, the page map, the event
log's listeners), then one engine on the synthetic driver behind the HTTP front with auth on
and an inferlet waiting for messages, read as JSON through httpx and as a page in a real
headless Chromium."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from attrs import define, field

from pie.actors.kv import KvCore
from pie.actors.kv.context import Chain
from pie.config import DashboardConfig, EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.eventlog import EventLog
from pie.events import inferlet as ev
from pie.events import kv as kv_ev
from pie.server.auth import UserStore
from pie.server.dashboard import Dashboard
from pie.server.dashboard.state import page_map
from pie.server.dashboard.tail import (
    MAX_DETAIL_CHARS,
    Refusal,
    TailFilter,
    TailHub,
    envelope_record,
)
from pie.server.http import HttpFront
from pie.server.mounts import Mounts
from tests.inferlet_fixtures import GUESTS, CompiledGuest, compile_guest
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)

CHROMIUM = "/usr/bin/chromium"
NUM_PAGES = 64
PAGE_SIZE = 4
GREETING = '<img src=x onerror="window.pwned = 1">hello'
"""What the inferlet first sends: shown in the tail as text, never run as HTML."""
PROBE = {"saved": 16, "shared": 12, "decode": 3, "name": "dash", "greeting": GREETING}
"""16 tokens in 4 saved pages, 12 more in 3 pages shared with a fork, the fork's decodes in
a page of its own."""


# -- the pure parts ------------------------------------------------------------------------------


def _log_with(hub: TailHub, ring_payload: int = 256) -> EventLog:
    log = EventLog(ring_size=1000, ring_payload=ring_payload)
    log.listen(hub.hear)
    return log


@pytest.mark.unit
def test_a_filter_matches_either_end_the_instance_an_event_is_about_and_a_corr() -> None:
    hub = TailHub(DashboardConfig(tail_backlog=100))
    log = _log_with(hub)
    log.append("inferlet:i1", "kv", kv_ev.CreateContext(corr=5, requester="inferlet:i1"))
    log.append("kv", "inferlet:i1", kv_ev.ContextCreated(corr=5, context=1))
    log.append("inferlets", "client:1", ev.InferletStarted(instance="i1", program="p"))
    log.append("inferlets", "client:2", ev.InferletStarted(instance="i2", program="p"))
    log.append("client:2", "kv", kv_ev.CreateContext(corr=6, requester="client:2"))

    def seqs(query: bytes) -> list[int]:
        tail = hub.open("ops", TailFilter.from_query(query))
        hub.close(tail)
        return [envelope.seq for envelope in _drain(tail)]

    assert seqs(b"") == [1, 2, 3, 4, 5]
    assert seqs(b"actor=inferlet:i1") == [1, 2, 3]
    assert seqs(b"actor=kv&corr=5") == [1, 2]
    assert seqs(b"corr=6") == [5]
    for bad in (b"corr=x", b"corr=-1", b"actor=" + b"a" * 201):
        with pytest.raises(Refusal) as refused:
            TailFilter.from_query(bad)
        assert refused.value.status == 400


@pytest.mark.unit
def test_a_tail_that_falls_behind_drops_and_counts_and_never_holds_up_the_log() -> None:
    hub = TailHub(DashboardConfig(tail_buffer=8))
    log = _log_with(hub)
    tail = hub.open("ops", TailFilter())
    for n in range(1000):  # nobody reads: a listener that waited for room would hang here
        log.append("inferlet:i1", "inferlets", ev.SessionMessage(instance="i1", text=str(n)))
    assert [e.event.text for e in _drain(tail)] == [str(n) for n in range(8)]
    assert tail.dropped == hub.statistics().dropped == 992 and len(log) == 1000


@pytest.mark.unit
def test_tails_past_a_users_or_the_total_bound_are_refused_until_one_closes() -> None:
    hub = TailHub(DashboardConfig(max_tails=3, max_tails_per_user=2))
    first, _ = hub.open("ops", TailFilter()), hub.open("ops", TailFilter())
    with pytest.raises(Refusal, match="dashboard.max_tails_per_user") as per_user:
        hub.open("ops", TailFilter())
    hub.open("ops2", TailFilter())
    with pytest.raises(Refusal, match=r"dashboard.max_tails\)") as total:
        hub.open("ops2", TailFilter())
    assert per_user.value.status == total.value.status == 429
    hub.close(first)
    assert hub.open("ops", TailFilter()).user == "ops"
    assert hub.statistics().open == 3 and hub.statistics().refused == 2


@pytest.mark.unit
def test_the_event_log_stops_telling_a_listener_that_stopped_or_failed() -> None:
    log = EventLog(ring_size=10)
    heard: list[Any] = []
    stop = log.listen(heard.append)

    def broken(row: Any) -> None:
        raise RuntimeError("listener bug")

    log.listen(broken)
    log.append("a", "b", kv_ev.Done(corr=1))
    stop()
    log.append("a", "b", kv_ev.Done(corr=2))
    assert [row[0] for row in heard] == [1] and len(log) == 2


@pytest.mark.unit
def test_an_event_is_shown_as_its_type_and_fields_cut_short() -> None:
    hub = TailHub(DashboardConfig())
    log = _log_with(hub, ring_payload=0)  # the whole event: the tail cuts it
    log.append("inferlet:i1", "inferlets", ev.SessionMessage(instance="i1", text="x" * 5000))
    record = envelope_record(next(iter(_drain(hub.open("ops", TailFilter())))))
    assert record["kind"] == "SessionMessage" and record["instance"] == "i1"
    assert len(record["detail"]) == MAX_DETAIL_CHARS and record["detail"].endswith("...")


@pytest.mark.unit
def test_the_page_map_marks_saved_shared_used_cached_and_free_pages() -> None:
    kv = KvCore(num_pages=8, page_size=PAGE_SIZE, vocab_size=10)
    pool = kv.pool
    held = pool.allocate(4)
    pool.share([held[1]])
    kv.snapshots[("alice", "s")] = Chain(owner="", pages=[held[2]])
    [cached] = pool.allocate(1)
    pool.commit(cached, b"content")
    pool.release([cached])
    assert page_map(kv) == "usvucfff"


def _drain(tail: Any) -> list[Any]:
    out = []
    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel):
        while True:
            out.append(tail.receive.receive_nowait())
    return out


@pytest.mark.integration
async def test_without_auth_the_data_needs_no_token_and_with_the_log_off_there_is_no_tail(
    tokenizer: Tokenizer,
) -> None:
    config = with_overrides(EngineConfig(), event_log={"enabled": False}, http={"port": 0})
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size, num_pages=NUM_PAGES)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        routes = Dashboard(engine, config.dashboard).routes()
        front = HttpFront(engine, config.http, Mounts({}), host="127.0.0.1", routes=routes)
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            async with httpx.AsyncClient(base_url=front.url, timeout=10) as client:
                with trio.fail_after(10):
                    state = await client.get("/dashboard/state")
                    tail = await client.get("/dashboard/events")
            front.stop()
            nursery.cancel_scope.cancel()
    assert state.status_code == 200 and state.json()["models"][0]["pages"] == "f" * NUM_PAGES
    assert tail.status_code == 404 and "event_log.enabled" in tail.json()["error"]["message"]


# -- a live engine -------------------------------------------------------------------------------


@define
class Live:
    """The engine and front running on a thread of their own (`portal` runs code there)."""

    url: str
    tokens: dict[str, str]
    instance: str
    dashboard: Dashboard
    users: UserStore
    trio_token: Any
    send: Callable[[str], Any]
    heard: list[str] = field(factory=list)
    """What the inferlet sent its client."""

    def portal(self, fn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.trio_token)

    def tell(self, text: str) -> None:
        trio.from_thread.run(self.send, text, trio_token=self.trio_token)

    def auth(self, user: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tokens[user]}"}

    def wait(self, what: Callable[[], bool], seconds: float = 10) -> None:
        deadline = time.monotonic() + seconds
        while not self.portal(what):
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def probe(
    built: Callable[[Path], Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> CompiledGuest:
    return compile_guest(built, tmp_path_factory, GUESTS / "dashboard_probe")


@pytest.fixture(scope="module")
def live(
    probe: CompiledGuest, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    users = UserStore(tmp_path_factory.mktemp("users"))
    tokens = {name: f"{name}:{users.add(name)}" for name in ("ops", "ops2", "ops3", "alice")}
    started: queue.Queue[Live | BaseException] = queue.Queue()
    stop = trio.Event()

    def main() -> None:
        try:
            trio.run(_serve, probe, tokenizer, users, tokens, started, stop)
        except BaseException as exc:  # the test thread must hear of it, not hang
            started.put(exc)

    thread = threading.Thread(target=main, name="dashboard-engine", daemon=True)
    thread.start()
    running = started.get(timeout=120)
    if isinstance(running, BaseException):
        raise running
    yield running
    running.portal(stop.set)
    thread.join(60)
    assert not thread.is_alive()


async def _serve(
    probe: CompiledGuest,
    tokenizer: Tokenizer,
    users: UserStore,
    tokens: dict[str, str],
    started: queue.Queue[Live | BaseException],
    stop: trio.Event,
) -> None:
    config = with_overrides(
        EngineConfig(),
        sandbox={"cache_dir": str(probe.components)},
        http={"port": 0},
        dashboard={
            "operators": ("ops", "ops2", "ops3"),
            "max_tails": 3,
            "max_tails_per_user": 2,
            "tail_backlog": 2048,
            "refresh_seconds": 0.05,
        },
    )
    driver = SyntheticDriver(
        vocab_size=tokenizer.vocab_size, num_pages=NUM_PAGES, page_size=PAGE_SIZE
    )
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        dashboard = Dashboard(engine, config.dashboard, users=users, credential_check_seconds=0.2)
        routes = dashboard.routes()
        front = HttpFront(
            engine, config.http, Mounts({}), host="127.0.0.1", users=users, routes=routes
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(front.run)
            async with engine.requester("test-client") as requester:
                program = engine.programs.add(probe.wasm, name="dashboard-probe").hash
                run = await requester.launch(program, json.dumps(PROBE), user="alice")
                live = Live(
                    url=front.url,
                    tokens=tokens,
                    instance=run.instance,
                    dashboard=dashboard,
                    users=users,
                    trio_token=trio.lowlevel.current_trio_token(),
                    send=run.send,
                )
                nursery.start_soon(_listen, run, live, started)
                await stop.wait()
            dashboard.close()
            front.stop()
            nursery.cancel_scope.cancel()


async def _listen(run: Any, live: Live, started: queue.Queue[Live | BaseException]) -> None:
    """Keeps what the inferlet sends; the fixture starts the tests once it has greeted."""
    async for event in run.stream():
        if isinstance(event, ev.SessionMessage) and event.text is not None:
            live.heard.append(event.text)
            if len(live.heard) == 1:
                started.put(live)
        elif isinstance(event, ev.InferletEnd) and not live.heard:
            started.put(RuntimeError(f"the probe ended before it greeted: {event}"))


def _client(live: Live) -> httpx.Client:
    return httpx.Client(base_url=live.url, timeout=10)


def _records(reply: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in reply.iter_lines():
        if line:
            yield json.loads(line)


def _until_status(records: Iterator[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events a tail sends before its first status line (with the first chunk: its
    backlog)."""
    events = []
    for record in records:
        if record["type"] == "status":
            return events
        events.append(record)
    raise AssertionError("the tail ended before its status line")


@pytest.mark.integration
def test_the_state_shows_the_waiting_inferlet_its_pages_passes_and_mailboxes(live: Live) -> None:
    with _client(live) as client:
        state = client.get("/dashboard/state", headers=live.auth("ops")).json()
    [row] = [i for i in state["inferlets"] if i["id"] == live.instance]
    assert row["state"] == "running" and row["user"] == "alice"
    assert row["program"].startswith("dashboard-probe@") and row["contexts"] == 2
    written = PROBE["saved"] + PROBE["shared"]
    assert 2 * written + PROBE["decode"] - 1 <= row["tokens"] <= 2 * written + PROBE["decode"]
    [model] = state["models"]
    counts = model["page_counts"]
    assert len(model["pages"]) == NUM_PAGES == sum(counts.values())
    assert counts["saved"] == PROBE["saved"] // PAGE_SIZE
    assert counts["shared"] == PROBE["shared"] // PAGE_SIZE and counts["used"] >= 1
    passes = model["passes"]
    assert passes and sum(p["tokens"] for p in passes) >= written + PROBE["decode"] - 1
    assert [p["number"] for p in passes] == sorted(p["number"] for p in passes)
    boxes = {m["address"] for m in state["statistics"]["mailboxes"]}
    assert {"kv", "inference", "inferlets", f"inferlet:{live.instance}"} <= boxes


@pytest.mark.integration
def test_the_tail_shows_an_inferlets_events_as_they_happen_filtered_by_actor_or_corr(
    live: Live,
) -> None:
    actor = f"inferlet:{live.instance}"
    ops = live.auth("ops")
    with _client(live) as client:
        with client.stream("GET", "/dashboard/events", params={"actor": actor}, headers=ops) as r:
            assert r.headers["content-type"] == "application/x-ndjson"
            records = _records(r)
            backlog = _until_status(records)
            live.tell("ping")
            fresh = []
            for record in records:
                fresh.append(record)
                if record.get("kind") == "SessionMessage" and "echo:ping" in record["detail"]:
                    break
        corr = next(e["corr"] for e in backlog if e["kind"] == "CreateContext")
        with client.stream("GET", "/dashboard/events", params={"corr": corr}, headers=ops) as r:
            by_corr = _until_status(_records(r))
    kinds = {e["kind"] for e in backlog}
    assert {"CreateContext", "SaveContext", "ForkContext", "SessionMessage"} <= kinds
    fresh_events = [e for e in fresh if e["type"] == "event"]
    assert {"SessionInput", "SessionMessage"} <= {e["kind"] for e in fresh_events}
    for event in backlog + fresh_events:
        assert actor in (event["src"], event["dst"]) or event["instance"] == live.instance
    assert [e["seq"] for e in backlog] == sorted(e["seq"] for e in backlog)
    assert len(by_corr) == 2 and {e["corr"] for e in by_corr} == {corr}  # the call, its reply


@pytest.mark.security
def test_only_operators_read_the_data_while_the_page_itself_is_public(live: Live) -> None:
    with _client(live) as client:
        page = client.get("/dashboard")
        script = client.get("/dashboard/dashboard.js")
        anonymous = client.get("/dashboard/state")
        wrong = client.get("/dashboard/state", headers={"authorization": "Bearer ops:nope"})
        alice_state = client.get("/dashboard/state", headers=live.auth("alice"))
        alice_tail = client.get("/dashboard/events", headers=live.auth("alice"))
        bad_corr = client.get("/dashboard/events?corr=x", headers=live.auth("ops"))
        posted = client.post("/dashboard/state", headers=live.auth("ops"))
        missing = client.get("/dashboard/nothing.js")
        served = client.get("/dashboard/state", headers=live.auth("ops"))
    assert page.status_code == 200 and "<title>pie dashboard</title>" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/java")
    assert anonymous.status_code == wrong.status_code == 401
    assert alice_state.status_code == alice_tail.status_code == 403
    assert "dashboard.operators" in alice_state.json()["error"]["message"]
    assert bad_corr.status_code == 400 and "corr" in bad_corr.json()["error"]["message"]
    assert posted.status_code == 405 and missing.status_code == 404
    assert served.status_code == 200 and served.json()["inferlets"]


@pytest.mark.security
def test_tails_past_the_bounds_get_429_and_an_operator_is_served_after(live: Live) -> None:
    hub = live.dashboard.hub
    live.wait(lambda: hub.statistics().open == 0)
    with _client(live) as client, contextlib.ExitStack() as held:

        def tail(user: str) -> httpx.Response:
            reply = client.stream("GET", "/dashboard/events", headers=live.auth(user))
            return held.enter_context(reply)

        first, second = tail("ops"), tail("ops")
        third = tail("ops")
        other = tail("ops2")
        over_total = tail("ops2")
        assert (first.status_code, second.status_code, other.status_code) == (200, 200, 200)
        assert third.status_code == over_total.status_code == 429
        assert "dashboard.max_tails_per_user" in json.loads(third.read())["error"]["message"]
        assert "dashboard.max_tails)" in json.loads(over_total.read())["error"]["message"]
        first.close()
        live.wait(lambda: hub.statistics().open == 2)
        again = tail("ops2")
        assert again.status_code == 200 and _until_status(_records(again)) is not None
        state = client.get("/dashboard/state", headers=live.auth("ops"))
    assert state.status_code == 200 and state.json()["tails"]["refused"] >= 2


@pytest.mark.security
def test_a_tail_ends_when_its_token_is_replaced(live: Live) -> None:
    hub = live.dashboard.hub
    live.wait(lambda: hub.statistics().open == 0)
    with _client(live) as client:
        with client.stream("GET", "/dashboard/events", headers=live.auth("ops3")) as reply:
            records = _records(reply)
            _until_status(records)
            live.tokens["ops3"] = f"ops3:{live.users.add('ops3')}"
            started = time.monotonic()
            for _ in records:
                assert time.monotonic() - started < 10
        fresh = client.get("/dashboard/state", headers=live.auth("ops3"))
    assert fresh.status_code == 200


@pytest.mark.integration
def test_the_page_in_a_browser_signs_in_and_shows_the_engine_live(
    live: Live, tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    actor = f"inferlet:{live.instance}"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            failures: list[str] = []
            page.on("pageerror", lambda error: failures.append(str(error)))
            page.goto(f"{live.url}/dashboard")
            page.fill("#token", live.tokens["ops"])
            page.click("#sign-in")
            row = page.locator("#inferlets tbody tr", has_text=live.instance)
            expect(row).to_contain_text("running")
            expect(row).to_contain_text("alice")
            assert int(row.locator("td").nth(5).inner_text()) >= PROBE["saved"] + PROBE["shared"]
            saved = page.locator('#kv .legend [data-kind="saved"]')
            expect(saved).to_have_attribute("data-count", str(PROBE["saved"] // PAGE_SIZE))
            expect(page.locator("#kv canvas")).to_have_attribute("data-pages", str(NUM_PAGES))
            expect(page.locator("#timeline rect").first).to_be_attached()
            row.click()
            expect(page.locator("#actor")).to_have_value(actor)
            # The greeting, to the inferlets actor and on to the client: as text, not HTML.
            expect(page.locator("#tail tbody tr", has_text="<img src=x")).to_have_count(2)
            live.tell("from-the-browser-test")
            # The guest's message to the inferlets actor, and from there to its client.
            echoes = page.locator("#tail tbody tr", has_text="echo:from-the-browser-test")
            expect(echoes).to_have_count(2)
            rows = page.locator("#tail tbody tr").all_inner_texts()
            assert rows and all(live.instance in text for text in rows)
            assert page.locator("#tail img").count() == 0
            assert page.evaluate("window.pwned") is None and not failures
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
