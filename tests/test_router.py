"""OpenAI traffic through the SGLang router (`sglang-router`, the real binary) in front of pie
nodes: the router registers a node from its /ready and /server_info pages, passes each client's
pie credentials through, and stops with nothing left behind; two real `pie serve` nodes on the
default model answer the `openai` client through the router (whole and streamed) exactly as one
node does directly, both take traffic, and a node killed with SIGKILL drops out."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pie.client.local import LocalServer
from pie.cluster.router import RouterError, RouterProcess, RouterSettings
from pie.drivers.tokenizer import Tokenizer
from pie.server.auth import UserStore
from pie.server.discovery import discovery_routes
from pie.server.mounts import OPENAI_PREFIX, OPENAI_SERVER
from pie.server.observe.metrics import EngineMetrics
from pie.server.observe.probes import probe_routes
from pie.server.routes import Route
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, http_front, kill_hard, precompiled

PROMPTS = (
    "Name three colours of the rainbow.",
    "What is the capital of France?",
    "Count from one to five.",
    "Say something about the sea.",
    "Which animal says moo?",
    "What do bees make?",
)
TOKENS = 12


def client_for(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def messages(prompt: str) -> list[dict[str, str]]:
    """The prompt alone: a system message shared by every request would be a common prefix,
    which `cache_aware` rightly keeps on one node."""
    return [{"role": "user", "content": prompt}]


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


def answer(client: openai.OpenAI, model: str, prompt: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=messages(prompt),
        max_tokens=TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


def streamed(client: openai.OpenAI, model: str, prompt: str) -> str:
    chunks = client.chat.completions.create(
        model=model,
        messages=messages(prompt),  # type: ignore[arg-type]
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- settings and start-up failures ---------------------------------------------------------------


@pytest.mark.unit
def test_settings_refuse_an_unknown_policy_and_bad_worker_urls() -> None:
    with pytest.raises(ValueError, match="policy 'fastest': one of cache_aware, round_robin"):
        RouterSettings(workers=["http://127.0.0.1:1"], policy="fastest")
    with pytest.raises(ValueError, match="at least one worker"):
        RouterSettings(workers=[])
    with pytest.raises(ValueError, match="give http://HOST:PORT"):
        RouterSettings(workers=["127.0.0.1:8000"])


@pytest.mark.integration
def test_a_missing_router_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # The router's package is looked up on sys.path; without site-packages it is not there.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    with pytest.raises(RouterError) as caught:
        RouterProcess.start(RouterSettings(workers=["http://127.0.0.1:1"]))
    assert str(caught.value) == (
        "the SGLang router is not installed (pip install sglang-router==0.3.2)"
    )


@pytest.mark.integration
def test_a_router_that_cannot_bind_its_port_fails_with_its_reason() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = RouterSettings(workers=["http://127.0.0.1:1"], port=port)
        with pytest.raises(RouterError) as caught:
            RouterProcess.start(settings)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the SGLang router exited with 1: ")
    assert "Address already in use" in message


@pytest.mark.integration
def test_a_router_whose_worker_never_answers_times_out_and_leaves_nothing() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        settings = RouterSettings(workers=[url], start_timeout_s=3)
        with pytest.raises(RouterError, match=f"did not see {url} healthy within 3 s"):
            RouterProcess.start(settings)
    assert not [p for p in _children() if "sglang_router" in p]


def _children() -> Iterator[str]:
    """The command lines of this process's children."""
    listed = subprocess.run(
        ["ps", "-o", "args=", "--ppid", str(os.getpid())], capture_output=True, text=True
    )
    yield from listed.stdout.splitlines()


# -- one node on the synthetic driver, with authentication on -------------------------------------


@pytest.fixture(scope="module")
def openai_wasm(built: Callable[[Path], Path]) -> bytes:  # noqa: F811
    return precompiled(built(OPENAI_SERVER).read_bytes())


