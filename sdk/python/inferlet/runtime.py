"""The engine around this inferlet: version, identity, and child inferlets."""

from __future__ import annotations

import json
from typing import Any

from wit_world.imports import runtime as _rt

from inferlet import _loop
from inferlet.errors import call


def version() -> str:
    """The engine's version."""
    return _rt.version()


def instance_id() -> str:
    return _rt.instance_id()


def user() -> str:
    """The user this inferlet runs for."""
    return _rt.user()


def launch(program: str, input: Any = "") -> Child:
    """Starts `program` (a name, name@version or content hash) as a child; `input` that is not
    a string is sent as JSON. Children still running when this inferlet ends are stopped,
    except those it detached (`Child.detach`)."""
    text = input if isinstance(input, str) else json.dumps(input)
    return Child(call(_rt.launch, program, text), program)


class Child:
    def __init__(self, handle: int, program: str) -> None:
        self.handle = handle
        self.program = program

    async def result(self) -> str:
        """What the child returned; its failure raises HostError of kind `failed`."""
        pending = call(_rt.wait, self.handle)
        await _loop.ready(pending)
        return call(_rt.child_result, pending)

    def terminate(self) -> None:
        call(_rt.terminate, self.handle)

    def detach(self) -> None:
        """Lets the child outlive this inferlet; until this inferlet ends it can still be
        awaited or terminated."""
        call(_rt.detach, self.handle)

    def __repr__(self) -> str:
        return f"Child({self.program!r})"
