"""MCP tools: an inferlet's requests to the mcp actor (which servers, which tools, call one) and
the answers. A request that gets no answer (an unknown server or tool, a server that cannot
start, a timeout) is answered with a `RequestFailed` of that kind."""

from __future__ import annotations

from attrs import frozen


@frozen(kw_only=True)
class McpListServers:
    corr: int
    requester: str
    user: str


@frozen(kw_only=True)
class McpServerList:
    corr: int
    servers: tuple[str, ...]
    """The configured servers `user` may use, in config order."""


@frozen(kw_only=True)
class McpListTools:
    corr: int
    requester: str
    user: str
    server: str


@frozen(kw_only=True)
class McpTool:
    name: str
    description: str
    input_schema: str
    """The JSON Schema of the tool's arguments, as JSON text."""


@frozen(kw_only=True)
class McpToolList:
    corr: int
    server: str
    tools: tuple[McpTool, ...]


@frozen(kw_only=True)
class McpCallTool:
    corr: int
    requester: str
    user: str
    server: str
    tool: str
    arguments: str
    """A JSON object, as text."""
    timeout_seconds: float | None = None
    """None: the operator's `mcp.timeout_seconds` (also the most a call may ask)."""


@frozen(kw_only=True)
class McpToolCalled:
    corr: int
    content: str
    """The result's content blocks as a JSON array (MCP's own shape: text, image, audio,
    resource_link, resource)."""
    text: str
    """The content for people and models: text blocks joined by newlines, others named."""
    structured: str | None = None
    """The result's structured content (a JSON object, as text), when the tool gave one."""
    is_error: bool = False
    """The tool ran and reported a failure; `content` says what went wrong."""
