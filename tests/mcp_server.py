"""A small MCP server for the tests, built on the mcp package's own server: run it as
`python tests/mcp_server.py` (stdio) or `python tests/mcp_server.py --http PORT`. When
$MCP_TEST_PID_FILE is set it writes its process id there first."""

from __future__ import annotations

import os
import sys

import anyio
from mcp import MCPError
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("pie-test-tools", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Returns its text."""
    return text


@server.tool()
def fail(reason: str) -> str:
    """Always fails, saying why."""
    raise ToolError(reason)


@server.tool()
def refuse() -> str:
    """Answers with a protocol error instead of a result."""
    raise MCPError(-32602, "refused on purpose")


@server.tool()
async def sleep(seconds: float) -> str:
    """Answers after a while."""
    await anyio.sleep(seconds)
    return "awake"


_released = anyio.Event()


@server.tool()
async def hold() -> str:
    """Answers once `release` has been called."""
    await _released.wait()
    return "released"


@server.tool()
def release() -> str:
    """Lets every `hold` call answer."""
    _released.set()
    return "done"


@server.tool()
def crash() -> str:
    """Ends the server process at once."""
    os._exit(3)


@server.tool()
def env(name: str) -> str:
    """The value of one of the server's environment variables."""
    return os.environ.get(name, "")


@server.tool()
def header(name: str, ctx: Context) -> str:
    """The value of one header of the HTTP request that carried this call."""
    request = ctx.request_context.request
    return "" if request is None else request.headers.get(name, "")


def main() -> None:
    pid_file = os.environ.get("MCP_TEST_PID_FILE")
    if pid_file:
        with open(pid_file, "a", encoding="utf-8") as out:
            out.write(f"{os.getpid()}\n")
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()


if __name__ == "__main__":
    main()
