"""CSM text to speech (Sesame's Conversational Speech Model, HF model_type "csm"): a Llama
backbone over text tokens and audio frames picks each frame's first codebook, a small depth
decoder picks the others, and the Mimi decoder turns the frames into audio.

The interface of a speaking model: `speaks = True`; `voices()` the speaker ids it accepts;
`prompt_ids(text, speaker, tokenize)` the prompt CsmProcessor's chat template builds for one
text-only turn (`<bos>[speaker]text<eos>`, tokenized as one string, no special tokens added);
`speak(token_ids, max_frames, greedy)` -> (codes [frames, num_codebooks] int64, SpeechClip), or
the same loop as an `Utterance` (`utterance(...)`) stepped one frame at a time, then `to_speech`.

How `speak`'s loop maps onto engine passes (it runs here with its own dense attention for now):
1. The prompt is one ordinary prefill pass of the backbone (`forward` over text tokens); the last
   row's `compute_logits` gives frame 0's first codebook.
2. The depth decoder then runs num_codebooks - 1 one-token steps seeded by that row's hidden
   state, with its own KV of at most num_codebooks positions, dropped after the frame: a sampler
   a driver can run inside the pass, batched over every request (they all take the same steps).
3. Each later frame is one backbone decode pass of one token: `audio_token_id`, whose input
   embedding is replaced (a `MediaRows` row, as soft tokens are) by the sum of the previous
   frame's codebook embeddings (`embed_frame`), at the next position.
4. An utterance ends after max_frames frames or at a frame whose codebooks but the last are all
   `codebook_eos_token_id` (transformers' rule; that frame is kept in the codes); the frames
   before the first all-eos frame are decoded to samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pie.drivers.models.base import AttentionFn, CausalLM, ModelConfig, register
from pie.drivers.models.csm_utterance import FrameSampling, GrowingCache, Utterance
from pie.drivers.models.layers import TORCH_KERNELS, LayerKernels, RMSNorm, RotaryEmbedding
from pie.drivers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from pie.drivers.models.media import MediaRows, sequential_index
from pie.drivers.models.mimi import MimiConfig, MimiDecoder
from pie.media.speech import SpeechClip

SPEAKERS = (0, 1)
"""The speaker ids offered: a CSM prompt marks each turn `[n]`, and Sesame's examples use 0 and 1
for the two sides of a conversation."""
BOS_TEXT, EOS_TEXT = "<|begin_of_text|>", "<|end_of_text|>"
"""The bos and eos strings of CSM's (Llama 3) tokenizer, which its chat template writes."""


class FrameEmbeddings(nn.Module):
    """A frame's codes [T, C] -> the sum of each codebook's embedding [T, hidden]; codebook c's
    entries sit at rows c * vocab_size onward of one table."""

    offsets: torch.Tensor

    def __init__(self, num_codebooks: int, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embed_audio_tokens = nn.Embedding(num_codebooks * vocab_size, hidden_size)
        offsets = torch.arange(num_codebooks, dtype=torch.int64) * vocab_size
        self.register_buffer("offsets", offsets, persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embed_audio_tokens(codes + self.offsets).sum(dim=1)


class CsmStack(nn.Module):
    """Llama decoder layers and the final norm over given input embeddings."""

    kernels: LayerKernels = TORCH_KERNELS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, LlamaAttention) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.for_config(config)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        rope = self.kernels.rope(positions, self.rotary_emb)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attention)
        assert residual is not None
        return self.norm.add_forward(hidden, residual)[0]


class Backbone(CsmStack):
    """The backbone's stack, with the table that embeds a frame's codes."""

    def __init__(self, config: ModelConfig, num_codebooks: int) -> None:
        super().__init__(config)
        self.embed_tokens = FrameEmbeddings(num_codebooks, config.vocab_size, config.hidden_size)


class DepthModel(CsmStack):
    """The depth decoder's stack: its inputs (backbone-width embeddings) projected to its width."""

    def __init__(self, config: ModelConfig, num_codebooks: int, backbone_size: int) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(num_codebooks * config.vocab_size, backbone_size)
        self.inputs_embeds_projector = nn.Linear(backbone_size, config.hidden_size, bias=False)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        return super().forward(self.inputs_embeds_projector(embeds), positions, attention)


class CodebooksHead(nn.Module):
    """One output projection [hidden, vocab] per codebook after the first."""

    def __init__(self, count: int, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, config.hidden_size, config.vocab_size))


