"""The bodies of `pie submit | list | attach | stop | status | watch | publish | push`: the client
against a running `pie serve`. Results go to stdout; progress, notes and errors to stderr."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from pie.client.bus import Watch
from pie.client.connection import Client
from pie.client.errors import (
    CannotConnect,
    ConnectionLost,
    MessageTooLarge,
    PieError,
    ServerError,
)
from pie.client.files import checked_size
from pie.client.inferlet import Outcome, RemoteInferlet
from pie.client.opening import connect
from pie.events import inferlet as ev
from pie.wire.frames import DEFAULT_MAX_FRAME

INTERRUPTED = 130


def _program_bytes(path: Path) -> bytes:
    """A component's bytes; an inferlet folder is built first (cached by its inputs)."""
    if not path.is_dir():
        return path.read_bytes()
    from pie.build import cached_build
    from pie.config import default_cache_dir

    _note(f"building {path} (cached after the first time)")
    return cached_build(path.resolve(), default_cache_dir() / "inferlets").read_bytes()


def run_submit(args: argparse.Namespace) -> int:
    path = Path(args.program)
    files = [Path(f) for f in args.file]
    try:
        wasm = _program_bytes(path)
        for file in files:
            checked_size(file, DEFAULT_MAX_FRAME)
    except OSError as exc:
        _note(f"cannot read {exc.filename or path}: {exc.strerror or exc}")
        return 2
    except MessageTooLarge as exc:
        _note(str(exc))
        return 2

    async def submit(client: Client) -> int:
        bar = _UploadBar()
        try:
            name, version = args.name or path.stem, args.version or "0.1.0"
            try:
                info = await client.install(wasm, name=name, version=version, progress=bar)
            except ServerError as err:
                if err.kind != "name-taken" or args.name or args.version:
                    raise
                # The folder's default name is bound to an earlier build: this build is
                # installed under its own hash and run by it.
                _note(f"{name}@{version} is another build; running this one by its hash")
                info = await client.install(wasm, progress=bar)
        finally:
            bar.close()
        inferlet = await client.launch(info.hash, args.input, snapshots=args.snapshot)
        for file in files:
            await inferlet.send_file(file)
        if args.detach:
            print(inferlet.instance)
            return 0
        if inferlet.queued:
            _note(f"{inferlet.instance} waits for a free slot")
        return await _follow(client, inferlet)

    return _run(args, submit)


def run_attach(args: argparse.Namespace) -> int:
    async def attach(client: Client) -> int:
        return await _follow(client, await client.attach(args.instance, after=args.after))

    return _run(args, attach)


def run_stop(args: argparse.Namespace) -> int:
    async def stop(client: Client) -> int:
        await client.terminate(args.instance)
        return 0

    return _run(args, stop)


def run_list(args: argparse.Namespace) -> int:
    async def listing(client: Client) -> int:
        rows = [("INSTANCE", "PROGRAM", "STATE", "ATTACHED")]
        for item in await client.list():
            attached = "yes" if item.attached else "no"
            rows.append((item.instance, _short(item.program), item.state, attached))
        print(_table(rows))
        return 0

    return _run(args, listing)


def run_status(args: argparse.Namespace) -> int:
    async def status(client: Client) -> int:
        status = await client.statistics()
        stats = attrs.asdict(status)
        stats.pop("corr")
        stats.pop("models")
        print(_table([(name, _number(value)) for name, value in stats.items()]))
        if status.models:
            print()
            print(
                _table(
                    [("model", "reads", "produces", "pages free", "contexts", "passes")]
                    + [_model_row(m) for m in status.models]
                )
            )
        return 0

    return _run(args, status)


def _model_row(load: Any) -> tuple[str, ...]:
    card = load.card
    pages = f"{load.pages_free}/{load.pages_total}"
    return (
        card.name,
        ",".join(card.inputs),
        ",".join(card.outputs),
        pages,
        str(load.contexts),
        str(load.passes),
    )


def run_watch(args: argparse.Namespace) -> int:
    async def watch(client: Client) -> int:
        watches = [await client.watch(topic) for topic in args.topics]
        merged_send, merged = trio.open_memory_channel[Any](0)
        with trio.CancelScope() as scope, _interrupt_cancels(scope):
            async with trio.open_nursery() as nursery:
                for each in watches:
                    nursery.start_soon(_drain, each, merged_send.clone())
                merged_send.close()
                error = await _print_messages(merged, args.count, args.json)
                nursery.cancel_scope.cancel()
            if error is not None:
                raise error
        return INTERRUPTED if scope.cancelled_caught else 0

    return _run(args, watch)


async def _drain(watch: Watch, out: trio.MemorySendChannel[Any]) -> None:
    """Moves a watch's messages to `out`; an error that ends the watch goes there too."""
    async with out:
        try:
            async for message in watch:
                await out.send(message)
        except PieError as exc:
            await out.send(exc)


