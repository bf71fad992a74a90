"""A client that breaks its own HTTP connection breaks nothing else: cleartext HTTP/2 connections
closed right after their request (as the SGLang router's gRPC probe does) once stopped the whole
HTTP front, and `pie serve` with it; now the front serves on."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import h2.config
import h2.connection
import httpx
import pytest

from pie.client.local import LocalServer
from tests.model_fixtures import default_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.security


def abandon_http2(port: int) -> None:
    """Opens a cleartext HTTP/2 connection, sends one gRPC-style request and closes at once."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    headers = [
        (":method", "POST"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":scheme", "http"),
        (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    connection.send_headers(1, headers)
    connection.send_data(1, b"\x00" * 5, end_stream=True)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(connection.data_to_send())


def abandon_many(port: int, count: int) -> None:
    threads = [threading.Thread(target=abandon_http2, args=(port,)) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_abandoned_http2_connections_leave_pie_serve_serving(
    tmp_path: Path,
    default_model_dir: Path,  # noqa: F811
) -> None:
    config = tmp_path / "pie.toml"
    config.write_text(f'[kv]\nnum_pages = 16\n[server]\nprograms_dir = "{tmp_path}/programs"\n')
    args = ["--config", str(config), "--http", "0"]
    with LocalServer.start(default_model_dir, args=args, timeout=300) as server:
        found = re.search(r"pie: HTTP on (http://\S+),", server.log_tail(50))
        assert found, server.log_tail()
        url = found[1]
        for _ in range(3):
            abandon_many(int(url.rsplit(":", 1)[1]), 30)
            time.sleep(0.2)
        reply = httpx.get(f"{url}/health", timeout=30)
        assert server.process.poll() is None, server.log_tail()
    assert reply.json() == {"status": "ok"}
