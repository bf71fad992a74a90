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
    if mode == "files":
        return {"scratch": _try_write("/scratch/note.txt"), "etc": _try_read("/etc/hostname")}
    if mode == "network":
        import socket

        try:
            socket.create_connection(("127.0.0.1", int(input["port"])), timeout=2).close()
            return "connected"
        except Exception as exc:  # whatever WASI says, it must not be a connection
            return f"refused: {type(exc).__name__}"
    raise ValueError(f"unknown mode {mode!r}")


def _try_write(path: str) -> str:
    try:
        with open(path, "w") as file:
            file.write("kept")
        return "written"
    except OSError as exc:
        return type(exc).__name__


def _try_read(path: str) -> str:
    try:
        with open(path) as file:
            return "read " + file.read(10)
    except OSError as exc:
        return type(exc).__name__
