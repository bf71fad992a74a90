"""A test guest for /scratch and /data: input {"mode": ...} says what to do with files."""

from __future__ import annotations

import os
from typing import Any

from inferlet import session

CHUNK = 64 * 1024


async def main(input: dict[str, Any]) -> Any:
    mode = input["mode"]
    if mode == "look":
        return {path: _listing(path) for path in ("/scratch", "/data")}
    if mode == "write":
        _write(input["path"], input.get("text", ""), input.get("size", 0))
    elif mode == "many":
        for n in range(input["count"]):
            _write(f"{input['dir']}/f{n}", "", 0)
    elif mode == "read":
        return _read(input["path"])
    elif mode == "remove":
        os.remove(input["path"])
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if input.get("wait"):
        session.send("waiting")
        await session.receive()
    return "done"


def _write(path: str, text: str, size: int) -> None:
    with open(path, "w") as file:
        file.write(text)
        for start in range(0, size, CHUNK):
            file.write("x" * min(CHUNK, size - start))


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError as exc:
        return type(exc).__name__


def _listing(path: str) -> list[str] | str:
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return type(exc).__name__
