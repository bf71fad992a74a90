"""Log-probabilities for the OpenAI responses: the generated (and, for `echo`, the prompt's)
tokens scored exactly by extra passes on a fork of the prompt (`Scorer`), with the likeliest
alternatives at each position; streamed, each piece is scored as it arrives. They are the
model's own distribution, before temperature, top-p and logit_bias, as in vLLM."""

from __future__ import annotations

import asyncio
from typing import Any

from inferlet import Context, Probe, TokenScore
from inferlet.search import token_score
from inferlet.serving import HttpError

MAX_TOP_CHAT = 20
MAX_TOP_COMPLETIONS = 5
BLOCK = 128
"""Tokens scored per pass: two probe slots each stay within the engine's slots per pass."""


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


class Scorer:
    """Scores tokens as they arrive, on a fork of a context (sharing its pages): each `take`
    feeds what is not written yet, reads the log-probabilities of the new tokens and writes
    them, so every token is fed once, whether a choice is scored piece by piece while it streams
    or whole at its end. Passes hold at most BLOCK tokens, two probes each."""

    def __init__(self, prefix: Context, top: int) -> None:
        self.ctx = prefix.fork()
        self.top = top
        self.feed = self.ctx.feed_for_generation()
        self.scored = 0

    async def take(self, tokens: list[int]) -> list[TokenScore]:
        """The scores of `tokens` past those taken before."""
        new, self.scored = tokens[self.scored :], len(tokens)
        scores: list[TokenScore] = []
        for start in range(0, len(new), BLOCK):
            scores += await self._pass(new[start : start + BLOCK])
        return scores

    async def _pass(self, new: list[int]) -> list[TokenScore]:
        fwd = self.ctx.forward().input(self.feed + new[:-1])
        for i, token in enumerate(new):
            fwd.probe([i], Probe.logprobs([token]))
            if self.top:
                fwd.probe([i], Probe.distribution(self.top))
        outputs = await fwd.execute()
        self.feed = new[-1:]
        step = 2 if self.top else 1
        return [token_score(t, outputs[i * step : (i + 1) * step]) for i, t in enumerate(new)]

    def close(self) -> None:
        self.ctx.destroy()


async def finished(scorers: list[Scorer], generations: list[Any]) -> list[list[TokenScore]]:
    """The scores of each finished generation, by the scorer forked for it."""
    pairs = zip(scorers, generations, strict=True)
    return list(await asyncio.gather(*(s.take(g.tokens) for s, g in pairs)))


async def prompt_scores(model: Any, prompt: list[int], top: int) -> list[TokenScore]:
    """The scores of the prompt's tokens after the first (for `echo`)."""
    with Context(model) as first:
        scorer = Scorer(first.fill_tokens(prompt[:1]), top)
        try:
            return await scorer.take(prompt[1:])
        finally:
            scorer.close()


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


def chat_chunk(model: Any, scores: list[TokenScore]) -> dict[str, Any] | None:
    """A streamed chunk's `logprobs`: those of the tokens that arrived with it."""
    return chat_content(model, scores) if scores else None


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


def joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two legacy `logprobs` objects, one after the other (an echoed prompt, then the output)."""
    return {key: first[key] + then[key] for key in first}


def _texts(model: Any, scores: list[TokenScore], more: list[int] | None = None) -> dict[int, str]:
    """The text of every token the scores name, from one vocabulary lookup."""
    ids = sorted(
        {s.token for s in scores} | {t for s in scores for t, _ in s.top} | set(more or [])
    )
    return dict(zip(ids, model.token_texts(ids), strict=True))