class DepthDecoder(nn.Module):
    """Codebooks 1.. of a frame, from the backbone's hidden state and codebook 0: position 0
    holds the hidden state, position c the code of codebook c - 1, and head c - 1 reads
    position c's output."""

    def __init__(self, config: ModelConfig, num_codebooks: int, backbone_size: int) -> None:
        super().__init__()
        self.vocab_size, self.num_codebooks = config.vocab_size, num_codebooks
        self.model = DepthModel(config, num_codebooks, backbone_size)
        self.codebooks_head = CodebooksHead(num_codebooks - 1, config)

    def frame(
        self, first: torch.Tensor, backbone_hidden: torch.Tensor, sampling: FrameSampling
    ) -> torch.Tensor:
        """first: 0-d code of codebook 0; backbone_hidden [backbone_size] -> codes [C]."""
        cache, codes = GrowingCache(), [first]
        embeds = torch.stack((backbone_hidden, self.model.embed_tokens(first)))
        for book in range(1, self.num_codebooks):
            if book > 1:
                embeds = self.model.embed_tokens(codes[-1] + (book - 1) * self.vocab_size)[None]
            positions = torch.arange(book + 1 - len(embeds), book + 1, device=embeds.device)
            hidden = self.model(embeds, positions, cache)[-1]
            codes.append(sampling.pick(hidden @ self.codebooks_head.weight[book - 1]))
        return torch.stack(codes)


