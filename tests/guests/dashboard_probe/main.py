"""A test guest for the dashboard: saves a prefix of a context, forks the whole context, decodes
on the fork, sends `greeting` to its client, then answers each message with "echo:" and the
message until "bye". While it waits, its KV holds saved, shared and used pages."""

from __future__ import annotations

from typing import Any

from inferlet import Context, Sampler, get_model, session


async def main(input: dict[str, Any]) -> Any:
    ctx = Context(get_model())
    ctx.fill_tokens([1 + i % 50 for i in range(input["saved"])])
    await ctx.flush()
    ctx.save(input["name"])
    ctx.fill_tokens([2 + i % 40 for i in range(input["shared"])])
    await ctx.flush()
    fork = ctx.fork()
    generation = fork.generate(Sampler.argmax(), max_tokens=input["decode"], stop_tokens=[])
    await generation.collect_tokens()
    session.send(input["greeting"])
    answered = 0
    while (message := await session.receive()) != "bye":
        session.send(f"echo:{message}")
        answered += 1
    return answered
