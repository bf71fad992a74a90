"""The pie inferlet SDK: models, contexts, forward passes and generation for Python inferlets.
Write `async def main(input)` in main.py and build it with `pie build`."""

from __future__ import annotations

from inferlet import http, mcp, messaging, runtime, session, speech
from inferlet.context import Context
from inferlet.errors import HostError
from inferlet.forward import AttentionWindow, Forward, runs
from inferlet.generation import Generation
from inferlet.grammar import Grammar, Matcher
from inferlet.media import Audio, Image, Video
from inferlet.model import Model, get_model, models
from inferlet.sampling import Distribution, Probe, Sampler
from inferlet.search import (
    Beam,
    Candidate,
    TokenScore,
    beam_search,
    best_of_n,
    score_tokens,
    token_logprobs,
)
from inferlet.speculative import Jacobi, PromptLookup, Speculation, speculate
from inferlet.speech import Speech, SpeechRequest
from inferlet.watermark import Watermark

__all__ = [
    "AttentionWindow",
    "Audio",
    "Beam",
    "Candidate",
    "Context",
    "Distribution",
    "Forward",
    "Generation",
    "Grammar",
    "HostError",
    "Image",
    "Jacobi",
    "Matcher",
    "Model",
    "Probe",
    "PromptLookup",
    "Sampler",
    "Speculation",
    "Speech",
    "SpeechRequest",
    "TokenScore",
    "Video",
    "Watermark",
    "beam_search",
    "best_of_n",
    "get_model",
    "http",
    "mcp",
    "messaging",
    "models",
    "runs",
    "runtime",
    "score_tokens",
    "session",
    "speculate",
    "speech",
    "token_logprobs",
]
