"""Opening audio and video containers from bytes with av: only the allowed demuxers, the first
stream of a kind with an allowed codec, and the length the metadata states."""

from __future__ import annotations

import io
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from pie.media.errors import CorruptMedia, UnsupportedMedia, complaint
from pie.media.sniff import describe

if TYPE_CHECKING:
    from av.container import InputContainer
    from av.stream import Stream

StreamT = TypeVar("StreamT", bound="Stream")


@contextmanager
def open_container(data: bytes, kind: str, formats: Collection[str]) -> Iterator[InputContainer]:
    """The container in `data`, read by one of the demuxers `formats` names; closed on exit.

    ffmpeg probes the format from the first bytes and then refuses a demuxer not in the list
    before it reads any further."""
    options = {"format_whitelist": ",".join(formats)}
    import av  # loaded on the first decode: most processes never decode media

    try:
        container = av.open(io.BytesIO(data), "r", container_options=options)
    except av.error.ArgumentError as exc:
        raise UnsupportedMedia(kind, detected=describe(data), allowed=formats) from exc
    except av.error.InvalidDataError as exc:
        detected = describe(data)
        if detected == "empty data" or detected == "text" or detected.startswith("unknown"):
            raise UnsupportedMedia(kind, detected=detected, allowed=formats) from exc
        raise CorruptMedia(kind, f"{detected}: {complaint(exc)}") from exc
    with container:
        yield container


def first_stream(
    streams: Sequence[StreamT], container: InputContainer, kind: str, codecs: Collection[str]
) -> StreamT:
    """The first of `streams` (the container's streams of one kind), whose codec must be one
    of `codecs` (or, for "pcm_*", any PCM)."""
    if not streams:
        detected = f"a {container.format.name} container with no {kind} stream"
        raise UnsupportedMedia(kind, detected=detected, allowed=codecs)
    stream = streams[0]
    context = stream.codec_context
    codec = context.codec.canonical_name if context is not None else "an unknown codec"
    if codec not in codecs and not (codec.startswith("pcm_") and "pcm_*" in codecs):
        detected = f"{codec} in a {container.format.name} container"
        raise UnsupportedMedia(kind, detected=detected, allowed=codecs)
    return stream


def stated_seconds(container: InputContainer, stream: Stream) -> float | None:
    """How long the stream says it is, else the container; None when neither says."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        import av

        return float(container.duration / av.time_base)
    return None
