"""swarm: one client launches one coordinator inferlet, which runs a pipeline of agent inferlets
(planner, writers, critic, editor) that cooperate over bus queues and topics; the client
watches the pipeline's topics as they go and gets the editor's answer back."""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for `scenarios._support`

from pie.client import Client, Watch, connect  # noqa: E402
from scenarios._support import install, main  # noqa: E402

HERE = Path(__file__).resolve().parent
AGENT = HERE / "swarm-agent"
COORDINATOR = HERE / "swarm-coordinator"
TASK = "a short paragraph about tea"
ANGLES = ("the history of tea", "how tea is made", "the health effects of tea")
STAGES = ("plan", "drafts", "critique", "answer")
"""The pipeline's topics, in the order its messages flow; each agent broadcasts on one."""
AUTHOR = {"plan": "planner", "drafts": "writer", "critique": "critic", "answer": "editor"}
SETTLE_SECONDS = 10.0


ELSEWHERE = (1, 2, 3, 4)
"""With a second node: the agents launched there (the writers and the critic), by their place
in the pipeline's roles (planner, writers, critic, editor)."""


def run(url: str, cache_dir: Path | None = None, elsewhere: str | None = None) -> dict[str, Any]:
    """The swarm against the server at `url`; `cache_dir` holds built inferlets (default:
    $PIE_CACHE_DIR/inferlets). With `elsewhere`, another node of the same cluster, the writers
    and the critic run there, launched by the client, and talk to the rest over the cluster's
    bus."""
    return trio.run(_run, url, cache_dir, elsewhere)


async def _run(url: str, cache_dir: Path | None, elsewhere: str | None) -> dict[str, Any]:
    # Topic and queue names are engine-wide (cluster-wide): a fresh prefix keeps runs apart.
    prefix = f"swarm-{secrets.token_hex(4)}"
    async with connect(url) as client:
        agent = await install(client, AGENT, cache_dir)
        coordinator = await install(client, COORDINATOR, cache_dir)
        request = {"run": prefix, "task": TASK, "angles": list(ANGLES), "agent": agent}
        started = time.perf_counter()
        if elsewhere is None:
            seen, outcome = await watched_run(client, coordinator, request)
            remote: list[dict[str, Any]] = []
        else:
            request["elsewhere"] = list(ELSEWHERE)
            seen, outcome, remote = await split_run(
                client, elsewhere, coordinator, request, cache_dir
            )
        seconds = time.perf_counter() - started
    result = json.loads(outcome.result) if outcome.ok and outcome.result else {}
    if remote:
        result["agents"] = merged(result.get("agents", []), remote)
    return report(prefix, seen, outcome, result, seconds)


def roles() -> list[dict[str, Any]]:
    """The pipeline's agents, in the coordinator's order."""
    writers = [{"role": "writer", "angle": angle} for angle in ANGLES]
    return [{"role": "planner"}, *writers, {"role": "critic"}, {"role": "editor"}]


async def split_run(
    client: Client,
    elsewhere: str,
    coordinator: str,
    request: dict[str, Any],
    cache_dir: Path | None,
) -> tuple[list[dict[str, Any]], Any, list[dict[str, Any]]]:
    """`watched_run` with the ELSEWHERE agents launched on the node at `elsewhere`; also what
    those agents returned, each marked `remote`."""
    common = {"run": request["run"], "writers": len(ANGLES)}
    async with connect(elsewhere) as other:
        await install(other, AGENT, cache_dir)
        specs = [roles()[index] for index in ELSEWHERE]
        # Launched where the split puts them, not where load would place them.
        runs = [
            await other.launch(request["agent"], {**common, **spec}, here=True) for spec in specs
        ]
        seen, outcome = await watched_run(client, coordinator, request)
        remote = []
        for spec, launched in zip(specs, runs, strict=True):
            ended = await launched.result()
            if not ended.ok or not ended.result:
                raise RuntimeError(f"the {spec['role']} elsewhere ended {ended.status}")
            remote.append({**json.loads(ended.result), "remote": True})
    return seen, outcome, remote


