"""A `redis-server` child process for `pie cluster up`: on a loopback port, in a folder of its
own, writing every command to its append-only file before answering (fsync always), so that
nothing a node was told is stored is lost when Redis restarts."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

INSTALL = "apt-get install redis-server"


class RedisProcessError(Exception):
    """redis-server could not be started; the message is one line."""


class RedisProcess:
    """`start()` returns once Redis answers PING (after loading its append-only file);
    `stop()` ends it with SIGTERM (SIGKILL past the grace). It can be started again on the same
    port and folder, which is a restart that keeps its data."""

    def __init__(self, folder: Path, port: int, host: str = "127.0.0.1") -> None:
        self.folder = folder
        self.port = port
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.folder / "redis.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exit_code(self) -> int | None:
        """None while it runs (or was never started)."""
        return self.process.poll() if self.process is not None else None

    def start(self, timeout: float = 60.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisProcessError(f"redis-server is not installed ({INSTALL})")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, *self._arguments()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches the parent, which stops Redis last
        )
        try:
            self._wait_answering(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait()

    def _arguments(self) -> list[str]:
        return [
            "--port", str(self.port),
            "--bind", self.host,
            "--protected-mode", "yes",
            "--dir", str(self.folder),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--logfile", str(self.log_file),
        ]  # fmt: skip

    def _wait_answering(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RedisProcessError(
                    f"redis-server exited with {self.process.returncode} at start: "
                    f"{self._last_log_line()}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        raise RedisProcessError(f"redis-server did not answer on port {self.port} in {timeout:g} s")

    def _answers(self) -> bool:
        # A Redis still loading its append-only file answers -LOADING, not +PONG.
        with contextlib.suppress(OSError):
            with socket.create_connection((self.host, self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        return False

    def _last_log_line(self) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        said = [line.strip() for line in lines if line.strip()]
        return said[-1] if said else "no log"


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
