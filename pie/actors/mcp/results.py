"""Between the MCP client's models and pie's events: tool listings and call results become
events (content as JSON text plus a plain-text rendering), and a call's JSON arguments are
checked. Pure functions; failures are `McpFailure`s with the kind the inferlet sees."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pie.events.mcp import McpTool, McpToolCalled

if TYPE_CHECKING:
    import mcp_types


class McpFailure(Exception):
    """A request the mcp actor answers with `RequestFailed(kind, message)`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def parse_arguments(text: str) -> dict[str, Any]:
    """A call's arguments: JSON text of an object (empty text means no arguments)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise McpFailure("invalid", f"the arguments are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise McpFailure(
            "invalid", f"the arguments must be a JSON object, got {type(value).__name__}"
        )
    return value


def tool_event(tool: mcp_types.Tool) -> McpTool:
    return McpTool(
        name=tool.name,
        description=tool.description or "",
        input_schema=json.dumps(tool.input_schema),
    )


def called_event(corr: int, result: mcp_types.CallToolResult, max_bytes: int) -> McpToolCalled:
    blocks = [
        block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content
    ]
    content = json.dumps(blocks)
    structured = (
        None if result.structured_content is None else json.dumps(result.structured_content)
    )
    size = len(content) + len(structured or "")
    if size > max_bytes:
        raise McpFailure(
            "too-large", f"the tool's result is {size} bytes, over the engine's {max_bytes}"
        )
    return McpToolCalled(
        corr=corr,
        content=content,
        text="\n".join(render(block) for block in result.content),
        structured=structured,
        is_error=result.is_error,
    )


def render(block: mcp_types.ContentBlock) -> str:
    """One content block as text: text as is, anything else named in brackets."""
    import mcp_types  # loaded already by the link that fetched the block

    match block:
        case mcp_types.TextContent():
            return block.text
        case mcp_types.ImageContent() | mcp_types.AudioContent():
            return f"[{block.type}: {block.mime_type}]"
        case mcp_types.EmbeddedResource(resource=mcp_types.TextResourceContents() as resource):
            return resource.text
        case mcp_types.EmbeddedResource():
            return f"[resource: {block.resource.uri}]"
        case _:
            return f"[resource: {block.uri}]"
