"""Turn an HF config.json dict into the `ModelConfig` our model files read."""

from __future__ import annotations

from typing import Any

from pie.drivers.models import MODEL_REGISTRY, ModelConfig
from pie.drivers.models.layers import SUPPORTED_ROPE_TYPES


def model_config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Validate and normalise config.json; ValueError names what is unsupported."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {sorted(MODEL_REGISTRY)}"
        )
    model_cls = MODEL_REGISTRY[model_type]
    raw = model_cls.flat_hf_config(raw)
    # A key the file leaves out takes the architecture's default; one it sets to null is unset
    # (Qwen3's `head_dim: null` means hidden_size / heads, Mistral's `sliding_window: null`
    # means full attention), as in transformers' config classes.
    raw = {k: v for k, v in {**model_cls.hf_defaults, **raw}.items() if v is not None}
    model_cls.check_hf_config(raw)
    num_heads = raw["num_attention_heads"]
    rope_theta, rope_scaling = _rope(raw, (*SUPPORTED_ROPE_TYPES, *model_cls.rope_types))
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        raw=raw,
    )


def _rope(raw: dict[str, Any], supported: tuple[str, ...]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from either `rope_parameters` (transformers 5) or the
    older top-level `rope_theta` plus `rope_scaling` (whose type key may be `type`)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type not in supported:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {list(supported)}")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
