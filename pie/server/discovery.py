"""What a load balancer in front of several nodes reads to learn what a node serves: GET
/server_info and /model_info, the SGLang router's model discovery (it reads the served model's
name from /server_info when it registers a node). Public: they name models, nothing else."""

from __future__ import annotations

import json
from collections.abc import Sequence

from pie import __version__
from pie.server.routes import Receive, Route, Scope, Send, refused_unless_get, respond


def discovery_routes(models: Sequence[str]) -> tuple[Route, ...]:
    """/server_info and /model_info for a node serving `models` (the default first)."""
    # No `model_path` or `tokenizer_path`: given one, the router tries to fetch that tokenizer
    # from the Hugging Face hub; it needs none to route OpenAI requests by their text.
    info = {
        "served_model_name": models[0],
        "models": list(models),
        "is_generation": True,
        "version": f"pie {__version__}",
    }
    body = json.dumps(info).encode()

    def page(path: str) -> Route:
        async def answer(scope: Scope, receive: Receive, send: Send, user: str | None) -> None:
            if not await refused_unless_get(scope, send, path):
                await respond(send, 200, body, "application/json")

        return Route(prefix=path, handler=answer, public=True)

    return (page("/server_info"), page("/model_info"))
