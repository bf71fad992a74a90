"""The mcp actor: inferlets' MCP tool listings and calls, run on the Trio thread against the
servers the operator configured."""

from pie.actors.mcp.actor import McpActor, McpServerStatistics, McpStatistics

__all__ = ["McpActor", "McpServerStatistics", "McpStatistics"]
