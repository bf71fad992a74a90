"""What an architecture with media towers adds to a causal LM: the modalities it reads, how one
prepared media item enters a context as a span of tokens, its encoder, and the soft-token rows a
pass carries into the language model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from attrs import field, frozen

MODALITIES = ("image", "video", "audio")
"""Media a model may read; a model's `modalities` is a subset."""


def _token_tuple(tokens: Iterable[int]) -> tuple[int, ...]:
    return tuple(tokens)


@frozen(kw_only=True)
class TextPiece:
    """Ordinary tokens inside a media span: delimiters, timestamps, separators."""

    tokens: tuple[int, ...] = field(converter=_token_tuple)


@frozen(kw_only=True, eq=False)
class SoftPiece:
    """`count` soft tokens: the next `count` rows of the item's encoder output, in order. Their
    token id is the model's placeholder for the modality (what transformers' processor puts in
    `input_ids`)."""

    placeholder: int
    rope_index: torch.Tensor
    """[count, 3] int64: each token's (t, h, w) index counted from the piece's first position.
    A model with one-dimensional rope gives (i, i, i) for the i-th token."""

    @property
    def count(self) -> int:
        return int(self.rope_index.shape[0])


Piece = TextPiece | SoftPiece


@frozen(kw_only=True, eq=False)
class PreparedMedia:
    """One image, video or audio clip made ready for a model: what its encoder reads and where
    its tokens go. Produced by the model's `prepare` from decoded media (pie.media)."""

    kind: str
    """One of MODALITIES."""
    inputs: Mapping[str, torch.Tensor]
    """The encoder's inputs (pixel rows and grid, or log-mel features), on the CPU."""
    span: tuple[Piece, ...]
    """The tokens the item becomes, in order."""
    grid: tuple[int, int, int]
    """(t, h, w) of its soft tokens (audio: (1, 1, tokens))."""

    @property
    def token_count(self) -> int:
        """Tokens in the whole span, delimiters included."""
        return sum(len(p.tokens) if isinstance(p, TextPiece) else p.count for p in self.span)

    @property
    def soft_count(self) -> int:
        """Rows of encoder output the span takes."""
        return sum(p.count for p in self.span if isinstance(p, SoftPiece))


@frozen(kw_only=True, eq=False)
class PlacedSpan:
    """A span laid out from one starting position, token by token."""

    tokens: list[int]
    positions: list[int]
    """The one-dimensional position of each token (for a soft token, its piece's start plus its
    t index); what pie stores per token."""
    soft: list[int]
    """Indices into `tokens` of the soft tokens, in encoder-output order."""
    rope_index: torch.Tensor
    """[len(soft), 3] int64: each soft token's (t, h, w) index from its piece's start."""
    next_position: int
    """Where the next token after the span goes."""


def place_span(span: Sequence[Piece], start: int) -> PlacedSpan:
    """Lays a span out from position `start`: text tokens take one position each; a soft piece
    starting at p puts its token i at p + t_i and moves the next position to p + 1 + the largest
    index in the piece (Qwen2-VL's rule; for one-dimensional rope that is one per token)."""
    tokens: list[int] = []
    positions: list[int] = []
    soft: list[int] = []
    indices: list[torch.Tensor] = []
    at = start
    for piece in span:
        if isinstance(piece, TextPiece):
            tokens.extend(piece.tokens)
            positions.extend(range(at, at + len(piece.tokens)))
            at += len(piece.tokens)
            continue
        soft.extend(range(len(tokens), len(tokens) + piece.count))
        tokens.extend([piece.placeholder] * piece.count)
        positions.extend((at + piece.rope_index[:, 0]).tolist())
        indices.append(piece.rope_index)
        at += int(piece.rope_index.max()) + 1 if piece.count else 0
    rope_index = torch.cat(indices) if indices else torch.zeros(0, 3, dtype=torch.int64)
    return PlacedSpan(
        tokens=tokens, positions=positions, soft=soft, rope_index=rope_index, next_position=at
    )


def sequential_index(count: int) -> torch.Tensor:
    """[count, 3]: (i, i, i) for i in 0..count-1, the rope index of one-dimensional rope."""
    return torch.arange(count, dtype=torch.int64).unsqueeze(1).expand(count, 3).contiguous()


@frozen(kw_only=True, eq=False)
class MediaRows:
    """The soft tokens of one pass: flat token rows whose input embedding the encoder output
    replaces, and (for multi-dimensional rope) each row's (t, h, w) index in its piece."""

    rows: torch.Tensor
    """[M] int64 indices into the pass's flat tokens."""
    embeds: torch.Tensor
    """[M, hidden_size] in the model's dtype and device."""
    rope_index: torch.Tensor
    """[M, 3] int64."""

    def into(self, hidden: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, hidden] with the soft-token rows replaced."""
        return hidden.index_copy(0, self.rows, self.embeds.to(hidden.dtype))


class MediaTowers:
    """Mixed into a CausalLM whose checkpoint carries encoders. `forward` then takes
    `media: MediaRows | None` after `attention`, and a model with several rope dimensions
    derives each row's streams as positions - t + (t, h, w)."""

    modalities: frozenset[str] = frozenset()
    """The media this model reads (a subset of MODALITIES), from its config."""
    processor: Mapping[str, Any] = {}
    """The checkpoint's preprocessor_config.json (empty when it has none); set by the loader."""
    chat_placeholders: Mapping[str, str] = {}
    """Per kind of media, the text the model's chat template renders for a medium of that kind
    (a content part `{"type": kind}`); the medium's span takes its place, delimiters included."""
    video_processor: Mapping[str, Any] | None = None
    """Its video_preprocessor_config.json (None when it has none: video then takes the
    preprocessor's settings); set by the loader."""

    @property
    def audio_rate(self) -> int:
        """Samples a second audio is decoded to for this model."""
        return 16000

    def prepare(
        self, kind: str, decoded: Any, tokenize: Callable[[str], Sequence[int]]
    ) -> PreparedMedia:
        """Decoded media (pie.media: DecodedImage, DecodedVideo, DecodedAudio) made ready for
        this model: resized, patched, normalised, with its span's text pieces encoded by
        `tokenize` (the model's tokenizer, no special-token handling added); ValueError names
        what the model refuses."""
        raise NotImplementedError

    def encode(self, items: Sequence[PreparedMedia]) -> list[torch.Tensor]:
        """Each item's soft-token embeddings [soft_count, hidden_size], the items batched
        through the encoder where their shapes allow."""
        raise NotImplementedError
