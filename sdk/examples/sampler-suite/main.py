"""One forward pass over a short prompt that reads the last position with every sampler and
every probe, as one slot each."""

from __future__ import annotations

from typing import Any

from inferlet import Context, Distribution, Probe, Sampler, get_model

SAMPLERS = {
    "argmax": Sampler.argmax(),
    "multinomial": Sampler.multinomial(temperature=1.0, seed=1),
    "top_k": Sampler.top_k(5, temperature=1.0, seed=2),
    "top_p": Sampler.top_p(0.9, temperature=0.7, seed=3),
    "min_p": Sampler.min_p(0.1, temperature=1.0, seed=4),
    "top_k_top_p": Sampler.top_k_top_p(10, 0.9, temperature=0.8, seed=5),
}


async def main(input: dict[str, Any] | str) -> dict[str, Any]:
    request = {"prompt": input} if isinstance(input, str) else input
    model = get_model()
    tokens = model.encode(request.get("prompt", "The capital of France is"))
    candidates = [model.encode(w)[0] for w in request.get("candidates", [" Paris", " London"])]
    last = len(tokens) - 1
    with Context(model) as ctx:
        fwd = ctx.forward().input(tokens)
        for sampler in SAMPLERS.values():
            fwd.sample([last], sampler)
        fwd.probe([last], Probe.distribution(5))
        fwd.probe([last], Probe.raw_logits())
        fwd.probe([last], Probe.logprobs(candidates))
        fwd.probe([last], Probe.entropy())
        outputs = await fwd.execute()
    picked, (dist, logits, logprobs, entropy) = outputs[: len(SAMPLERS)], outputs[len(SAMPLERS) :]
    assert isinstance(dist, Distribution) and isinstance(logits, list)
    assert isinstance(logprobs, list) and isinstance(entropy, float)
    return {
        "samplers": {
            name: {"token": token, "text": model.decode([token])}
            for name, token in zip(SAMPLERS, picked, strict=True)
        },
        "distribution": {
            "tokens": dist.tokens,
            "probs": dist.probs,
            "texts": model.token_texts(dist.tokens),
        },
        "raw_logits": {
            "length": len(logits),
            "argmax": max(range(len(logits)), key=logits.__getitem__),
        },
        "logprobs": {"tokens": candidates, "values": logprobs},
        "entropy": entropy,
    }
