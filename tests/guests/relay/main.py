"""A test guest for the server: input {"mode": ...} picks a role."""

from __future__ import annotations

from typing import Any

from inferlet import Context, HostError, get_model, messaging, session


async def relay() -> int:
    """Answers each message until "bye"; returns how many it answered."""
    count = 0
    while (message := await session.receive()) != "bye":
        count += 1
        session.send(f"{count}:{message}")
    return count


async def main(input: dict[str, Any]) -> Any:
    mode = input["mode"]
    if mode == "relay":
        return await relay()
    if mode == "gate":
        # Reads no message until something is pushed onto the queue, then relays.
        await messaging.pull(input["queue"])
        return await relay()
    if mode == "flood":
        # Sends one large message, then says how that went.
        size = int(input["size"])
        message: str | bytes = bytes(size) if input.get("bytes") else input["char"] * size
        try:
            session.send(message)
            session.send("sent")
        except HostError as err:
            session.send(f"refused: {err.kind}")
        return "flooded"
    if mode == "count":
        for n in range(int(input["n"])):
            session.send(str(n))
        return "counted"
    if mode == "save":
        ctx = Context(get_model())
        ctx.fill(input["text"])
        await ctx.flush()
        ctx.save(input["name"])
        return len(ctx.tokens)
    if mode == "open":
        try:
            ctx = Context.open(get_model(), input["name"])
        except HostError as err:
            return f"error: {err}"
        return len(ctx.tokens)
    raise ValueError(f"unknown mode {mode!r}")
