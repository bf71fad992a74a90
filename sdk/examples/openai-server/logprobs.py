"""Log-probabilities for the OpenAI responses: the generated (and, for `echo`, the prompt's)
tokens scored exactly in one extra pass over prompt and output (`inferlet.score_tokens`), with
the likeliest alternatives at each position. They are the model's own distribution, before
temperature, top-p and logit_bias, as in vLLM."""

from __future__ import annotations

from typing import Any

from inferlet import Context, TokenScore, score_tokens
from inferlet.serving import HttpError

MAX_TOP_CHAT = 20
MAX_TOP_COMPLETIONS = 5


def chat_top(body: dict[str, Any]) -> int | None:
    """None without `logprobs`; else how many alternatives each token lists (`top_logprobs`)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, False, True):
        raise HttpError(400, "logprobs: true or false")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise HttpError(400, f"top_logprobs: an integer from 0 to {MAX_TOP_CHAT}")
    if top is not None and not 0 <= top <= MAX_TOP_CHAT:
        raise HttpError(400, f"top_logprobs: an integer from 0 to {MAX_TOP_CHAT}")
    if top and not wanted:
        raise HttpError(400, "top_logprobs: needs logprobs set to true")
    return (top or 0) if wanted else None


async def score(model: Any, prompt: list[int], outputs: list[list[int]], top: int) -> list[Any]:
    """Per output: the scores of the prompt's tokens after the first, then the output's."""
    scorer = Context(model).fill_tokens(prompt[:1])
    try:
        return [await score_tokens(scorer, prompt[1:] + out, top) for out in outputs]
    finally:
        scorer.destroy()


def chat_content(model: Any, scores: list[TokenScore]) -> dict[str, Any]:
    """A choice's `logprobs` object in Chat Completions' shape."""
    texts = _texts(model, scores)

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = texts[token]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {
            **entry(s.token, s.logprob),
            "top_logprobs": [entry(t, lp) for t, lp in s.top],
        }
        for s in scores
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    model: Any, scores: list[TokenScore], first: int | None, offset: int
) -> dict[str, Any]:
    """`logprobs` in the legacy Completions shape; `first`, when given, is the echoed prompt's
    first token (which has no log-probability); text offsets start at `offset`."""
    texts = _texts(model, scores, [] if first is None else [first])
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if first is not None:
        tokens.append(texts[first])
        values.append(None)
        tops.append(None)
    for s in scores:
        tokens.append(texts[s.token])
        values.append(s.logprob)
        tops.append({texts[t]: lp for t, lp in s.top})
    offsets, cursor = [], offset
    for text in tokens:
        offsets.append(cursor)
        cursor += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _texts(model: Any, scores: list[TokenScore], more: list[int] | None = None) -> dict[int, str]:
    """The text of every token the scores name, from one vocabulary lookup."""
    ids = sorted(
        {s.token for s in scores} | {t for s in scores for t, _ in s.top} | set(more or [])
    )
    return dict(zip(ids, model.token_texts(ids), strict=True))
