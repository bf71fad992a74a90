"""Generates a long text in bounded KV memory: attention sinks (the first pages) plus a sliding
window over the last pages, releasing the pages that leave the window as the generation goes.
It streams the generation and reports how many KV pages the context held along the way.
`"mode": "score"` reads a given text through the same window instead (one page per pass) and
reports the mean log-probability the model gave each next token: how much the window costs."""

from __future__ import annotations

from typing import Any

from inferlet import AttentionWindow, Context, Model, Probe, Sampler, get_model


async def main(input: dict[str, Any]) -> dict[str, Any]:
    model = get_model()
    window = None
    if input.get("window", True):
        window = AttentionWindow.tokens(
            model, int(input.get("window_tokens", 256)), int(input.get("sink_tokens", 4))
        )
    if input.get("mode") == "score":
        return await score(model, input["text"], window)
    sampler = Sampler.top_p(
        float(input.get("top_p", 0.95)),
        temperature=float(input.get("temperature", 0.8)),
        seed=input.get("seed"),
    )
    with Context(model) as ctx:
        if input.get("chat", False):
            ctx.user(input["prompt"]).cue()
        else:
            ctx.fill(input["prompt"])
        generation = ctx.generate(
            sampler,
            max_tokens=int(input.get("max_tokens", 4000)),
            # A long run is the point: end only at the length unless asked to stop.
            stop_tokens=None if input.get("stop", False) else (),
            deliver_every=int(input.get("report_every", 64)),
            window=window,
        )
        held: list[int] = []
        async for _ in generation:
            held.append(ctx.info().pages)
        info = ctx.info()
    return {
        "text": generation.text,
        "tokens": len(generation.tokens),
        "stop_reason": generation.stop_reason,
        "pages_held": held,
        "released_pages": len(info.released_pages),
        "window_pages": None if window is None else window.window_pages,
        "sink_pages": None if window is None else window.sink_pages,
        "page_size": model.page_size,
    }


async def score(model: Model, text: str, window: AttentionWindow | None) -> dict[str, Any]:
    """Feeds the text a page at a time, each pass probing the log-probability of every next
    token; the mean over the tokens after the first page, and the most pages held."""
    tokens = model.encode(text)
    size = model.page_size
    logprobs: list[float] = []
    held = 0
    with Context(model) as ctx:
        for start in range(0, len(tokens) - 1, size):
            chunk = tokens[start : start + size]
            following = tokens[start + 1 : start + size + 1]
            fwd = ctx.forward().input(chunk)
            if window is not None:
                fwd.window(window)
            for i, token in enumerate(following):
                fwd.probe([i], Probe.logprobs([token]))
            outputs = await fwd.execute()
            if start >= size:
                logprobs.extend(float(out[0]) for out in outputs)  # type: ignore[index]
            held = max(held, ctx.info().pages)
    return {
        "tokens": len(tokens),
        "mean_logprob": sum(logprobs) / max(1, len(logprobs)),
        "max_pages_held": held,
    }
