"""A test guest that misbehaves on request: input {"mode": ...} picks how."""

from __future__ import annotations

import sys
from typing import Any

from inferlet import Context, get_model, session


async def main(input: dict[str, Any]) -> str:
    mode = input.get("mode", "ok")
    if mode == "ok":
        return "fine"
    if mode == "loop":
        n = 0
        while True:
            n += 1
    if mode == "raise":
        raise ValueError("boom")
    if mode == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(1 << 20))
    if mode == "contexts":
        ctx = Context(get_model())
        ctx.fill("one two three four five six seven eight nine ten " * 10)
        await ctx.flush()
        raise RuntimeError(f"failing with a context of {ctx.info().tokens} tokens")
    if mode == "stdout":
        print("to stdout")
        print("to stderr", file=sys.stderr)
        return "printed"
    if mode == "session":
        session.send("hello")
        reply = await session.receive()
        return reply if isinstance(reply, str) else reply.decode()
    raise ValueError(f"unknown mode {mode!r}")
