"""What a node tells the cluster about itself (its URLs, models and load) and the JSON it is
kept as in Redis; no Redis and no engine here."""

from __future__ import annotations

import json
from typing import Any

import attrs
from attrs import frozen

NODE_KEY_PREFIX = "pie:node:"
"""A node's record lives at NODE_KEY_PREFIX + its id, with an expiry that it renews."""
NODES_INDEX = "pie:nodes"
"""A set of the ids that registered; an id whose record has expired is dropped when read."""


class RecordError(ValueError):
    """A node record in Redis that is not one pie wrote."""


@frozen(kw_only=True)
class NodeLoad:
    """How busy a node is, read from its engine's statistics() at each renewal."""

    inferlets: int = 0
    """Inferlets running or waiting for admission."""
    free_pages: int = 0
    """Free KV pages, all served models together."""
    queued_passes: int = 0
    """Requests waiting for a forward pass, all served models together."""


@frozen(kw_only=True)
class NodeRecord:
    node_id: str
    ws_url: str
    http_url: str = ""
    """Empty when the node serves no HTTP front."""
    models: tuple[str, ...] = ()
    load: NodeLoad = NodeLoad()
    started_at: float = 0.0
    """Unix time the node joined."""
    renewed_at: float = 0.0
    """Unix time of the renewal that wrote this record."""

    @property
    def key(self) -> str:
        return node_key(self.node_id)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)  # tuples become lists, as JSON has them

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeRecord:
        try:
            data = json.loads(text)
            load = NodeLoad(**data.pop("load"))
            data["models"] = tuple(data["models"])
            return cls(load=load, **data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RecordError(f"not a pie node record: {exc}") from None


def node_key(node_id: str) -> str:
    return NODE_KEY_PREFIX + node_id
