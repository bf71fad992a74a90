"""The metrics read from the engine's statistics records at scrape time: their names, types
and meanings in one table, and a builder that turns one scrape's values into families."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

GAUGE, COUNTER = "gauge", "counter"

READ_AT_SCRAPE: dict[str, tuple[str, str]] = {
    "pie_passes_total": (COUNTER, "Forward passes run."),
    "pie_pass_busy_seconds_total": (COUNTER, "Seconds the driver spent in forward passes."),
    "pie_pass_phase_seconds_total": (
        COUNTER,
        "Seconds the pass loop spent in each phase of its passes (form, assemble, forward, "
        "complete, settle).",
    ),
    "pie_prefill_tokens_total": (
        COUNTER,
        "Tokens of placed requests run: prompts, their chunks and passes off the fast path.",
    ),
    "pie_decode_tokens_total": (COUNTER, "Tokens decoded on the fast path (lane passes)."),
    "pie_pass_failed_requests_total": (COUNTER, "Placed requests a pass failed."),
    "pie_batch_pending_requests": (GAUGE, "Placed requests waiting for a pass."),
    "pie_kv_pages": (GAUGE, "KV pages in the pool."),
    "pie_kv_pages_used": (GAUGE, "KV pages a context, snapshot or pass holds."),
    "pie_kv_pages_free": (GAUGE, "KV pages an allocation may take (empty or cached)."),
    "pie_kv_pages_cached": (GAUGE, "Free KV pages that keep committed content for reuse."),
    "pie_kv_pages_shared": (GAUGE, "KV pages held by more than one context or snapshot."),
    "pie_kv_pages_saved": (GAUGE, "KV pages named snapshots hold."),
    "pie_kv_contexts": (GAUGE, "Live contexts."),
    "pie_kv_snapshots": (GAUGE, "Named snapshots."),
    "pie_kv_leases": (GAUGE, "Contexts leased to the fast path."),
    "pie_kv_prefix_hit_tokens_total": (
        COUNTER,
        "Tokens never run because their committed pages were reused.",
    ),
    "pie_speculation_staged_total": (COUNTER, "Passes staged ahead of their program's request."),
    "pie_speculation_hits_total": (COUNTER, "Requests served from a staged pass."),
    "pie_speculation_misses_total": (COUNTER, "Requests that found another pass staged."),
    "pie_speculation_wasted_passes_total": (COUNTER, "Staged passes that ran and went unused."),
    "pie_speculation_chained_passes_total": (
        COUNTER,
        "Staged passes launched on the device behind the pass whose token they read.",
    ),
    "pie_inferlets": (GAUGE, "Inferlets by state (queued, running)."),
    "pie_inferlets_launched_total": (COUNTER, "Inferlets launched (admitted or queued)."),
    "pie_inferlets_ended_total": (
        COUNTER,
        "Inferlets ended, by outcome (returned, failed, terminated).",
    ),
    "pie_inferlet_launches_refused_total": (
        COUNTER,
        "Launches refused for being over a limit (too_many_inferlets).",
    ),
    "pie_mailbox_queued_events": (
        GAUGE,
        "Events waiting in actors' mailboxes; all inferlets' together as actor=instances, and "
        "all clients' as actor=clients.",
    ),
    "pie_mailbox_capacity_events": (GAUGE, "Events an engine actor's mailbox holds at most."),
    "pie_mailbox_received_events_total": (COUNTER, "Events delivered to an engine actor."),
    "pie_bus_delivered_messages_total": (COUNTER, "Messages the bus delivered."),
    "pie_bus_queued_messages": (GAUGE, "Messages waiting on bus queues."),
    "pie_bus_queued_bytes": (GAUGE, "Bytes of messages waiting on bus queues."),
    "pie_bus_subscriptions": (GAUGE, "Subscriptions to bus topics."),
    "pie_bus_waiting_pulls": (GAUGE, "Pulls waiting for a message."),
    "pie_fetch_requests_total": (COUNTER, "Outgoing HTTP requests inferlets made."),
    "pie_fetch_failures_total": (COUNTER, "Outgoing HTTP requests that failed."),
    "pie_fetch_refusals_total": (
        COUNTER,
        "Outgoing HTTP requests refused, by reason (denied by the network policy, busy).",
    ),
    "pie_fetch_received_bytes_total": (COUNTER, "Bytes of outgoing requests' responses."),
    "pie_mcp_calls_total": (COUNTER, "MCP tool calls."),
    "pie_mcp_failures_total": (COUNTER, "MCP listings and calls that failed."),
    "pie_event_log_appended_events_total": (COUNTER, "Events appended to the event log."),
    "pie_model_memory_bytes": (GAUGE, "Memory the model's weights take."),
    "pie_kv_memory_used_bytes": (GAUGE, "Memory the KV pages in use take."),
    "pie_kv_memory_pool_bytes": (GAUGE, "Memory of the whole KV pool."),
    "pie_http_requests_total": (COUNTER, "HTTP requests answered, by status class (2xx...)."),
    "pie_http_requests_in_flight": (GAUGE, "HTTP requests being served."),
    "pie_http_instance_failures_total": (
        COUNTER,
        "HTTP-served instances that failed or were terminated.",
    ),
    "pie_websocket_connections": (GAUGE, "Open WebSocket connections."),
    "pie_websocket_connections_total": (COUNTER, "WebSocket connections accepted."),
    "pie_websocket_requests_total": (
        COUNTER,
        "WebSocket requests answered, by outcome: ok, or the Failure kind that refused them.",
    ),
    "pie_websocket_event_frames_total": (
        COUNTER,
        "WebSocket frames sent that answer no request (inferlet and bus events).",
    ),
}
"""name -> (type, meaning) of every metric read from statistics (docs/observability.md)."""


class Families:
    """One scrape's families: `add(name, value, **labels)` for each sample."""

    def __init__(self) -> None:
        self._families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

    def add(self, name: str, value: float, **labels: str) -> None:
        family = self._families.get(name)
        if family is None:
            kind, meaning = READ_AT_SCRAPE[name]
            make = CounterMetricFamily if kind == COUNTER else GaugeMetricFamily
            family = self._families[name] = make(name, meaning, labels=list(labels))
        family.add_metric(list(labels.values()), value)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())
