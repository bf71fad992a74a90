"""A Prometheus collector that reads the engine's `statistics()` records (and the fronts') at
scrape time, on the Trio thread where they are kept: nothing on the per-token path counts for
it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
from prometheus_client.metrics_core import Metric

from pie.actors.inferlet import InferletStatistics
from pie.actors.runtime import MailboxStatistics
from pie.dataplane import PassTimes
from pie.engine import Engine
from pie.engine.stack import ModelStack
from pie.server.observe.families import Families

if TYPE_CHECKING:
    from pie.server.app import Server
    from pie.server.http import HttpFront

ENGINE_ACTORS = ("bus", "http", "mcp", "inferlets")
"""Mailboxes labelled by address besides each model's kv and inference actors; the others
(one per inferlet and per client) come and go, so they are added up instead."""


class EngineCollector:
    """Each model's passes, tokens, KV pages and speculation, the inferlets, mailboxes and
    services, and the fronts it is told of."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.fronts: list[HttpFront] = []
        self.servers: list[Server] = []
        stacks = [(m.kv_address, m.inference.address) for m in engine.models]
        self._actors = frozenset([*ENGINE_ACTORS, *(a for pair in stacks for a in pair)])

    def describe(self) -> list[Metric]:
        """Nothing to check for clashes at registration (and no scrape made to find out)."""
        return []

    def collect(self) -> Iterator[Metric]:
        out = Families()
        engine = self.engine
        for stack in engine.models:
            _model(out, stack)
        _inferlets(out, engine.inferlets.statistics())
        _services(out, engine)
        self._mailboxes(out, engine.router.statistics())
        for front in self.fronts:
            _front(out, front)
        for server in self.servers:
            _server(out, server)
        return iter(out)

    def _mailboxes(self, out: Families, mailboxes: list[MailboxStatistics]) -> None:
        grouped = {"instances": 0, "clients": 0}
        for box in mailboxes:
            if box.address in self._actors:
                out.add("pie_mailbox_queued_events", box.queued, actor=box.address)
                out.add("pie_mailbox_capacity_events", box.capacity, actor=box.address)
                out.add("pie_mailbox_received_events_total", box.received, actor=box.address)
            else:
                group = "instances" if box.address.startswith("inferlet:") else "clients"
                grouped[group] += box.queued
        for group, queued in grouped.items():
            out.add("pie_mailbox_queued_events", queued, actor=group)


def _model(out: Families, stack: ModelStack) -> None:
    name = stack.name
    inference = stack.inference.statistics()
    out.add("pie_passes_total", inference.passes, model=name)
    out.add("pie_pass_busy_seconds_total", inference.busy_seconds, model=name)
    for phase in attrs.fields(PassTimes):
        seconds = getattr(inference.pass_times, phase.name)
        out.add("pie_pass_phase_seconds_total", seconds, model=name, phase=phase.name)
    out.add("pie_prefill_tokens_total", inference.tokens - inference.lane_passes, model=name)
    out.add("pie_decode_tokens_total", inference.lane_passes, model=name)
    out.add("pie_pass_failed_requests_total", inference.failed_requests, model=name)
    pending = stack.inference.batch_statistics().pending
    out.add("pie_batch_pending_requests", pending, model=name)
    speculation = stack.lanes.statistics()
    out.add("pie_speculation_staged_total", speculation.staged, model=name)
    out.add("pie_speculation_hits_total", speculation.hits, model=name)
    out.add("pie_speculation_misses_total", speculation.misses, model=name)
    out.add("pie_speculation_wasted_passes_total", speculation.wasted_passes, model=name)
    out.add("pie_speculation_chained_passes_total", speculation.chained, model=name)
    _kv(out, stack)
    _memory(out, stack)


