"""chat-session: a conversation of a few turns with one inferlet that keeps its context between
turns, so each turn prefills only its own tokens; turn 1 is checked against a single-turn
text-completion of the same prompt."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for `scenarios._support`

from pie.client import Client, RemoteInferlet, SessionMessage, connect  # noqa: E402
from scenarios._support import TEXT_COMPLETION, install, main, result_of  # noqa: E402

CHAT = Path(__file__).resolve().parent / "chat"
MAX_TOKENS = 24
MESSAGES = (
    "What is the capital of France?",
    "What is it famous for?",
    "Name one museum there.",
    "Thanks, that is all.",
)


def run(url: str, cache_dir: Path | None = None) -> dict[str, Any]:
    """The conversation against the server at `url`; `cache_dir` holds built inferlets (default:
    $PIE_CACHE_DIR/inferlets)."""
    return trio.run(_run, url, cache_dir)


async def _run(url: str, cache_dir: Path | None) -> dict[str, Any]:
    async with connect(url) as client:
        chat = await install(client, CHAT, cache_dir)
        completion = await install(client, TEXT_COMPLETION, cache_dir)
        started = time.perf_counter()
        turns, returned = await converse(client, chat, MESSAGES)
        seconds = time.perf_counter() - started
        request = {"prompt": MESSAGES[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        single = await result_of(client, completion, request)
    checks = {
        "every reply is non-empty": all(turn["reply"].strip() for turn in turns),
        "the inferlet returned its number of turns": returned == len(MESSAGES),
        "turns after the first prefill under half the context": all(
            2 * turn["prefilled"] < turn["context_tokens"] for turn in turns[1:]
        ),
        "turn 1 equals a single-turn text-completion": turns[0]["reply"] == single,
    }
    return {
        "messages": list(MESSAGES),
        "max_tokens": MAX_TOKENS,
        "turns": turns,
        "single_turn": single,
        "returned": returned,
        "seconds": seconds,
        "checks": checks,
    }


async def converse(
    client: Client, program: str, messages: tuple[str, ...]
) -> tuple[list[dict[str, Any]], int]:
    """One chat inferlet through all `messages`, then "/bye"; each turn's JSON answer and the
    number of turns it returned."""
    inferlet = await client.launch(program, {"max_tokens": MAX_TOKENS})
    turns = []
    for text in messages:
        await inferlet.send(text)
        turns.append(json.loads(await _next_text(inferlet)))
    await inferlet.send("/bye")
    outcome = await inferlet.result()
    if not outcome.ok or outcome.result is None:
        raise RuntimeError(f"the chat ended {outcome.status}: {outcome.error}")
    return turns, int(outcome.result)


async def _next_text(inferlet: RemoteInferlet) -> str:
    while (event := await inferlet.next_event()) is not None:
        if isinstance(event, SessionMessage) and event.text is not None:
            return event.text
    raise RuntimeError(f"the chat ended before it replied: {inferlet.outcome}")


def summary(report: dict[str, Any]) -> str:
    lines = [f"{len(report['turns'])} turns in {report['seconds']:.1f} s"]
    for number, (text, turn) in enumerate(zip(report["messages"], report["turns"], strict=True)):
        lines += [
            f"turn {number + 1}: prefilled {turn['prefilled']} tokens, context now "
            f"{turn['context_tokens']}",
            f"  user: {text}",
            f"  assistant: {turn['reply'].strip()}",
        ]
    lines.append(f"single-turn text-completion of turn 1: {report['single_turn'].strip()}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(__doc__, run, summary))