@pytest.mark.integration
async def test_the_router_registers_a_node_passes_credentials_through_and_stops_cleanly(
    openai_wasm: bytes, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    users = UserStore(tmp_path / "users")
    token = users.add("alice")
    programs = {OPENAI_PREFIX: openai_wasm}
    components = PYTEST_CACHE / "pie-components"
    async with http_front(
        tokenizer, components, programs, users=users, openai=True, engine_routes=_node_routes
    ) as (engine, front, _):
        model = engine.info.model_name
        settings = RouterSettings(workers=[front.url])
        router = await in_thread(lambda: RouterProcess.start(settings))
        try:
            with trio.fail_after(120):
                listed = await in_thread(lambda: client_for(router.url).models.list())
                alice = client_for(router.url, f"alice:{token}")
                reply = await in_thread(lambda: answer(alice, model, "Hi"))
                with pytest.raises(openai.AuthenticationError) as stranger:
                    await in_thread(
                        lambda: answer(client_for(router.url, "eve:nothing"), model, "Hi")
                    )
        finally:
            code = await in_thread(router.stop)
    assert [m.id for m in listed.data] == [model]
    assert isinstance(reply, str) and stranger.value.code == "invalid_api_key"
    assert code is not None and group_gone(router.pid)


def _node_routes(engine: Any) -> tuple[Route, ...]:
    """What `pie serve` adds to its HTTP front: /health, /ready, /metrics and discovery."""
    probes = probe_routes(EngineMetrics(engine), lambda: None)
    return probes + discovery_routes([stack.name for stack in engine.models])


# -- two real `pie serve` nodes -------------------------------------------------------------------


def _start_node(model_dir: Path, tmp_path: Path, name: str) -> tuple[LocalServer, str]:
    """`pie serve --http 0 --openai` on the default model; the server and its HTTP URL."""
    folder = tmp_path / name
    folder.mkdir()
    config = folder / "pie.toml"
    config.write_text(
        f'[sandbox]\ncache_dir = "{PYTEST_CACHE / "pie-components"}"\n'
        f'[server]\nprograms_dir = "{folder / "programs"}"\n[kv]\nnum_pages = 512\n'
    )
    args = ["--config", str(config), "--http", "0", "--openai"]
    server = LocalServer.start(model_dir, args=args, timeout=600)
    found = re.search(r"pie: (http://\S+)/v1 serves", server.log_tail(50))
    assert found, server.log_tail()
    return server, found[1]


async def served_since(urls: list[str], before: list[float], total: int) -> list[float]:
    """How many requests each node served since `before`, once they add up to `total` (a node
    refreshes its metrics on an interval, so the counts may lag a moment)."""
    with trio.fail_after(30):
        while True:
            now = [await in_thread(lambda u=u: launched(u)) for u in urls]
            served = [a - b for a, b in zip(now, before, strict=True)]
            if sum(served) >= total:
                return served
            await trio.sleep(0.5)


def launched(url: str) -> float:
    """The node's count of inferlets launched: one per OpenAI request it served."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pie_inferlets_launched_total"
    )


@pytest.mark.model
async def test_two_nodes_behind_the_router_answer_as_one_share_traffic_and_survive_a_kill(
    default_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    start = [lambda name=name: _start_node(default_model_dir, tmp_path, name) for name in "ab"]
    nodes: list[tuple[LocalServer, str]] = []
    try:
        async with trio.open_nursery() as nursery:
            for begin in start:
                nursery.start_soon(_append, nodes, begin)
        urls = [url for _, url in nodes]
        model = nodes[0][0].model
        with trio.fail_after(600):
            await _both_nodes_take_traffic(urls, model)
            router = await in_thread(lambda: RouterProcess.start(RouterSettings(workers=urls)))
            try:
                chosen = await _answers_as_one_node(router, urls, model)
                await _survives_a_killed_node(router, nodes, chosen, model)
            finally:
                await in_thread(router.stop)
        assert group_gone(router.pid)
    finally:
        for server, _ in nodes:
            server.kill()


async def _append(nodes: list[tuple[LocalServer, str]], begin: Callable[[], Any]) -> None:
    nodes.append(await in_thread(begin))


async def _answers_as_one_node(router: RouterProcess, urls: list[str], model: str) -> str:
    """Greedy replies through the `cache_aware` router, whole and streamed, equal a node's own;
    the URL of the node that served them."""
    direct, routed = client_for(urls[0]), client_for(router.url)
    prompt = PROMPTS[0]
    before = [await in_thread(lambda u=u: launched(u)) for u in urls]
    expected = await in_thread(lambda: answer(direct, model, prompt))
    whole = await in_thread(lambda: answer(routed, model, prompt))
    parts = await in_thread(lambda: streamed(routed, model, prompt))
    listed = await in_thread(lambda: routed.models.list())
    assert expected and whole == expected and parts == expected
    assert [m.id for m in listed.data] == [model]
    counts = await served_since(urls, before, 3)
    counts[0] -= 1  # the direct request
    served = dict(zip(urls, counts, strict=True))
    assert sum(served.values()) == 2, served
    return max(served, key=lambda url: served[url])


async def _both_nodes_take_traffic(urls: list[str], model: str) -> None:
    """Different prompts through a `round_robin` router reach both nodes. (`cache_aware` in
    sglang-router 0.3.2 kept every one of a sequence of unrelated prompts on one node here, so it
    cannot show this; docs/scale-out.md says so.)"""
    settings = RouterSettings(workers=urls, policy="round_robin")
    with await in_thread(lambda: RouterProcess.start(settings)) as router:
        before = [await in_thread(lambda u=u: launched(u)) for u in urls]
        routed = client_for(router.url)
        for prompt in PROMPTS:
            assert await in_thread(lambda p=prompt: answer(routed, model, p))
        served = await served_since(urls, before, len(PROMPTS))
    assert sum(served) == len(PROMPTS) and all(n > 0 for n in served), served


async def _survives_a_killed_node(
    router: RouterProcess, nodes: list[tuple[LocalServer, str]], victim: str, model: str
) -> None:
    """After SIGKILL of the node the router was using, the router marks it unhealthy within
    seconds and every request goes to the other."""
    server = next(server for server, url in nodes if url == victim)
    alive = next(url for _, url in nodes if url != victim)
    await kill_hard(server)
    with trio.fail_after(30):
        while (await in_thread(router.workers)).get(victim, False):
            await trio.sleep(0.5)
    before = await in_thread(lambda: launched(alive))
    routed = client_for(router.url)
    for prompt in PROMPTS[:3]:
        assert await in_thread(lambda p=prompt: answer(routed, model, p))
    assert await served_since([alive], [before], 3) == [3]