def merged(local: list[dict[str, Any]], remote: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Both nodes' agent reports in the pipeline's order."""
    order = [(spec["role"], spec.get("angle")) for spec in roles()]
    return sorted(local + remote, key=lambda a: order.index((a["role"], a["angle"])))


async def watched_run(
    client: Client, coordinator: str, request: dict[str, Any]
) -> tuple[list[dict[str, Any]], Any]:
    """Runs the coordinator while watching every stage's topic; what the watches saw, in the
    order it came, and the coordinator's outcome."""
    seen: list[dict[str, Any]] = []
    watches = [await client.watch(f"{request['run']}/{stage}") for stage in STAGES]
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        for stage, watch in zip(STAGES, watches, strict=True):
            nursery.start_soon(collect, stage, watch, seen, started)
        outcome = await (await client.launch(coordinator, request, here=True)).result()
        expected = 3 + len(ANGLES)
        with trio.move_on_after(SETTLE_SECONDS):
            while outcome.ok and len(seen) < expected:
                await trio.sleep(0.05)
        for watch in watches:
            await watch.stop()
    return seen, outcome


async def collect(stage: str, watch: Watch, seen: list[dict[str, Any]], started: float) -> None:
    async for message in watch:
        at = trio.current_time() - started
        seen.append(
            {"stage": stage, "sender": message.sender, "at": at, **json.loads(message.message)}
        )


def report(
    prefix: str, seen: list[dict[str, Any]], outcome: Any, result: dict[str, Any], seconds: float
) -> dict[str, Any]:
    agents = result.get("agents", [])
    answer = result.get("answer", "")
    return {
        "prefix": prefix,
        "task": TASK,
        "status": outcome.status,
        "error": outcome.error,
        "seconds": seconds,
        "agents": agents,
        "answer": answer,
        "watched": seen,
        "checks": checks(seen, agents, answer, outcome.ok),
    }


def checks(
    seen: list[dict[str, Any]], agents: list[dict[str, Any]], answer: str, returned: bool
) -> dict[str, bool]:
    roles = [agent["role"] for agent in agents]
    expected_roles = ["planner", *["writer"] * len(ANGLES), "critic", "editor"]
    ranks = [STAGES.index(message["stage"]) for message in seen]
    editor = [agent for agent in agents if agent["role"] == "editor"]
    answers = [message["text"] for message in seen if message["stage"] == "answer"]
    return {
        "the coordinator returned": returned,
        f"all {len(expected_roles)} agents ended and reported": roles == expected_roles,
        "every stage produced text": bool(agents) and all(a["text"].strip() for a in agents),
        "every agent heard its upstream stage": all(heard_upstream(a) for a in agents),
        "messages flowed in pipeline order": bool(ranks) and ranks == sorted(ranks),
        "the final answer is non-empty and came back to the client": (
            bool(answer.strip()) and [answer] == [a["text"] for a in editor] == answers
        ),
        "the watcher saw every stage's messages from their authors": watched_all(seen, agents),
    }


def heard_upstream(agent: dict[str, Any]) -> bool:
    upstream = {
        "planner": ["task"],
        "writer": ["plan"],
        "critic": ["drafts"] * len(ANGLES),
        "editor": ["drafts"] * len(ANGLES) + ["critique"],
    }
    return bool(agent["heard"] == upstream[agent["role"]])


def watched_all(seen: list[dict[str, Any]], agents: list[dict[str, Any]]) -> bool:
    """One message per agent, on its role's topic, sent from that agent's own bus address (on
    another node, qualified with that node's id: `inferlet:ID@NODE`)."""
    addresses = {(a["role"], a["angle"]): sender_of(a) for a in agents}
    authors = [sent_by_author(message, addresses) for message in seen]
    return len(seen) == len(agents) > 0 and all(authors)


def sent_by_author(message: dict[str, Any], addresses: dict[Any, str]) -> bool:
    pattern = addresses.get((AUTHOR[message["stage"]], message.get("angle")))
    return pattern is not None and re.fullmatch(pattern, message["sender"]) is not None


def sender_of(agent: dict[str, Any]) -> str:
    """The pattern of the agent's sender address as a watcher on the first node sees it."""
    address = re.escape(f"inferlet:{agent['instance']}")
    return address + "@[A-Za-z0-9_.-]+" if agent.get("remote") else address


def summary(report: dict[str, Any]) -> str:
    lines = [f"swarm {report['prefix']}: {report['status']} in {report['seconds']:.1f} s"]
    if report["error"]:
        lines.append(f"  error: {report['error']}")
    for message in report["watched"]:
        who = message.get("angle") or message["role"]
        lines.append(
            f"  {message['at']:5.1f} s [{message['stage']}] {who} ({message['sender']}): "
            f"{message['text']!r}"
        )
    lines.append(f"answer: {report['answer']!r}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(__doc__, run, summary))