async def _print_messages(
    messages: trio.MemoryReceiveChannel[Any], count: int, as_json: bool
) -> PieError | None:
    """Prints `count` messages (0: all), one per line; returns the error that ended a watch."""
    seen = 0
    async for message in messages:
        if isinstance(message, PieError):
            return message
        if as_json:
            line = json.dumps(attrs.asdict(message), ensure_ascii=False)
        else:
            line = f"{message.topic} {message.sender}: {message.message}"
        print(line, flush=True)
        seen += 1
        if seen == count:
            break
    return None


def run_publish(args: argparse.Namespace) -> int:
    async def publish(client: Client) -> int:
        await client.publish(args.topic, args.message)
        return 0

    return _run(args, publish)


def run_push(args: argparse.Namespace) -> int:
    async def push(client: Client) -> int:
        await client.push(args.queue, args.message)
        return 0

    return _run(args, push)


# -- running a command -------------------------------------------------------------------------


def _run(args: argparse.Namespace, body: Callable[[Client], Awaitable[int]]) -> int:
    """Connects as the options say, runs `body`, and turns failures into messages and codes."""
    user = args.user
    if user is None and (args.token or args.key):
        user = getpass.getuser()
    options: dict[str, Any] = {"user": user, "token": args.token, "key": args.key}
    options["key_password"] = os.environ.get("PIE_KEY_PASSWORD")

    async def main() -> int:
        async with connect(args.server, **options) as client:
            return await body(client)

    try:
        return trio.run(main)
    except CannotConnect as exc:
        _note(f"cannot reach {exc.url}: {exc.reason}")
        return 2
    except ConnectionLost as exc:
        _note(str(exc))
        return 2
    except ServerError as exc:
        _note(f"{exc.kind}: {exc.message}")
        return 1
    except PieError as exc:
        _note(str(exc))
        return 1
    except KeyboardInterrupt:
        return INTERRUPTED


async def _follow(client: Client, inferlet: RemoteInferlet) -> int:
    """Streams the inferlet's output until it ends; Ctrl-C detaches and leaves it running."""
    console = _Console()
    with trio.CancelScope() as scope, _interrupt_cancels(scope):
        while (event := await inferlet.next_event()) is not None:
            console.show(event)
    if scope.cancelled_caught:
        with trio.move_on_after(5):
            await inferlet.detach()
        console.end_line()
        _note(f"detached; {inferlet.instance} keeps running")
        _note(f"follow it again with: pie attach {inferlet.instance} --after {inferlet.last_seq}")
        return INTERRUPTED
    if inferlet.outcome is None:
        _note(f"the stream of {inferlet.instance} ended before the inferlet did")
        return 1
    return console.finish(inferlet.outcome)


@contextmanager
def _interrupt_cancels(scope: trio.CancelScope) -> Iterator[None]:
    """Ctrl-C cancels `scope` instead of raising KeyboardInterrupt wherever the loop is."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; elsewhere Ctrl-C cannot reach us
        return
    token = trio.lowlevel.current_trio_token()
    previous = signal.signal(signal.SIGINT, lambda *_: token.run_sync_soon(scope.cancel))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _Console:
    """Writes an inferlet's output as it comes; keeps the result on a line of its own."""

    def __init__(self) -> None:
        self._mid_line = False

    def show(self, event: Any) -> None:
        if isinstance(event, ev.InferletOutput) and event.stream == "stderr":
            _write(sys.stderr, event.text)
        elif isinstance(event, ev.InferletOutput):
            self._stdout(event.text)
        elif isinstance(event, ev.SessionMessage) and event.text is not None:
            self._stdout(event.text)  # generated tokens often stream as session messages
        elif isinstance(event, ev.SessionMessage):
            _note(f"session message of {len(event.data or b'')} bytes")

    def end_line(self) -> None:
        if self._mid_line:
            self._stdout("\n")

    def finish(self, outcome: Outcome) -> int:
        self.end_line()
        if outcome.ok:
            print(outcome.result, flush=True)
            return 0
        _note(f"{outcome.instance} {outcome.status}: {outcome.error}")
        return 1

    def _stdout(self, text: str) -> None:
        if text:
            _write(sys.stdout, text)
            self._mid_line = not text.endswith("\n")


class _UploadBar:
    """A tqdm bar on stderr, opened by the first chunk, so a program already installed shows
    nothing."""

    def __init__(self) -> None:
        self._bar: Any = None

    def __call__(self, sent: int, total: int) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="upload", file=sys.stderr)
        self._bar.update(sent - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _write(stream: Any, text: str) -> None:
    stream.write(text)
    stream.flush()


def _note(text: str) -> None:
    print(f"pie: {text}", file=sys.stderr, flush=True)


def _short(program: str) -> str:
    is_hash = len(program) == 64 and all(c in "0123456789abcdef" for c in program)
    return program[:12] if is_hash else program


def _number(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value)) or "none"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)
