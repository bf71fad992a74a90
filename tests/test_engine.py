"""The whole engine on the synthetic driver (token t predicts t + 1): concurrent decoding,
failures that stay with their request, chunked prompts, and the event log and its replay."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pie.actors.generate import generate
from pie.actors.kv import KvCore
from pie.actors.requester import Requester, RequestRefused
from pie.actors.runtime import MailboxOverrun, Router
from pie.config import EngineConfig, with_overrides
from pie.dataplane import PassSummary
from pie.drivers.base import DriverError
from pie.drivers.batch import ForwardBatch
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import Engine, open_engine
from pie.eventlog import EventLog, read_log
from pie.eventlog.replay import replay
from pie.events import batching, kv
from pie.events.sampling import (
    Argmax,
    Distribution,
    DistributionOutput,
    SamplingSlot,
    SlotOutput,
    TokenOutput,
)

GREEDY = (SamplingSlot(index=0, op=Argmax()),)


def greedy_at(index: int) -> tuple[SamplingSlot, ...]:
    return (SamplingSlot(index=index, op=Argmax()),)


def tokens(outputs: tuple[SlotOutput, ...]) -> list[int]:
    return [o.token for o in outputs if isinstance(o, TokenOutput)]


async def decode(r: Requester, prompt: list[int], steps: int) -> list[int]:
    """Greedy generation: the prompt in one pass, then one token per pass."""
    context = await r.create_context()
    out = tokens(await r.forward(context, prompt, greedy_at(len(prompt) - 1)))
    for _ in range(steps - 1):
        out += tokens(await r.forward(context, out[-1:], GREEDY))
    return out


def fresh_kv(engine: Engine) -> KvCore:
    info = engine.info
    return KvCore(num_pages=info.num_pages, page_size=info.page_size, vocab_size=info.vocab_size)


@pytest.mark.integration
async def test_concurrent_requesters_get_correct_tokens_from_shared_batches() -> None:
    results: dict[int, list[int]] = {}
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver(pass_seconds=0.005)) as engine:

            async def one(start: int) -> None:
                async with engine.requester() as r:
                    results[start] = await decode(r, [start, start + 1, start + 2], 8)

            async with trio.open_nursery() as nursery:
                for i in range(16):
                    nursery.start_soon(one, 50 * i)
            stats = engine.statistics()
    assert results == {50 * i: list(range(50 * i + 3, 50 * i + 11)) for i in range(16)}
    assert stats.scheduler.max_batch_size > 1 and stats.scheduler.mean_batch_size > 1
    assert stats.inference.passes < 16 * 8


@pytest.mark.integration
async def test_running_out_of_pages_refuses_one_requester_and_not_another() -> None:
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver(num_pages=4)) as engine:
            async with engine.requester() as greedy, engine.requester() as modest:
                big = await greedy.create_context()
                with pytest.raises(RequestRefused) as refused:
                    await greedy.forward(big, list(range(100)), GREEDY)
                assert refused.value.kind == "too_large"
                await greedy.forward(big, list(range(16)), greedy_at(15))
                with pytest.raises(RequestRefused) as refused:
                    await greedy.forward(await greedy.create_context(), list(range(32)), GREEDY)
                assert refused.value.kind == "out_of_pages"
                assert await decode(modest, [7, 8], 5) == [9, 10, 11, 12, 13]
                assert tokens(await greedy.forward(big, [1, 2], greedy_at(1))) == [3]
                assert engine.kv.core.quotas.inferlet == 2


class PoisonDriver(SyntheticDriver):
    """Refuses any batch holding the poison token; the first batch waits for `gate`."""

    def __init__(self, poison: int, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.poison = poison
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.attempts: list[int] = []

    def forward(self, batch: ForwardBatch) -> list[SlotOutput]:
        if not self.attempts:
            self.entered.set()
            self.gate.wait(5)
        self.attempts.append(batch.num_requests)
        if self.poison in batch.token_ids:
            raise DriverError(f"token {self.poison} is not allowed")
        return super().forward(batch)


@pytest.mark.integration
async def test_a_request_the_driver_refuses_fails_alone_in_its_batch() -> None:
    driver = PoisonDriver(poison=666)
    outcomes: dict[int, object] = {}
    with trio.fail_after(10):
        async with open_engine(driver=driver) as engine:

            async def one(first: int) -> None:
                async with engine.requester() as r:
                    context = await r.create_context()
                    try:
                        outcomes[first] = tokens(await r.forward(context, [first, 5], greedy_at(1)))
                    except RequestRefused as err:
                        outcomes[first] = err
                        outcomes[-1] = (await r.describe(context)).tokens

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 1)
                await trio.to_thread.run_sync(driver.entered.wait, 5)
                for first in (2, 666, 3, 4):
                    nursery.start_soon(one, first)
                await trio.testing.wait_all_tasks_blocked()
                driver.gate.set()
            stats = engine.statistics()
    assert driver.attempts[:2] == [1, 4]
    assert outcomes[1] == outcomes[2] == outcomes[3] == outcomes[4] == [6]
    failed = outcomes[666]
    assert isinstance(failed, RequestRefused)
    assert failed.kind == "invalid" and "666" in failed.message
    assert outcomes[-1] == ()
    assert stats.inference.failed_requests == 1
    assert stats.kv.pages_free == stats.kv.pages_total


@pytest.mark.integration
async def test_closing_a_requester_destroys_its_contexts() -> None:
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver(page_size=4)) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                await r.forward(context, list(range(10)))
                await r.fork(context)
                busy = engine.statistics().kv
                assert (busy.contexts, busy.pages_total - busy.pages_free) == (2, 3)
            idle = engine.statistics().kv
    assert idle.contexts == 0 and idle.pages_free == idle.pages_total


@pytest.mark.integration
async def test_decoding_within_a_reservation_allocates_no_pages() -> None:
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver(page_size=4)) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                await r.reserve(context, 12)
                reserved = await r.describe(context)
                free = engine.statistics().kv.pages_free
                out = tokens(await r.forward(context, [1, 2, 3], greedy_at(2)))
                for _ in range(8):
                    out += tokens(await r.forward(context, out[-1:], GREEDY))
                    assert engine.statistics().kv.pages_free == free
                info = await r.describe(context)
    assert (reserved.pages, reserved.reserved_pages) == (0, 3)
    assert out == list(range(4, 13))
    assert (info.pages, info.reserved_pages) == (3, 0)


@pytest.mark.integration
async def test_generation_goes_on_when_its_reservation_is_refused() -> None:
    with trio.fail_after(10):
        whole_pool = with_overrides(
            EngineConfig(), kv={"inferlet_page_share": 1.0, "user_page_share": 1.0}
        )
        driver = SyntheticDriver(page_size=4, num_pages=2)
        async with open_engine(whole_pool, driver=driver) as engine:
            async with engine.requester() as r:
                done = await generate(
                    r, [1, 2, 3], max_tokens=20, sampler=Argmax(), stop_tokens=[6]
                )
            stats = engine.statistics().kv
    assert (done.tokens, done.stop_reason) == ((4, 5, 6), "stop")
    assert stats.pages_free == stats.pages_total


@pytest.mark.integration
async def test_a_prompt_longer_than_the_token_budget_is_chunked_and_still_right() -> None:
    driver = SyntheticDriver(page_size=4)
    config = with_overrides(EngineConfig(), scheduler={"max_batch_tokens": 8})
    prompt = list(range(100, 130))
    slots = (
        SamplingSlot(index=29, op=Argmax()),
        SamplingSlot(index=0, op=Distribution(k=1)),
        SamplingSlot(index=9, op=Argmax()),
    )
    with trio.fail_after(10):
        async with open_engine(config, driver=driver) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                outputs = await r.forward(context, prompt, slots)
                info = await r.describe(context)
                after = tokens(await r.forward(context, [7], GREEDY))
            stats = engine.statistics()
    assert outputs == (
        TokenOutput(token=130),
        DistributionOutput(tokens=(101,), probs=(1.0,)),
        TokenOutput(token=110),
    )
    assert info.tokens == tuple(prompt) and info.positions == tuple(range(30))
    assert after == [8]
    assert stats.scheduler.chunks == 3
    assert max(b.num_tokens for b in driver.batches) == 8
    assert [b.kv_lens for b in driver.batches[:4]] == [[8], [16], [24], [30]]


@pytest.mark.integration
async def test_pass_observers_hear_of_every_pass_and_its_requests() -> None:
    heard: list[PassSummary] = []
    driver = SyntheticDriver(page_size=4)
    config = with_overrides(EngineConfig(), scheduler={"max_batch_tokens": 8})
    with trio.fail_after(10):
        async with open_engine(config, driver=driver) as engine:
            engine.inference.observe_passes(heard.append)
            async with engine.requester() as r:
                context = await r.create_context()
                await r.forward(context, list(range(100, 120)), greedy_at(19))
                await r.forward(context, [7], GREEDY)
            stats = engine.statistics()
    assert [s.number for s in heard] == list(range(1, stats.inference.passes + 1))
    assert [s.tokens for s in heard] == [b.num_tokens for b in driver.batches] == [8, 8, 4, 1]
    assert len({s.corrs for s in heard[:3]}) == 1 and heard[3].corrs != heard[0].corrs
    assert all(s.requests == 1 and s.failed == 0 and s.seconds >= 0 for s in heard)
    assert heard == sorted(heard, key=lambda s: s.ended)


@pytest.mark.integration
async def test_the_event_log_records_each_delivery_with_its_correlation() -> None:
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver()) as engine:
            async with engine.requester("alice") as r:
                context = await r.create_context()
                await r.forward(context, [1, 2], greedy_at(1))
            assert engine.log is not None
            records = engine.log.records()
    submit = next(e for e in records if isinstance(e.event, kv.SubmitForward))
    path = [(e.src, e.dst, type(e.event).__name__) for e in records if e.corr == submit.corr]
    assert path == [
        ("alice", "kv", "SubmitForward"),
        ("kv", "inference", "ScheduleForward"),
        ("inference", "kv", "PassApplied"),
        ("inference", "alice", "ForwardCompleted"),
    ]
    assert [e.seq for e in records] == list(range(1, len(records) + 1))
    assert isinstance(records[0].event, batching.EngineStarted)


async def busy_day(engine: Engine) -> None:
    """A mix of everything the kv actor does, including refusals and a failed pass."""
    async with engine.requester() as r, engine.requester() as other:
        context = await r.create_context()
        await r.forward(context, list(range(10)), greedy_at(9))
        fork = await r.fork(context)
        await r.forward(fork, [1, 2, 3], GREEDY)
        await r.save(fork, "draft")
        opened = await other.open("draft")
        await other.truncate(opened, 5)
        await other.mask_pages(opened, (0,))
        await other.forward(opened, [4, 4, 4], GREEDY)
        with pytest.raises(RequestRefused):
            await other.forward(opened, [10**6])
        with pytest.raises(RequestRefused):
            await r.forward(context, [666])
        with pytest.raises(RequestRefused):
            await other.destroy(context)
        taken = await r.open("draft", take=True)
        await r.destroy(taken)
        await decode(other, [1, 2, 3, 4], 3)


@pytest.mark.integration
async def test_replaying_the_kv_actors_inputs_is_exact() -> None:
    driver = PoisonDriver(poison=666, page_size=4)
    driver.gate.set()
    with trio.fail_after(10):
        async with open_engine(driver=driver) as engine:
            await busy_day(engine)
            assert engine.log is not None
            core = fresh_kv(engine)
            result = replay(engine.log.records(), "kv", core)
            live = engine.kv.core.state()
    assert result.exact, result.mismatches
    assert result.inputs >= 20 and result.outputs >= 15
    assert core.state() == live


@pytest.mark.integration
async def test_replaying_the_json_lines_file_after_close_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    # The ring keeps every field whole here, so that it can be compared with the file.
    log = {"path": str(path), "ring_payload_chars": 0}
    config = with_overrides(EngineConfig(), event_log=log)
    driver = PoisonDriver(poison=666, page_size=4)
    driver.gate.set()
    with trio.fail_after(10):
        async with open_engine(config, driver=driver) as engine:
            await busy_day(engine)
    assert engine.log is not None
    in_memory = engine.log.records()  # the last former steps are recorded as the engine stops
    on_disk = list(read_log(path))
    assert [e.seq for e in on_disk] == [e.seq for e in in_memory]
    assert [e.event for e in on_disk] == [e.event for e in in_memory]
    core = fresh_kv(engine)
    result = replay(on_disk, "kv", core)
    assert result.exact, result.mismatches
    assert core.state() == engine.kv.core.state()


@pytest.mark.integration
async def test_replaying_reservations_and_a_pass_rolled_back_into_one_is_exact() -> None:
    driver = PoisonDriver(poison=666, page_size=4)
    driver.gate.set()
    with trio.fail_after(10):
        async with open_engine(driver=driver) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                await r.reserve(context, 10)
                with pytest.raises(RequestRefused):
                    await r.forward(context, [1, 2, 3, 4, 5, 666])
                await decode(r, [1, 2], 4)
                with pytest.raises(RequestRefused):
                    await r.reserve(context, 10**9)
                assert engine.log is not None
                core = fresh_kv(engine)
                result = replay(engine.log.records(), "kv", core)
                live = engine.kv.core.state()
    assert result.exact, result.mismatches
    assert core.state() == live


@pytest.mark.integration
async def test_a_command_cancelled_before_it_is_sent_leaves_no_record() -> None:
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver()) as engine:
            async with engine.requester() as r:
                with trio.CancelScope() as scope:
                    scope.cancel()
                    await r.create_context()
                context = await r.create_context()
                await r.forward(context, [1, 2])
            assert engine.log is not None
            records = engine.log.records()
            core = fresh_kv(engine)
            result = replay(records, "kv", core)
            assert result.exact, result.mismatches
            assert core.state() == engine.kv.core.state()
    assert sum(isinstance(e.event, kv.CreateContext) for e in records) == 1


@pytest.mark.integration
async def test_a_chunked_prompt_refused_in_a_later_chunk_fails_once_and_rolls_back() -> None:
    driver = PoisonDriver(poison=666, page_size=4)
    driver.gate.set()
    config = with_overrides(EngineConfig(), scheduler={"max_batch_tokens": 4})
    with trio.fail_after(10):
        async with open_engine(config, driver=driver) as engine:
            async with engine.requester() as r:
                context = await r.create_context()
                with pytest.raises(RequestRefused, match="666"):
                    await r.forward(context, [1, 2, 3, 4, 5, 666, 7, 8, 9, 10], greedy_at(9))
                assert (await r.describe(context)).tokens == ()
                assert tokens(await r.forward(context, [20, 21], greedy_at(1))) == [22]
            stats = engine.statistics()
    assert stats.inference.failed_requests == 1
    assert all(666 not in b.token_ids and 9 not in b.token_ids for b in driver.batches)
    assert stats.kv.pages_free == stats.kv.pages_total


@pytest.mark.unit
async def test_an_event_that_cannot_be_delivered_is_not_logged() -> None:
    log = EventLog()
    router = Router(log)
    router.register("small", kv.Done, capacity=1)
    assert router.send_nowait("a", "small", kv.Done(corr=1))
    with pytest.raises(MailboxOverrun):
        router.send_nowait("a", "small", kv.Done(corr=2))
    router.unregister("small")
    assert not router.send_nowait("a", "small", kv.Done(corr=3))
    assert [e.corr for e in log.records()] == [1]


@pytest.mark.unit
def test_reading_a_log_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    log.append("a", "kv", kv.CreateContext(corr=1, requester="a"))
    log.append("kv", "a", kv.ContextCreated(corr=1, context=1))
    log.close()
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"seq":3,"time":1.0,"src":"a","dst"')
    assert [e.event for e in read_log(path)] == [e.event for e in log.records()]


@pytest.mark.unit
def test_reading_a_log_refuses_a_bad_line_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path=path)
    log.append("a", "kv", kv.CreateContext(corr=1, requester="a"))
    log.close()
    text = path.read_text(encoding="utf-8")
    path.write_text('{"seq":0,"tim\n' + text, encoding="utf-8")
    with pytest.raises(ValueError, match="line 1"):
        list(read_log(path))


@pytest.mark.unit
def test_a_new_log_file_replaces_the_previous_run(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    for corr in (1, 2):
        log = EventLog(path=path)
        log.append("a", "kv", kv.CreateContext(corr=corr, requester="a"))
        log.close()
    assert [e.corr for e in read_log(path)] == [2]


@pytest.mark.integration
async def test_requesters_talk_through_queues_and_topics() -> None:
    with trio.fail_after(10):
        async with open_engine(driver=SyntheticDriver()) as engine:
            async with engine.requester() as alice, engine.requester() as bob:
                heard: list[Any] = []
                await bob.subscribe("news", heard.append)
                # More than any buffer between the bus and a subscriber held: none is dropped.
                texts = [f"item {i}" for i in range(3000)]
                for text in texts:
                    await alice.publish("news", text)
                await trio.testing.wait_all_tasks_blocked()
                assert [(m.sender, m.message) for m in heard] == [(alice.address, t) for t in texts]
                async with trio.open_nursery() as nursery:
                    pulled: list[str] = []

                    async def pull() -> None:
                        pulled.append(await bob.pull("jobs"))

                    nursery.start_soon(pull)
                    await trio.testing.wait_all_tasks_blocked()
                    await alice.push("jobs", "job-1")
                assert pulled == ["job-1"]
