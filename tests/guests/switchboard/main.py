"""A test guest for clients on the bus: input {"mode": ...} picks a role."""

from __future__ import annotations

from typing import Any

from inferlet import HostError, messaging, session


async def main(input: dict[str, Any]) -> Any:
    mode = input["mode"]
    if mode == "broadcast":
        for item in input["items"]:
            messaging.broadcast(input["topic"], item)
        return "broadcast"
    if mode == "listen":
        # Collects `count` messages of a topic; "ready" tells the client it is subscribed.
        async with messaging.subscribe(input["topic"]) as subscription:
            session.send("ready")
            return [await subscription.next() for _ in range(int(input["count"]))]
    if mode == "work":
        # Pulls jobs from a queue until "stop", answering each on a topic.
        done = 0
        while (job := await messaging.pull(input["queue"])) != "stop":
            messaging.broadcast(input["topic"], job.upper())
            done += 1
        return done
    if mode == "hoard":
        # Pushes `size` characters to queues nobody pulls until the bus refuses one.
        message = "x" * int(input["size"])
        for n in range(int(input["most"])):
            try:
                messaging.push(f"{input['queue']}{n}", message)
            except HostError as err:
                return {"pushed": n, "kind": err.kind}
        return {"pushed": int(input["most"]), "kind": None}
    raise ValueError(f"unknown mode {mode!r}")
