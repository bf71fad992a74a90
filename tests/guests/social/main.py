"""A test guest for the I/O interfaces: input {"mode": ...} picks a role."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from inferlet import messaging, runtime, session


async def main(input: dict[str, Any]) -> Any:
    mode = input["mode"]
    if mode == "parent":
        children = [runtime.launch("social", {"mode": "child", "n": n}) for n in range(3)]
        results = await asyncio.gather(*(child.result() for child in children))
        pulled = [await messaging.pull("greetings") for _ in children]
        return {"results": list(results), "pulled": sorted(pulled)}
    if mode == "fan-out":
        return await fan_out(input["n"])
    if mode == "square":
        if input["n"] < 0:
            raise ValueError(f"no square for {input['n']}")
        return input["n"] ** 2
    if mode == "detacher":
        kept = runtime.launch("social", {"mode": "outlive"})
        kept.detach()
        runtime.launch("social", {"mode": "wait-forever"})
        return "parent done"
    if mode == "outlive":
        await messaging.pull("go")
        messaging.push("after", "survived my parent")
        return "outlived"
    if mode == "child":
        messaging.push("greetings", f"hello from {input['n']}")
        return f"child {input['n']} done"
    if mode == "orphan-maker":
        runtime.launch("social", {"mode": "wait-forever"})
        raise RuntimeError("leaving my child behind")
    if mode == "wait-forever":
        return await session.receive()
    if mode == "subscriber":
        subscription = messaging.subscribe("news")
        session.send("subscribed")
        first = await subscription.next()
        second = await subscription.next()
        subscription.unsubscribe()
        return [first, second]
    if mode == "publisher":
        for item in input["items"]:
            messaging.broadcast("news", item)
        return "published"
    if mode == "echo":
        session.send(b"\x00binary")
        reply = await session.receive()
        return json.dumps({"got": reply if isinstance(reply, str) else reply.hex()})
    raise ValueError(f"unknown mode {mode!r}")


async def fan_out(n: int) -> dict[str, Any]:
    """n children at once, plus one that fails and one that is terminated."""
    children = [runtime.launch("social", {"mode": "square", "n": k}) for k in range(n)]
    failing = runtime.launch("social", {"mode": "square", "n": -1})
    stopped = runtime.launch("social", {"mode": "wait-forever"})
    squares = await asyncio.gather(*(child.result() for child in children))
    stopped.terminate()
    errors = []
    for child in (failing, stopped):
        try:
            await child.result()
        except Exception as err:
            errors.append(str(err))
    return {"squares": [int(s) for s in squares], "errors": errors}