@register("csm")
class CsmForConditionalGeneration(CausalLM):
    """The backbone is this CausalLM (text tokens in, first-codebook logits out); the depth
    decoder and the codec hang off it."""

    speaks = True
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config, raw = config, config.raw
        size, vocab, books = config.hidden_size, config.vocab_size, raw["num_codebooks"]
        self.num_codebooks, self.audio_token_id = books, raw["audio_token_id"]
        self.codebook_eos_token_id = raw.get("codebook_eos_token_id", 0)
        self.embed_text_tokens = nn.Embedding(raw["text_vocab_size"], size)
        self.backbone_model = Backbone(config, books)
        self.lm_head = nn.Linear(size, vocab, bias=False)
        self.depth_decoder = DepthDecoder(depth_config(raw), books, size)
        self.tied = bool(raw.get("tie_codebooks_embeddings", True))
        if self.tied:
            self.depth_decoder.model.embed_tokens.weight = self.frame_table.weight
        self.codec_model = MimiDecoder(MimiConfig.from_hf(raw["codec_config"]))

    @classmethod
    def flat_hf_config(cls, raw: dict[str, Any]) -> dict[str, Any]:
        # CSM's tie_word_embeddings ties the two codebook tables, never lm_head.
        return {**raw, "tie_word_embeddings": False}

    @classmethod
    def check_hf_config(cls, raw: dict[str, Any]) -> None:
        super().check_hf_config(raw)
        for key in ("depth_decoder_config", "codec_config"):
            if not isinstance(raw.get(key), dict):
                raise ValueError(f"csm: config.json has no {key}")
        depth = raw["depth_decoder_config"]
        try:
            super().check_hf_config(depth)
            codec = MimiConfig.from_hf(raw["codec_config"])
        except ValueError as e:
            raise ValueError(f"csm: {e}") from None
        books = raw["num_codebooks"]
        if depth.get("num_codebooks", books) != books or codec.num_quantizers < books:
            raise ValueError(f"csm: {books} codebooks, not matched by the depth decoder or codec")

    @property
    def frame_table(self) -> nn.Embedding:
        return self.backbone_model.embed_tokens.embed_audio_tokens

    def ignores_weight(self, name: str) -> bool:
        # The codec's encoder half and quantizer input projections: decoding never reads them.
        return name.startswith("codec_model.") and not MimiDecoder.reads_weight(name[12:])

    def route_weight(self, name: str) -> tuple[str, str | int | None] | None:
        if self.tied and name == "depth_decoder.model.embed_tokens.weight":
            # One table under two names; checkpoints store it under either.
            return "backbone_model.embed_tokens.embed_audio_tokens.weight", None
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        media: MediaRows | None = None,
    ) -> torch.Tensor:
        """Text tokens [T] -> backbone hidden states [T, hidden]; `media` rows (audio frames:
        `embed_frame`) replace those tokens' input embeddings."""
        hidden = self.embed_text_tokens(input_ids)
        if media is not None:
            hidden = media.into(hidden)
        return self.backbone_model(hidden, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of each row's next frame's first codebook [N, vocab_size]."""
        return self.lm_head(hidden).float()

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [T, num_codebooks] -> the backbone's input embeddings of those frames."""
        return self.backbone_model.embed_tokens(codes)

    def voices(self) -> tuple[int, ...]:
        return SPEAKERS

    def prompt_ids(
        self,
        text: str,
        speaker: int,
        tokenize: Callable[[str], Sequence[int]],
        bos: str = BOS_TEXT,
        eos: str = EOS_TEXT,
    ) -> list[int]:
        """The token ids CsmProcessor.apply_chat_template gives one text-only turn; `tokenize`
        turns text into ids, matching special-token strings and adding none."""
        if speaker not in self.voices():
            raise ValueError(f"csm: unknown speaker {speaker!r}; voices: {list(self.voices())}")
        return list(tokenize(f"{bos}[{speaker}]{text}{eos}"))

    def speak(
        self,
        token_ids: Sequence[int],
        max_frames: int,
        greedy: bool = True,
        sampling: FrameSampling | None = None,
    ) -> tuple[torch.Tensor, SpeechClip]:
        """Speech for a prompt (`prompt_ids`): codes [frames, num_codebooks] int64 on the CPU
        and the decoded clip. Not greedy: `sampling`, by default FrameSampling(greedy=False)."""
        utterance = self.utterance(token_ids, max_frames, greedy, sampling)
        while not utterance.step():
            pass
        codes = utterance.codes()
        return codes, self.to_speech(codes)

    def utterance(
        self,
        token_ids: Sequence[int],
        max_frames: int,
        greedy: bool = True,
        sampling: FrameSampling | None = None,
    ) -> Utterance:
        """`speak`'s loop as a state to step: checked here, computed by `Utterance.step`."""
        self._check_request(token_ids, max_frames)
        sampling = FrameSampling() if greedy else (sampling or FrameSampling(greedy=False))
        return Utterance(self, list(token_ids), max_frames, sampling)

    @property
    def frame_rate(self) -> float:
        """Code frames a second of audio."""
        return self.codec_model.config.code_frame_rate

    @property
    def max_positions(self) -> int:
        """Prompt tokens and frames one utterance may hold together."""
        return self.config.max_position_embeddings

    def to_speech(self, codes: torch.Tensor) -> SpeechClip:
        """The clip of codes [frames, num_codebooks], up to the first all-eos frame."""
        ended = (codes == self.codebook_eos_token_id).all(dim=1).nonzero()
        kept = codes[: int(ended[0, 0])] if len(ended) else codes
        with torch.inference_mode():
            samples = self.codec_model.decode(kept.to(self.lm_head.weight.device))
        rate = self.codec_model.config.sampling_rate
        return SpeechClip(samples=samples.cpu().numpy(), sample_rate=rate)

    def _frame(self, hidden: torch.Tensor, sampling: FrameSampling) -> torch.Tensor:
        first = sampling.pick(self.compute_logits(hidden[None])[0])
        return self.depth_decoder.frame(first, hidden, sampling)

    def _frame_pass(self, frame: torch.Tensor, position: int, cache: GrowingCache) -> torch.Tensor:
        """One backbone pass over a frame's embedding -> its hidden state [hidden]."""
        device = frame.device
        rows = MediaRows(
            rows=torch.zeros(1, dtype=torch.int64, device=device),
            embeds=self.embed_frame(frame[None]),
            rope_index=sequential_index(1),
        )
        ids = torch.tensor([self.audio_token_id], device=device)
        return self(ids, torch.tensor([position], device=device), cache, rows)[-1]

    def _ends_speech(self, frame: torch.Tensor) -> bool:
        return bool((frame[:-1] == self.codebook_eos_token_id).all())

    def _check_request(self, token_ids: Sequence[int], max_frames: int) -> None:
        if max_frames < 1:
            raise ValueError(f"csm: max_frames must be at least 1, got {max_frames}")
        if not token_ids:
            raise ValueError("csm: empty prompt")
        vocab = self.embed_text_tokens.num_embeddings
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"csm: prompt token ids must lie in [0, {vocab})")
        if self.audio_token_id in token_ids:
            raise ValueError("csm: audio context in the prompt is not implemented")
        limit = self.config.max_position_embeddings
        if len(token_ids) + max_frames > limit:
            total = f"{len(token_ids)} prompt tokens + {max_frames} frames"
            raise ValueError(f"csm: {total} exceed {limit} positions")


def depth_config(raw: dict[str, Any]) -> ModelConfig:
    """The depth decoder's facts from CSM's `depth_decoder_config`, transformers' defaults for
    keys it leaves out."""
    depth = {k: v for k, v in raw["depth_decoder_config"].items() if v is not None}
    heads, size = depth.get("num_attention_heads", 8), depth.get("hidden_size", 1024)
    rope = dict(depth.get("rope_parameters") or depth.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", depth.get("rope_theta", 500000.0)))
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    return ModelConfig(
        model_type="csm_depth_decoder_model",
        vocab_size=depth.get("vocab_size", 2051),
        hidden_size=size,
        intermediate_size=depth.get("intermediate_size", 8192),
        num_layers=depth.get("num_hidden_layers", 4),
        num_heads=heads,
        num_kv_heads=depth.get("num_key_value_heads", heads),
        head_dim=int(depth.get("head_dim", size // heads)),
        rms_norm_eps=float(depth.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
        tie_word_embeddings=False,
        attention_bias=bool(depth.get("attention_bias", False)),
        max_position_embeddings=depth.get("max_position_embeddings", 33),
        bos_token_id=None,
        eos_token_ids=(),
        raw=depth,
    )
