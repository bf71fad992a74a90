"""Outgoing HTTP for inferlets, on the Trio thread, under the network policy.

httpcore does the HTTP/1.1 exchange; its network backend is wrapped so that every connection,
the first and each redirect's, resolves the host itself, checks the addresses against the
policy (pie/net/policy.py) and connects to a checked address. So a refused request never
reaches the network, and a name cannot be re-resolved somewhere else between the check and
the connection.
"""

from __future__ import annotations

import re
import socket
import urllib.parse
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import httpcore
import trio
from attrs import frozen

from pie.net.policy import NetworkPolicy, Origin, parse_address


class Tracing(Protocol):
    """What the fetcher needs of the engine's traces (pie/observe/tracing.py): a span for the
    work done for a host call, under that call's span."""

    def serving(
        self, corr: int, name: str, attributes: Mapping[str, Any]
    ) -> AbstractContextManager[Any]: ...


METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
REDIRECTS = frozenset({301, 302, 303, 307, 308})


class FetchError(Exception):
    """A fetch that produced no response: `kind` is denied, invalid, timeout, too-large,
    unreachable or protocol."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@frozen(kw_only=True)
class Limits:
    timeout_seconds: float
    """For the whole exchange, redirects included."""
    max_response_bytes: int
    max_redirects: int


@frozen(kw_only=True)
class Response:
    status: int
    url: str
    """Where the response came from, after redirects."""
    headers: tuple[tuple[str, str], ...]
    body: bytes


class _Denied(httpcore.ConnectError):
    """Raised inside httpcore's connection code; turned back into FetchError("denied")."""