def _kv(out: Families, stack: ModelStack) -> None:
    name, kv = stack.name, stack.kv.statistics()
    out.add("pie_kv_pages", kv.pages_total, model=name)
    out.add("pie_kv_pages_used", kv.pages_total - kv.pages_free, model=name)
    out.add("pie_kv_pages_free", kv.pages_free, model=name)
    out.add("pie_kv_pages_cached", kv.pages_cached, model=name)
    shared, saved = _page_holders(stack)
    out.add("pie_kv_pages_shared", shared, model=name)
    out.add("pie_kv_pages_saved", saved, model=name)
    out.add("pie_kv_contexts", kv.contexts, model=name)
    out.add("pie_kv_snapshots", kv.snapshots, model=name)
    out.add("pie_kv_leases", kv.leases, model=name)
    out.add("pie_kv_prefix_hit_tokens_total", kv.prefix_hit_tokens, model=name)


def _memory(out: Families, stack: ModelStack) -> None:
    """What the driver reports of its memory (the synthetic driver reports none)."""
    report = getattr(stack.driver, "memory_bytes", None)
    if report is None:
        return
    model, used, pool, _ = report()
    out.add("pie_model_memory_bytes", model, model=stack.name)
    out.add("pie_kv_memory_used_bytes", used, model=stack.name)
    out.add("pie_kv_memory_pool_bytes", pool, model=stack.name)


def _page_holders(stack: ModelStack) -> tuple[int, int]:
    """(pages with more than one owner, pages named snapshots hold) of the model's pool."""
    core = stack.kv.core
    shared = core.pool.shared
    saved = {page for chain in core.snapshots.values() for page in chain.held()}
    return shared, len(saved)


def _inferlets(out: Families, inferlets: InferletStatistics) -> None:
    out.add("pie_inferlets", inferlets.queued, state="queued")
    out.add("pie_inferlets", inferlets.running, state="running")
    out.add("pie_inferlets_launched_total", inferlets.launched)
    out.add("pie_inferlets_ended_total", inferlets.returned, outcome="returned")
    out.add("pie_inferlets_ended_total", inferlets.failed, outcome="failed")
    out.add("pie_inferlets_ended_total", inferlets.terminated, outcome="terminated")
    out.add("pie_inferlet_launches_refused_total", inferlets.refused)


def _services(out: Families, engine: Engine) -> None:
    """The bus, outgoing HTTP, MCP and the event log."""
    bus = engine.bus.statistics()
    out.add("pie_bus_delivered_messages_total", bus.delivered)
    out.add("pie_bus_queued_messages", bus.queued_messages)
    out.add("pie_bus_queued_bytes", bus.queued_bytes)
    out.add("pie_bus_subscriptions", bus.subscriptions)
    out.add("pie_bus_waiting_pulls", bus.waiting_pulls)
    fetch = engine.http.statistics()
    out.add("pie_fetch_requests_total", fetch.requests)
    out.add("pie_fetch_failures_total", fetch.failures)
    out.add("pie_fetch_refusals_total", fetch.denied, reason="denied")
    out.add("pie_fetch_refusals_total", fetch.refused_busy, reason="busy")
    out.add("pie_fetch_received_bytes_total", fetch.bytes_received)
    mcp = engine.mcp.statistics()
    out.add("pie_mcp_calls_total", mcp.calls)
    out.add("pie_mcp_failures_total", mcp.failures)
    if engine.log is not None:
        out.add("pie_event_log_appended_events_total", engine.log.statistics().appended)


def _front(out: Families, front: HttpFront) -> None:
    stats = front.statistics()
    for status_class, count in stats.responses:
        out.add("pie_http_requests_total", count, code=status_class)
    out.add("pie_http_requests_in_flight", stats.in_flight)
    out.add("pie_http_instance_failures_total", stats.failed)


def _server(out: Families, server: Server) -> None:
    stats = server.statistics()
    out.add("pie_websocket_connections", stats.connections)
    out.add("pie_websocket_connections_total", stats.connections_accepted)
    for outcome, count in stats.replies:
        out.add("pie_websocket_requests_total", count, outcome=outcome)
    out.add("pie_websocket_event_frames_total", stats.events_sent)
