"""The SGLang router (`sglang-router`, a Rust binary) as a child process in front of pie nodes'
OpenAI endpoints: started on a free loopback port, ready once every node is registered and
healthy, stopped with its whole process group."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence

from attrs import field, frozen

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
MODULE = "sglang_router"
PIN = "sglang-router==0.3.2"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RouterError(Exception):
    """The router could not be started, or did not come up; the message is one line."""


def _policy(_: object, attribute: object, value: str) -> None:
    if value not in POLICIES:
        raise ValueError(f"router policy {value!r}: one of {', '.join(POLICIES)}")


def _urls(urls: Iterable[str]) -> tuple[str, ...]:
    return tuple(urls)


def _workers(_: object, attribute: object, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("the router needs at least one worker URL")
    for url in value:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL {url!r}: give http://HOST:PORT")


@frozen(kw_only=True)
class RouterSettings:
    workers: tuple[str, ...] = field(converter=_urls, validator=_workers)
    """The nodes' HTTP fronts (http://HOST:PORT, without /v1)."""
    policy: str = field(default="cache_aware", validator=_policy)
    host: str = "127.0.0.1"
    port: int = 0
    """0: a free port on `host`."""
    health_endpoint: str = "/ready"
    """A node that is stopping answers 503 here, so the router stops sending it work."""
    health_interval_s: int = 2
    health_failures: int = 2
    """Failed health checks in a row before the router stops routing to a node."""
    start_timeout_s: float = 60.0
    stop_grace_s: int = 5
    """How long requests in flight may go on after `stop`."""


class RouterProcess:
    """`RouterProcess.start(settings)` returns once the router answers with every worker
    healthy; `stop()` ends it (SIGTERM, then SIGKILL past the grace) and its process group."""

    def __init__(self, process: subprocess.Popen[str], settings: RouterSettings, url: str) -> None:
        self.process = process
        self.settings = settings
        self.url = url
        """Where clients send OpenAI requests: `{url}/v1`."""
        self._log: collections.deque[str] = collections.deque(maxlen=200)
        # The pipe must be drained for the router's whole life, or its writes would block.
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, settings: RouterSettings) -> RouterProcess:
        if importlib.util.find_spec(MODULE) is None:
            raise RouterError(f"the SGLang router is not installed (pip install {PIN})")
        port = settings.port or _free_port(settings.host)
        process = subprocess.Popen(
            _command(settings, port, _free_port("127.0.0.1")),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own process group, stopped as one
        )
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        router = cls(process, settings, f"http://{host}:{port}")
        try:
            router._wait_ready()
        except BaseException:
            router.stop()
            raise
        return router

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(list(self._log)[-lines:])

    def workers(self) -> dict[str, bool]:
        """Each registered worker's URL and whether the router deems it healthy."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=5) as reply:
            listed = json.load(reply)["workers"]
        return {w["url"].rstrip("/"): bool(w["is_healthy"]) for w in listed}

    def remove_worker(self, url: str) -> bool:
        """Stops routing to the worker at `url` at once (rather than after its failed health
        checks); False when the router does not list it."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=5) as reply:
            listed = json.load(reply)["workers"]
        ids = [w["id"] for w in listed if w["url"].rstrip("/") == url.rstrip("/")]
        for worker in ids:
            request = urllib.request.Request(f"{self.url}/workers/{worker}", method="DELETE")
            urllib.request.urlopen(request, timeout=5).close()
        return bool(ids)

    def stop(self) -> int:
        """The router's exit status, once it and anything in its process group have ended."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(self.settings.stop_grace_s + 5)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)
        code = self.process.wait()
        self._reader.join(5)
        return code

    def _wait_ready(self) -> None:
        wanted = {url.rstrip("/") for url in self.settings.workers}
        deadline = time.monotonic() + self.settings.start_timeout_s
        healthy: set[str] = set()
        while healthy != wanted:
            if self.process.poll() is not None:
                raise RouterError(
                    f"the SGLang router exited with {self.process.returncode}: {self._failure()}"
                )
            if time.monotonic() > deadline:
                missing = ", ".join(sorted(wanted - healthy))
                raise RouterError(
                    f"the SGLang router did not see {missing} healthy within "
                    f"{self.settings.start_timeout_s:g} s"
                )
            time.sleep(0.2)
            with contextlib.suppress(OSError, ValueError, KeyError):
                healthy = {url for url, ok in self.workers().items() if ok}

    def _failure(self) -> str:
        """The line of the router's output that says why it stopped."""
        self._reader.join(2)
        lines = [line for line in self._log if line.strip()]
        said = [line for line in lines if line.startswith("Error starting router:")]
        return (said or lines or ["no output"])[-1]

    def _read_output(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._log.append(_ANSI.sub("", line.rstrip()))

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _command(settings: RouterSettings, port: int, metrics_port: int) -> list[str]:
    """The launcher's command line. Its Prometheus exporter (on by default, on all interfaces)
    gets a free loopback port: nothing new is reachable from outside."""
    return [
        sys.executable, "-m", f"{MODULE}.launch_router",
        "--host", settings.host,
        "--port", str(port),
        "--worker-urls", *settings.workers,
        "--policy", settings.policy,
        "--health-check-endpoint", settings.health_endpoint,
        "--health-check-interval-secs", str(settings.health_interval_s),
        "--health-failure-threshold", str(settings.health_failures),
        "--shutdown-grace-period-secs", str(settings.stop_grace_s),
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--log-level", "warn",
    ]  # fmt: skip


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _signal_group(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, number)


def start_router(workers: Sequence[str], policy: str = "cache_aware") -> RouterProcess:
    """A router on a free loopback port in front of `workers`."""
    return RouterProcess.start(RouterSettings(workers=tuple(workers), policy=policy))
