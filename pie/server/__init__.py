"""The edges: the WebSocket protocol (messages and frames)."""
