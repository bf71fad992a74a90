"""An actor whose handler fails on one request fails that request alone: its requester gets an
`internal` error, the actor goes on with its next event and the engine keeps serving."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from pie.actors.requester import Requester, RequestRefused
from pie.drivers.synthetic import SyntheticDriver
from pie.engine import open_engine
from pie.events import http as http_ev
from pie.events import mcp as mcp_ev
from pie.events.sampling import Argmax, SamplingSlot, TokenOutput

pytestmark = pytest.mark.security


async def decode(r: Requester, prompt: list[int], steps: int) -> list[int]:
    context = await r.create_context()
    made: list[int] = []
    tokens, index = prompt, len(prompt) - 1
    for _ in range(steps):
        outputs = await r.forward(context, tokens, (SamplingSlot(index=index, op=Argmax()),))
        token = outputs[0]
        assert isinstance(token, TokenOutput)
        made.append(token.token)
        tokens, index = [token.token], 0
    await r.destroy(context)
    return made


async def create(r: Requester) -> None:
    await r.destroy(await r.create_context())


async def forward(r: Requester) -> None:
    await decode(r, [3, 4], 1)


async def push_pull(r: Requester) -> None:
    await r.push("q", "hello")
    assert await r.pull("q") == "hello"


async def launch(r: Requester) -> None:
    await r.launch("no-such-program@1.0.0", "")


async def fetch(r: Requester) -> None:
    # The default policy denies everything: the actor answers without touching the network.
    await r.call(
        "http", http_ev.HttpFetch, method="GET", url="http://192.0.2.1/", headers=(), body=b""
    )


async def call_tool(r: Requester) -> None:
    await r.call(
        "mcp", mcp_ev.McpCallTool, user="local", server="nowhere", tool="t", arguments="{}"
    )


Call = Callable[[Requester], Awaitable[None]]

# actor attribute of the engine, a call that reaches it, and what that call gives when the
# actor is healthy (None: it succeeds; else the kind it is refused with)
CASES: list[tuple[str, Call, str | None]] = [
    ("kv", create, None),
    ("inference", forward, None),
    ("bus", push_pull, None),
    ("inferlets", launch, "no_such_program"),
    ("http", fetch, "denied"),
    ("mcp", call_tool, None),
]


async def outcome(call: Call, r: Requester) -> str | None:
    try:
        await call(r)
    except RequestRefused as refused:
        return refused.kind
    return None


@pytest.mark.parametrize(("name", "call", "healthy"), CASES, ids=[c[0] for c in CASES])
async def test_a_failing_handler_fails_its_request_and_nothing_else(
    name: str, call: Call, healthy: str | None, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    with trio.fail_after(20):
        async with open_engine(driver=SyntheticDriver(pass_seconds=0.001)) as engine:
            actor = getattr(engine, name)
            original = actor.handle
            injected = 0

            async def failing_once(event: Any) -> None:
                nonlocal injected
                if injected == 0:
                    injected += 1
                    raise RuntimeError("injected failure")
                await original(event)

            monkeypatch.setattr(actor, "handle", failing_once)
            async with engine.requester() as attacker, engine.requester() as good:
                assert await outcome(call, attacker) == "internal"
                assert injected == 1
                # The actor goes on: the same call is answered as usual, for anyone.
                expected = healthy if name != "mcp" else await outcome(call, good)
                assert expected != "internal"
                assert await outcome(call, attacker) == expected
                assert await decode(good, [7, 8], 5) == [9, 10, 11, 12, 13]
            stats = engine.statistics().kv
            assert stats.contexts == 0
            assert stats.pages_free == stats.pages_total
    assert "injected failure" in capsys.readouterr().err
