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
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import trio

from pie.config import ConfigError, EngineConfig, config_from_dict, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import open_engine
from pie.net.fetch import Fetcher, FetchError, Limits
from pie.net.policy import NetworkPolicy, PolicyError
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: Counter[str]

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
def server() -> Iterator[tuple[str, Counter[str]]]:
    hits: Counter[str] = Counter()
    handler = type("Handler", (_Handler,), {"hits": hits})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", hits
    finally:
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
    server: tuple[str, Counter[str]], fetcher_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    base, hits = server
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
    server: tuple[str, Counter[str]], fetcher_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    base, hits = server
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
    server: tuple[str, Counter[str]], fetcher_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    base, _ = server
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
    server: tuple[str, Counter[str]],
) -> None:
    base, hits = server
    port = base.rsplit(":", 1)[1]
    limits = Limits(timeout_seconds=5, max_response_bytes=1 << 20, max_redirects=2)
    allowed = Fetcher(NetworkPolicy.parse(["localhost"]), limits, max_connections=4)
    denied = Fetcher(
        NetworkPolicy.parse(["localhost"], ["127.0.0.0/8", "::1/128"]), limits, max_connections=4
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

    assert policy.allows_address(address("10.1.2.3"), by_name=False)
    assert not policy.allows_address(address("10.9.0.1"), by_name=False)
    assert not policy.allows_address(address("10.9.0.1"), by_name=True)
    assert policy.allows_address(address("192.168.1.7"), by_name=False)
    assert not policy.allows_address(address("192.168.1.8"), by_name=False)
    assert policy.allows_address(address("::1"), by_name=False)
    assert not policy.allows_address(address("::ffff:10.9.0.1"), by_name=True)
    assert policy.allows_address(address("8.8.8.8"), by_name=True)
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


del trio  # async tests run under trio.run (tests/conftest.py)
