"""The bodies of `pie generate`, `pie build` and `pie run`: the engine in this process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

from pie.cli.options import engine_config


def run_generate(args: argparse.Namespace) -> int:
    from pie.actors.generate import generate, make_sampler, prompt_ids
    from pie.engine import open_engine

    config = engine_config(args)
    sampler = make_sampler(args.temperature, top_p=args.top_p, seed=args.seed)

    async def main() -> str:
        async with open_engine(config) as engine:
            tokenizer = engine.tokenizer
            prompt = prompt_ids(tokenizer, args.prompt, raw=args.raw, system=args.system)
            async with engine.requester("cli") as requester:
                result = await generate(
                    requester,
                    prompt,
                    max_tokens=args.max_tokens,
                    sampler=sampler,
                    stop_tokens=tokenizer.stop_token_ids,
                )
            tokens = [t for t in result.tokens if t not in tokenizer.stop_token_ids]
            rate = len(result.tokens) / result.decode_seconds if result.decode_seconds > 0 else 0.0
            print(
                f"pie: {result.prompt_tokens} prompt tokens in {result.prefill_seconds:.2f} s, "
                f"{len(result.tokens)} generated ({rate:.1f} tokens/s), stop: {result.stop_reason}",
                file=sys.stderr,
            )
            return str(tokenizer.decode(tokens, skip_special_tokens=True))

    print(trio.run(main))
    return 0


def run_build(args: argparse.Namespace) -> int:
    from pie.build import BuildError, build_inferlet

    folder = Path(args.folder)
    output = Path(args.output) if args.output else Path(f"{folder.resolve().name}.wasm")
    try:
        build_inferlet(folder, output)
    except BuildError as err:
        print(f"pie build: {err}", file=sys.stderr)
        return 1
    print(f"pie: built {output} ({output.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def run_program(args: argparse.Namespace) -> int:
    """Runs one inferlet on an in-process engine, sending it each `--file` as a session
    message: its result alone goes to stdout; its own output, session messages and failures go
    to stderr."""
    from pie.engine import open_engine

    config = engine_config(args)
    wasm = Path(args.program).read_bytes()
    if not wasm.startswith(b"\0asm"):
        # Told before the model loads, not after.
        raise ValueError(f"{args.program} is not a WebAssembly component (`pie build` makes one)")
    try:
        files = [Path(f).read_bytes() for f in args.file]
    except OSError as exc:
        print(f"pie: cannot read {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2

    async def main() -> Any:
        async with open_engine(config) as engine, engine.requester() as requester:
            program = engine.programs.add(wasm)
            run = await requester.launch(program.hash, args.input)
            for data in files:
                await run.send(data=data)
            return await run.outcome(_show_event)

    outcome = trio.run(main)
    if outcome.status == "returned":
        print(outcome.result)
        return 0
    print(f"pie: the inferlet ended with status {outcome.status}: {outcome.error}", file=sys.stderr)
    return 1


def _show_event(event: Any) -> None:
    from pie.events.inferlet import InferletOutput, SessionMessage

    if isinstance(event, InferletOutput):
        sys.stderr.write(event.text)
    elif isinstance(event, SessionMessage):
        body = event.text if event.text is not None else f"<{len(event.data or b'')} bytes>"
        print(f"[session] {body}", file=sys.stderr)
    sys.stderr.flush()
