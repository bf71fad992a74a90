"""A local `pie serve` child process on a free port, for scripts, scenarios and benchmarks, and
the mean batch size between two statistics readings."""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pie.wire.messages import EngineStatus

_SERVING = re.compile(r"pie: serving (?P<model>.+) on (?P<url>ws://\S+)")


class ServerExited(RuntimeError):
    """`pie serve` ended before it announced its URL."""

    def __init__(self, code: int, log_tail: str) -> None:
        super().__init__(f"pie serve exited with {code}:\n{log_tail}")
        self.code = code
        self.log_tail = log_tail

    @property
    def last_line(self) -> str:
        """The last line the server wrote, which says why it stopped."""
        lines = [line for line in self.log_tail.splitlines() if line.strip()]
        return lines[-1] if lines else "no output"


class LocalServer:
    """A `pie serve --port 0` child process. `start` returns once the server has announced its
    URL on stderr; `stop` sends SIGTERM and waits for the graceful exit."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.url = ""
        self.model = ""
        self._log: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self._terminated = False
        # The pipe must be drained for the server's whole life, or its writes would block.
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls,
        model: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        args: Sequence[str] = (),
    ) -> LocalServer:
        """Starts `pie serve` on `model` (default: the configured model), on a free port, with
        `args` added to its command line."""
        server = cls.spawn(model, env=env, args=args)
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.kill()
            raise
        return server

    @classmethod
    def spawn(
        cls,
        model: str | Path | None = None,
        *,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        own_session: bool = False,
    ) -> LocalServer:
        """Starts `pie serve` as `start` does but returns at once (see `ready`, `wait_ready`).
        With `own_session` the child gets its own session: a Ctrl-C at the terminal reaches only
        its parent, which then stops it in the order it chooses."""
        command = [sys.executable, "-m", "pie.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        if model is not None:
            command += ["--model", str(model)]
        command += args
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else None,
            start_new_session=own_session,
        )
        return cls(process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        """The server's last lines of stderr, for error messages."""
        return "\n".join(list(self._log)[-lines:])

    def terminate(self) -> None:
        """Asks the server to stop (SIGTERM, once: a second would stop it at once)."""
        if self.process.poll() is None and not self._terminated:
            self.process.send_signal(signal.SIGTERM)
            self._terminated = True

    def join_reader(self, timeout: float = 5.0) -> None:
        """Waits until the ended server's last lines are read into `log_tail`."""
        self._reader.join(timeout)

    def stop(self, grace: float = 60.0) -> int:
        """SIGTERM, then the exit status; kills and raises TimeoutError past `grace` seconds."""
        self.terminate()
        try:
            code = self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"pie serve did not stop within {grace:g} s") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    @property
    def ready(self) -> bool:
        """Whether the server has announced its URL."""
        return self._ready.is_set()

    def wait_ready(self, timeout: float) -> None:
        """Returns once the server announced its URL; ServerExited or TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.process.poll() is not None:
                self._reader.join(2)  # its last words, for the error
                raise ServerExited(self.process.returncode, self.log_tail())
            if time.monotonic() > deadline:
                raise TimeoutError(f"pie serve did not start within {timeout:g} s")

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            line = line.rstrip()
            self._log.append(line)
            found = _SERVING.search(line)
            if found and not self._ready.is_set():
                self.url, self.model = found["url"], found["model"]
                self._ready.set()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.stop()


def mean_batch_between(before: EngineStatus, after: EngineStatus) -> float:
    """The mean batch size of the passes run between two statistics readings (the server only
    reports its lifetime mean)."""
    passes = after.passes - before.passes
    if passes <= 0:
        return 0.0
    requests = after.mean_batch_size * after.passes - before.mean_batch_size * before.passes
    return requests / passes
