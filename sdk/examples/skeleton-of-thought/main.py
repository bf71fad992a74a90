"""Skeleton-of-thought: the model writes a short outline, then every point is expanded in a
branch forked off the context that holds the outline; the branches share its pages and decode
together in the same passes."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from inferlet import Context, get_model

POINT = re.compile(r"^\s*(?:\d+[.)]|[-*])\s*(.+?)\s*$")


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    points_wanted = int(input.get("points", 3))
    ctx = Context(model)
    ctx.system("You answer with short, numbered outlines.")
    ctx.user(f"{input['question']}\nGive an outline of {points_wanted} numbered points.").cue()
    outline = await ctx.generate(max_tokens=int(input.get("outline_tokens", 60))).collect_text()
    points = parse_points(outline)[:points_wanted] or [outline.strip()]
    branches = [ctx.fork().user(f"Expand point {i + 1}: {p}").cue() for i, p in enumerate(points)]
    expansions = await asyncio.gather(
        *(
            b.generate(max_tokens=int(input.get("point_tokens", 48))).collect_text()
            for b in branches
        )
    )
    return {"outline": outline, "points": points, "expansions": list(expansions)}


def parse_points(outline: str) -> list[str]:
    return [m.group(1) for line in outline.splitlines() if (m := POINT.match(line))]