class _PolicyBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, policy: NetworkPolicy, inner: httpcore.AsyncNetworkBackend) -> None:
        self._policy = policy
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self._checked(host, port)
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def _checked(self, host: str, port: int) -> list[str]:
        literal = parse_address(host)
        if literal is not None:
            if not self._policy.allows_address(literal, origin="literal"):
                raise _Denied(f"the network policy does not allow {literal}")
            return [str(literal)]
        if not self._policy.may_resolve(host):
            raise _Denied(f"the network policy does not allow {host!r}")
        origin: Origin = "allowed-name" if self._policy.allows_name(host) else "other-name"
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from None
        allowed: list[str] = []
        for info in infos:
            address = parse_address(str(info[4][0]))
            if address is not None and self._policy.allows_address(address, origin=origin):
                if str(address) not in allowed:
                    allowed.append(str(address))
        if not allowed:
            raise _Denied(f"the network policy does not allow {host!r}")
        return allowed

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        raise _Denied("unix sockets are not reachable from inferlets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class Fetcher:
    """One connection pool for every inferlet of an engine (Trio thread)."""

    def __init__(
        self,
        policy: NetworkPolicy,
        limits: Limits,
        *,
        max_connections: int,
        tracing: Tracing | None = None,
    ) -> None:
        """`tracing`: the engine's spans, when on; each traced request gets one."""
        self.policy = policy
        self.limits = limits
        self.tracing = tracing
        self._pool = httpcore.AsyncConnectionPool(
            max_connections=max_connections,
            network_backend=_PolicyBackend(policy, httpcore.TrioBackend()),
        )

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def fetch(
        self,
        method: str,
        url: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        *,
        timeout_seconds: float | None = None,
        max_redirects: int | None = None,
        corr: int | None = None,
    ) -> Response:
        """Runs one request, following redirects; raises FetchError. `corr`: the request's
        correlation id, under whose host-call span a traced request's span goes."""
        if self.tracing is None or corr is None:
            return await self._fetch(method, url, headers, body, timeout_seconds, max_redirects)
        shown = {"http.request.method": method.upper(), "server.address": _host_of(url)}
        with self.tracing.serving(corr, "pie.http.request", shown) as span:
            response = await self._fetch(method, url, headers, body, timeout_seconds, max_redirects)
            if span is not None:
                span.set_attribute("http.response.status_code", response.status)
            return response

    async def _fetch(
        self,
        method: str,
        url: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        timeout_seconds: float | None,
        max_redirects: int | None,
    ) -> Response:
        method = method.upper()
        if method not in METHODS:
            raise FetchError("invalid", f"unsupported method {method!r}")
        timeout = min(timeout_seconds or self.limits.timeout_seconds, self.limits.timeout_seconds)
        redirects = self.limits.max_redirects
        if max_redirects is not None:
            redirects = min(max_redirects, redirects)
        with trio.move_on_after(timeout) as scope:
            return await self._follow(method, url, list(headers), body, redirects, timeout)
        assert scope.cancelled_caught
        raise FetchError("timeout", f"no response from {url} within {timeout:g} s")

    async def _follow(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        redirects: int,
        timeout: float,
    ) -> Response:
        follow = redirects > 0
        while True:
            target = _parse(url)
            response = await self._one(method, target, headers, body, timeout)
            location = dict((k.lower(), v) for k, v in response.headers).get("location")
            if response.status not in REDIRECTS or location is None or not follow:
                return response
            if redirects <= 0:
                raise FetchError("protocol", f"too many redirects (last to {location})")
            redirects -= 1
            next_url = urllib.parse.urljoin(url, location)
            if response.status == 303 or (response.status in (301, 302) and method == "POST"):
                method, body = ("HEAD" if method == "HEAD" else "GET"), b""
                headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
            if _parse(next_url).netloc != target.netloc:
                headers = [(k, v) for k, v in headers if k.lower() not in _CREDENTIALS]
            url = next_url

    async def _one(
        self,
        method: str,
        target: urllib.parse.SplitResult,
        headers: list[tuple[str, str]],
        body: bytes,
        timeout: float,
    ) -> Response:
        extensions = {"timeout": dict.fromkeys(("connect", "read", "write", "pool"), timeout)}
        try:
            async with self._pool.stream(
                method,
                target.geturl(),
                headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                content=body,
                extensions=extensions,
            ) as response:
                received = bytearray()
                async for chunk in response.aiter_stream():
                    received += chunk
                    if len(received) > self.limits.max_response_bytes:
                        raise FetchError(
                            "too-large",
                            f"the response is over {self.limits.max_response_bytes} bytes",
                        )
                return Response(
                    status=response.status,
                    url=target.geturl(),
                    headers=tuple(
                        (k.decode("latin-1"), v.decode("latin-1")) for k, v in response.headers
                    ),
                    body=bytes(received),
                )
        except _Denied as exc:
            raise FetchError("denied", str(exc)) from None
        except UnicodeEncodeError as exc:
            raise FetchError("invalid", f"headers must be latin-1: {exc}") from None
        except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
            raise FetchError("unreachable", f"{target.netloc}: {_say(exc)}") from None
        except httpcore.TimeoutException:
            raise FetchError("timeout", f"{target.geturl()} timed out") from None
        except (httpcore.ProtocolError, httpcore.NetworkError) as exc:
            raise FetchError("protocol", f"{target.geturl()}: {_say(exc)}") from None


_CREDENTIALS = frozenset({"authorization", "cookie", "proxy-authorization"})


def _host_of(url: str) -> str:
    """The host a URL names (nothing else of it: its path or query may hold a secret)."""
    try:
        return urllib.parse.urlsplit(url).hostname or ""
    except ValueError:
        return ""


def _say(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _parse(url: str) -> urllib.parse.SplitResult:
    """`url` split, in the ASCII form the HTTP client takes: the host in its IDNA form, the
    rest percent-encoded."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FetchError("invalid", f"bad URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError("invalid", f"only http and https URLs with a host: {url!r}")
    host = _ascii_host(parts.hostname)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    userinfo = parts.netloc.rpartition("@")[0]
    if userinfo:
        netloc = f"{_quote(userinfo)}@{netloc}"
    path, query, fragment = (_quote(p) for p in (parts.path, parts.query, parts.fragment))
    return urllib.parse.SplitResult(parts.scheme, netloc, path, query, fragment)


_HOST = re.compile(r"[a-z0-9._~!$&'()*+,;=%:-]+")


def _ascii_host(host: str) -> str:
    """`host` (lower case) in ASCII: an international name in its IDNA (punycode) form."""
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError as exc:
            raise FetchError("invalid", f"{host!r} is not a valid host name: {exc}") from None
    if not _HOST.fullmatch(host):
        raise FetchError("invalid", f"{host!r} is not a valid host name")
    return host


def _quote(text: str) -> str:
    """`text` with every character a URL may not carry as is (non-ASCII, spaces, controls)
    percent-encoded, and everything else, escapes included, left alone."""
    return urllib.parse.quote(text, safe="!#$%&'()*+,/:;=?@[]~")
