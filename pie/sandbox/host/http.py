"""The `http` interface: outgoing requests, run by the http actor under the network policy."""

from __future__ import annotations

from typing import Any

from wasmtime.component import LinkerInstance

from pie.events import http as ev
from pie.sandbox.host.state import HostFailure, current, host_call
from pie.sandbox.wasm import add_host_func, record

INTERFACE = "pie:inferlet/http@0.1.0"

MAX_BODY_BYTES = 16 * 1024 * 1024


def fetch(request: Any) -> int:
    state = current()
    body = bytes(request.body)
    if len(body) > MAX_BODY_BYTES:
        raise HostFailure("invalid", f"a request body of {len(body)} bytes is over the limit")
    timeout_ms = getattr(request, "timeout-ms")
    max_redirects = getattr(request, "max-redirects")
    event = ev.HttpFetch(
        corr=state.next_corr(),
        requester=state.address,
        user=state.user,
        method=request.method,
        url=request.url,
        headers=tuple((h.name, h.value) for h in request.headers),
        body=body,
        timeout_seconds=None if timeout_ms is None else timeout_ms / 1000,
        max_redirects=max_redirects,
    )
    handle = state.new_handle()
    if state.trace is not None:
        # Before the request leaves: the http actor's span goes under this one.
        method = {"http.request.method": event.method}
        state.trace.opened(handle, "pie.http.fetch", event.corr, method)
    return state.submit("http", event, "http", handle)


def fetched(pending: int) -> Any:
    response: ev.HttpFetched = current().take(pending, "http")
    return record(
        status=response.status,
        url=response.url,
        headers=[record(name=k, value=v) for k, v in response.headers],
        body=response.body,
    )


def register(instance: LinkerInstance) -> None:
    add_host_func(instance, "fetch", host_call(fetch))
    add_host_func(instance, "fetched", host_call(fetched))
