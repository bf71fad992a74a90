"""A test guest that attacks the engine's shared resources: input {"mode": ...} picks how."""

from __future__ import annotations

import json
import os
from typing import Any

from inferlet import runtime, session
from inferlet.errors import HostError

CHUNK = 1 << 20


async def main(input: dict[str, Any]) -> Any:
    mode = input["mode"]
    if mode == "ok":
        return "fine"
    if mode == "wait":
        return await session.receive()
    if mode == "bomb":
        return _bomb(input["program"])
    if mode == "deep":
        return await _deep(input["program"])
    if mode == "alloc":
        hoard = []
        while True:
            hoard.append(bytearray(CHUNK))
    if mode == "unlink":
        return await _unlinked_writer(input["size"])
    raise ValueError(f"unknown mode {mode!r}")


def _bomb(program: str) -> dict[str, Any]:
    """Launches waiting children until the engine refuses one."""
    children = []
    while True:
        try:
            children.append(runtime.launch(program, {"mode": "wait"}))
        except HostError as err:
            return {"launched": len(children), "kind": err.kind, "message": err.message}


async def _deep(program: str) -> dict[str, Any]:
    """A chain of children, each launching the next, until the engine refuses one."""
    try:
        child = runtime.launch(program, {"mode": "deep", "program": program})
    except HostError as err:
        return {"depth": 0, "kind": err.kind, "message": err.message}
    below = json.loads(await child.result())
    return {**below, "depth": below["depth"] + 1}


async def _unlinked_writer(size: int) -> str:
    """Writes `size` bytes into a file it removed first, so the directory looks empty."""
    with open("/scratch/hidden", "wb") as file:
        os.remove("/scratch/hidden")
        for start in range(0, size, CHUNK):
            file.write(b"x" * min(CHUNK, size - start))
            file.flush()
        session.send("written")
        await session.receive()
    return "kept"
