"""A client that floods its own inferlet with messages it does not read: past the inferlet's
bound the sends are refused `overrun`, past the user's bound `quota`, and the inferlet and
everyone else are served as before once it reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from pie.config import EngineConfig, with_overrides
from pie.events import inferlet as ev
from pie.wire import messages as msg
from tests.inferlet_fixtures import GUESTS
from tests.inferlet_fixtures import build_inferlet as built  # noqa: F401  (fixture)
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)
from tests.server_fixtures import PYTEST_CACHE, Raw, connect, serving

pytestmark = pytest.mark.security


@pytest.fixture(scope="module")
def relay(built: Callable[[Path], Path], default_model_dir: Path) -> bytes:  # noqa: F811
    return built(GUESTS / "relay").read_bytes()


def small_inboxes() -> EngineConfig:
    """An inferlet holds at most 3 unread messages; a user's hold 64 KiB together."""
    return with_overrides(
        EngineConfig(),
        sandbox={
            "cache_dir": str(PYTEST_CACHE / "pie-components"),
            "max_session_messages": 3,
            "max_user_session_mb": 1 / 16,
        },
    )


async def gated(raw: Raw, queue: str) -> str:
    request = json.dumps({"mode": "gate", "queue": queue})
    launched = await raw.call(msg.Launch, program="relay", input=request)
    assert isinstance(launched, msg.Launched), launched
    return launched.instance


async def replies_until_end(raw: Raw, instance: str) -> tuple[list[str], Any]:
    seen = await raw.until_end(instance)
    texts = [m.event.text for m in seen if isinstance(m.event, ev.SessionMessage)]
    return texts, seen[-1].event


async def test_unread_messages_past_the_bounds_are_refused_and_everyone_is_served_after(
    tmp_path: Path, relay: bytes
) -> None:
    async with serving(tmp_path, config=small_inboxes()) as server:
        server.engine.programs.add(relay, "relay")
        with trio.fail_after(60):
            async with await connect(server.url) as ws, await connect(server.url) as other_ws:
                raw, other = Raw(ws), Raw(other_ws)
                await raw.next()
                await other.next()
                flooded = await gated(raw, "open-flooded")
                for text in ["a", "b", "c"]:
                    done = await raw.call(msg.SendMessage, instance=flooded, text=text)
                    assert isinstance(done, msg.Done), done
                over = await raw.call(msg.SendMessage, instance=flooded, text="d")
                assert isinstance(over, msg.Failure) and over.kind == "overrun", over
                assert "max_session_messages" in over.message
                # The same user's other inferlet meets the user's bound, 64 KiB in all.
                hoard = await gated(raw, "open-hoard")
                big = "x" * 40_000
                assert isinstance(
                    await raw.call(msg.SendMessage, instance=hoard, text=big), msg.Done
                )
                quota = await raw.call(msg.SendMessage, instance=hoard, text=big)
                assert isinstance(quota, msg.Failure) and quota.kind == "quota", quota
                assert "max_user_session_mb" in quota.message
                # Another user is served meanwhile.
                await other.call(msg.Authenticate, user="bob")
                theirs = await gated(other, "open-bob")
                assert isinstance(
                    await other.call(msg.Push, queue="open-bob", message="go"), msg.Done
                )
                for text in ["hello", "bye"]:
                    done = await other.call(msg.SendMessage, instance=theirs, text=text)
                    assert isinstance(done, msg.Done), done
                texts, end = await replies_until_end(other, theirs)
                assert texts == ["1:hello"]
                assert isinstance(end, ev.InferletReturned) and end.result == "1"
                # Once the flooded inferlet reads, it has every message it was sent and takes more.
                assert isinstance(
                    await raw.call(msg.Push, queue="open-flooded", message="go"), msg.Done
                )
                while True:
                    sent = await raw.call(msg.SendMessage, instance=flooded, text="e")
                    if isinstance(sent, msg.Done):
                        break
                    assert sent.kind == "overrun", sent
                    await trio.sleep(0.05)
                await raw.call(msg.SendMessage, instance=flooded, text="bye")
                texts, end = await replies_until_end(raw, flooded)
                assert texts == ["1:a", "2:b", "3:c", "4:e"]
                assert isinstance(end, ev.InferletReturned) and end.result == "4"
                assert isinstance(await raw.call(msg.Terminate, instance=hoard), msg.Done)
                await raw.until_end(hoard)
                assert server.engine.statistics().inferlets.session_bytes == 0
