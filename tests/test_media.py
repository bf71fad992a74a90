"""Media decoding (pie/media): images, video and audio built here from known content come back
as RGB pixels, evenly sampled frames and mono samples; every limit refuses what is over it,
bad bytes become MediaErrors, and a refusal leaves the decoders ready for good input."""

from __future__ import annotations

import io
import struct
import time
import wave
import zlib
from collections.abc import Callable

import av
import numpy as np
import psutil
import pytest
from numpy.typing import NDArray
from PIL import Image

import pie.media.audio
import pie.media.video
from pie.config import ConfigError, MediaConfig, config_from_dict
from pie.media import (
    CorruptMedia,
    MediaError,
    MediaTooLarge,
    UnsupportedMedia,
    decode_audio,
    decode_image,
    decode_video,
)

pytestmark = pytest.mark.unit

VIDEO_CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"
FPS, VIDEO_FRAMES = 10, 50
"""Test videos: 5 s at 10 frames a second, frame i filled with the grey level 5 * i."""


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims `width` x `height` pixels and holds almost none."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\0" * 100)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def video(fmt: str = "mp4", codec: str = VIDEO_CODEC, frames: int = VIDEO_FRAMES) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 320, 240, "yuv420p"
        stream.bit_rate = 4_000_000
        for i in range(frames):
            grey = np.full((240, 320, 3), 5 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(grey, format="rgb24")):
                container.mux(packet)
        container.mux(stream.encode())
    return out.getvalue()


def frame_index(pixels: NDArray[np.uint8]) -> int:
    return round(float(pixels[100:140, 140:180].mean()) / 5)


def sine(rate: int, seconds: float, hz: float = 440.0) -> NDArray[np.float32]:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def wav(left: NDArray[np.float32], right: NDArray[np.float32] | None, rate: int) -> bytes:
    channels = np.stack([left] if right is None else [left, right], axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels.shape[1])
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((channels * 32767).astype("<i2").tobytes())
    return out.getvalue()


def audio(fmt: str, codec: str, rate: int, seconds: float = 2.0) -> bytes:
    """A 440 Hz sine of amplitude 0.5 in both channels."""
    out = io.BytesIO()
    samples = sine(rate, seconds)
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "stereo"
        for start in range(0, len(samples), 960):
            piece = np.tile(samples[start : start + 960], (2, 1))
            frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout="stereo")
            frame.sample_rate, frame.pts = rate, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def dominant_hz(samples: NDArray[np.float32], rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


def animation(fmt: str, frames: int = 20) -> bytes:
    """`frames` 8x8 frames, frame i red at 10 * i, 50 ms each."""
    images = [Image.new("RGB", (8, 8), (10 * i, 0, 0)) for i in range(frames)]
    return encoded(images[0], fmt, save_all=True, append_images=images[1:], duration=50, loop=0)


# Images


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_each_image_format_decodes_to_read_only_rgb_pixels(fmt: str) -> None:
    image = decode_image(encoded(Image.new("RGB", (6, 4), (200, 10, 30)), fmt))
    assert (image.format, image.width, image.height) == (fmt.lower(), 6, 4)
    assert image.pixels.shape == (4, 6, 3) and image.pixels.dtype == np.uint8
    assert np.abs(image.pixels.astype(int) - (200, 10, 30)).max() <= 3
    assert not image.pixels.flags.writeable


def test_a_jpeg_with_exif_orientation_6_comes_back_upright() -> None:
    wide = Image.new("RGB", (40, 20), (255, 0, 0))
    wide.paste((0, 0, 255), (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: shown rotated 90 degrees clockwise
    image = decode_image(encoded(wide, "JPEG", exif=exif))
    assert (image.width, image.height) == (20, 40)
    assert tuple(image.pixels[5, 10]) > (200, 0, 0) and image.pixels[35, 10, 2] > 200


def test_transparency_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (2, 2), (255, 0, 0, 0))
    half_black = Image.new("LA", (2, 2), (0, 128))
    palette = Image.new("P", (2, 2), 0)
    palette.putpalette([0, 0, 0] * 256)
    assert tuple(decode_image(encoded(clear, "PNG")).pixels[0, 0]) == (255, 255, 255)
    assert tuple(decode_image(encoded(clear, "WEBP", lossless=True)).pixels[0, 0]) == (255,) * 3
    assert tuple(decode_image(encoded(half_black, "PNG")).pixels[0, 0]) == (127, 127, 127)
    for fmt in ("PNG", "GIF"):
        pixel = decode_image(encoded(palette, fmt, transparency=0)).pixels[0, 0]
        assert tuple(pixel) == (255, 255, 255)


def test_cmyk_and_16_bit_grey_become_rgb() -> None:
    cmyk = Image.new("CMYK", (2, 2), (0, 255, 255, 0))
    grey16 = Image.fromarray(np.full((2, 2), 40000, np.uint16))
    assert tuple(decode_image(encoded(cmyk, "JPEG")).pixels[0, 0]) == (255, 0, 0)
    assert tuple(decode_image(encoded(grey16, "PNG")).pixels[0, 0]) == (156, 156, 156)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_an_animations_first_frame_is_its_image(fmt: str) -> None:
    image = decode_image(animation(fmt))
    assert (image.format, image.width, image.height) == (fmt.lower(), 8, 8)
    assert tuple(image.pixels[0, 0]) == (0, 0, 0)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_an_animation_sent_as_video_gives_evenly_spaced_frames(fmt: str) -> None:
    clip = decode_video(animation(fmt), 5)
    assert (clip.format, clip.width, clip.height, clip.seconds) == (fmt.lower(), 8, 8, 1.0)
    assert [round(f.pixels[0, 0, 0] / 10) for f in clip.frames] == [0, 5, 10, 14, 19]
    assert [f.seconds for f in clip.frames] == [0.0, 0.25, 0.5, 0.7, 0.95]


def test_an_animation_over_max_animation_frames_is_refused() -> None:
    with pytest.raises(MediaTooLarge, match="max_animation_frames = 10") as refused:
        decode_video(animation("GIF", frames=11), 4, MediaConfig(max_animation_frames=10))
    assert refused.value.value == 11
    assert (
        len(
            decode_video(
                animation("GIF", frames=10), 4, MediaConfig(max_animation_frames=10)
            ).frames
        )
        == 4
    )


# pillow warns on its own about 10000x10000 while it reads the header, before our check.
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("size", [(100_000, 100_000), (10_000, 10_000), (8000, 5000)])
def test_a_huge_png_header_is_refused_fast_without_allocating(size: tuple[int, int]) -> None:
    # 100000x100000 is past twice pillow's own limit, 10000x10000 past it once, 8000x5000 under
    # pillow's and over ours (33 Mpx): each is refused from the header.
    process = psutil.Process()
    rss, start = process.memory_info().rss, time.perf_counter()
    with pytest.raises(MediaTooLarge, match="max_image_pixels = 33177600") as refused:
        decode_image(png_header(*size))
    assert time.perf_counter() - start < 1.0
    assert process.memory_info().rss - rss < 50 << 20
    assert refused.value.value == size[0] * size[1]


def test_an_image_over_max_image_mb_is_refused_before_decoding() -> None:
    padded = encoded(Image.new("RGB", (4, 4)), "PNG") + b"\0" * (1 << 20)
    with pytest.raises(
        MediaTooLarge, match=r"\(1048[0-9]+ bytes\), over \[media\] max_image_mb = 1"
    ):
        decode_image(padded, MediaConfig(max_image_mb=1))
    assert decode_image(padded, MediaConfig(max_image_mb=2)).width == 4


# Bad bytes, for every decoder

GOOD_PNG = encoded(Image.new("RGB", (16, 16), (1, 2, 3)), "PNG")
RANDOM = np.random.default_rng(7).bytes(4096)
SHORT_MP4 = video(frames=10)
NOISE = Image.frombytes("RGB", (64, 64), RANDOM * 3)
NOISY_PNG, NOISY_JPEG = encoded(NOISE, "PNG"), encoded(NOISE, "JPEG")
DECODERS: dict[str, Callable[[bytes], object]] = {
    "image": decode_image,
    "video": decode_video,
    "audio": lambda data: decode_audio(data, 16_000),
}


@pytest.mark.parametrize("kind", DECODERS)
@pytest.mark.parametrize(
    "data, named",
    [
        (b"", "empty data"),
        (b"some text\n" * 20, "text"),
        (RANDOM, "unknown"),
        (b"\0" * 64, "unknown"),
    ],
    ids=["empty", "text", "random", "zeros"],
)
def test_bytes_no_decoder_knows_are_unsupported_media(kind: str, data: bytes, named: str) -> None:
    with pytest.raises(UnsupportedMedia, match=f"unsupported {kind}: {named}"):
        DECODERS[kind](data)


@pytest.mark.parametrize(
    "kind, data",
    [
        ("image", GOOD_PNG[:40]),
        ("image", NOISY_PNG[: len(NOISY_PNG) // 2]),
        ("image", NOISY_JPEG[: len(NOISY_JPEG) // 2]),
        ("image", b"\x89PNG\r\n\x1a\n" + RANDOM),
        ("video", SHORT_MP4[: len(SHORT_MP4) // 2]),
        ("audio", audio("flac", "flac", 44_100)[:60]),
    ],
    ids=["png-header", "png-half", "jpeg-half", "png-garbage", "mp4-start", "flac-header"],
)
def test_truncated_or_garbled_files_are_corrupt_media(kind: str, data: bytes) -> None:
    with pytest.raises(CorruptMedia, match=f"corrupt {kind}: ") as refused:
        DECODERS[kind](data)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "kind, data, named",
    [
        ("image", encoded(Image.new("RGB", (2, 2)), "BMP"), "BMP image"),
        ("image", encoded(Image.new("RGB", (2, 2)), "TIFF"), "TIFF image"),
        ("video", wav(sine(8000, 0.1), None, 8000), "WAV audio"),
        ("video", audio("matroska", "flac", 8000, 0.1), "no video stream"),
        ("audio", GOOD_PNG, "PNG image"),
        ("audio", video("matroska", frames=2), "no audio stream"),
    ],
)
def test_a_format_not_allowed_is_unsupported_and_named(kind: str, data: bytes, named: str) -> None:
    with pytest.raises(UnsupportedMedia, match=named):
        DECODERS[kind](data)


@pytest.mark.parametrize("kind", DECODERS)
def test_mutated_files_decode_or_raise_only_media_errors(kind: str) -> None:
    seeds = {
        "image": [NOISY_PNG, NOISY_JPEG, animation("GIF"), animation("WEBP")],
        "video": [SHORT_MP4, video("matroska", "mpeg4", 10), video("m4v", "mpeg4", 10)],
        "audio": [audio("flac", "flac", 16_000, 0.5), audio("ogg", "libopus", 48_000, 0.5)],
    }[kind]
    rng = np.random.default_rng(11)
    outcomes = set()
    for i in range(60):
        data = bytearray(seeds[i % len(seeds)])
        for position in rng.integers(0, len(data), size=rng.integers(1, 10)):
            data[position] = rng.integers(0, 256)
        try:
            DECODERS[kind](bytes(data[: rng.integers(len(data) // 2, len(data) + 1)]))
            outcomes.add("decoded")
        except MediaError as refused:
            outcomes.add(type(refused).__name__)
    assert "CorruptMedia" in outcomes


def test_after_every_kind_of_refusal_good_input_still_decodes() -> None:
    tight = MediaConfig(max_image_pixels=100)
    bad = [b"", RANDOM, NOISY_PNG[:2000], png_header(100_000, 100_000), SHORT_MP4[:2000]]
    for data in bad:
        for decode in DECODERS.values():
            with pytest.raises(MediaError):
                decode(data)
    with pytest.raises(MediaTooLarge):
        decode_image(GOOD_PNG, tight)
    assert decode_image(GOOD_PNG).pixels[0, 0].tolist() == [1, 2, 3]
    assert len(decode_video(SHORT_MP4, 2).frames) == 2
    assert decode_audio(wav(sine(8000, 0.5), None, 8000), 8000).samples.shape == (4000,)


# Video


def test_a_video_is_sampled_evenly_with_times_and_markers() -> None:
    clip = decode_video(video(), 8)
    indices = [round(frame.seconds * FPS) for frame in clip.frames]
    assert indices == [0, 7, 14, 21, 28, 35, 42, 49]
    assert [frame_index(frame.pixels) for frame in clip.frames] == indices
    assert [frame.marker for frame in clip.frames][::2] == ["00:00", "00:01", "00:02", "00:04"]
    assert (clip.width, clip.height, clip.seconds) == (320, 240, 5.0)
    assert clip.format.startswith("mov,mp4") and clip.frames[0].pixels.shape == (240, 320, 3)


def test_one_frame_is_the_first_and_more_than_the_video_has_is_every_frame() -> None:
    data = video()
    assert [f.seconds for f in decode_video(data, 1).frames] == [0.0]
    every = decode_video(data, 64).frames
    assert [frame_index(f.pixels) for f in every] == list(range(VIDEO_FRAMES))


def test_a_stream_that_states_no_length_is_measured_then_sampled_the_same() -> None:
    # A raw MPEG-4 stream states neither a duration nor a frame count.
    clip = decode_video(video("m4v", "mpeg4"), 8)
    assert clip.format == "m4v" and clip.seconds == pytest.approx(5.0, abs=0.1)
    assert [frame_index(f.pixels) for f in clip.frames] == [0, 7, 14, 21, 28, 35, 42, 49]


def test_a_video_over_max_video_seconds_is_refused_from_what_it_states() -> None:
    short = MediaConfig(max_video_seconds=2.0)
    with pytest.raises(MediaTooLarge, match=r"5 seconds, over \[media\] max_video_seconds = 2"):
        decode_video(video(), 8, short)
    with pytest.raises(MediaTooLarge, match="max_video_seconds = 2"):
        decode_video(video("m4v", "mpeg4"), 8, short)


def test_a_video_whose_header_understates_its_length_is_measured_and_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pie.media.video, "stated_seconds", lambda container, stream: 0.5)
    with pytest.raises(
        MediaTooLarge, match=r" 2\.\d+ seconds, over \[media\] max_video_seconds = 2"
    ):
        decode_video(video(), 8, MediaConfig(max_video_seconds=2.0))


def test_decoding_stops_at_the_limit_even_when_the_packets_understate_the_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pie.media.video, "stated_seconds", lambda container, stream: 0.5)
    monkeypatch.setattr(pie.media.video, "_packet_times", lambda *args: (0.0, 0.4, 0.5))
    with pytest.raises(MediaTooLarge, match=r"2\.1 seconds, over \[media\] max_video_seconds = 2"):
        decode_video(video(), 8, MediaConfig(max_video_seconds=2.0))


def test_video_frames_over_max_video_pixels_are_refused() -> None:
    with pytest.raises(MediaTooLarge, match=r"76800 pixels \(320x240\), over .* = 76799"):
        decode_video(video(frames=5), 2, MediaConfig(max_video_pixels=320 * 240 - 1))


def test_asking_for_more_than_max_video_frames_or_bytes_is_refused() -> None:
    data = video(frames=5)
    with pytest.raises(MediaTooLarge, match="65 frames asked for, over .* max_video_frames = 64"):
        decode_video(data, 65)
    with pytest.raises(MediaTooLarge, match="max_video_mb = 1"):
        decode_video(data + b"\0" * (1 << 20), 2, MediaConfig(max_video_mb=1))


# Audio


AUDIO_FORMATS = [
    ("wav", "pcm_s16le", 22_050),
    ("flac", "flac", 44_100),
    ("ogg", "libopus", 48_000),
    ("mp3", "libmp3lame", 44_100),
]


@pytest.mark.parametrize("fmt, codec, rate", AUDIO_FORMATS)
def test_audio_decodes_to_mono_at_the_asked_rate(fmt: str, codec: str, rate: int) -> None:
    sound = decode_audio(audio(fmt, codec, rate), 16_000)
    assert (sound.rate, sound.format, sound.samples.dtype) == (16_000, fmt, np.float32)
    assert sound.samples.ndim == 1 and not sound.samples.flags.writeable
    assert sound.seconds == pytest.approx(2.0, abs=0.05)
    assert len(sound.samples) == pytest.approx(32_000, abs=800)
    assert dominant_hz(sound.samples, 16_000) == pytest.approx(440, abs=2)
    # Both channels hold the same sine: their mean keeps its amplitude, 0.5.
    assert float(np.abs(sound.samples).max()) == pytest.approx(0.5, abs=0.05)


def test_stereo_is_mixed_down_to_the_channels_mean() -> None:
    left = sine(16_000, 1.0)
    sound = decode_audio(wav(left, np.zeros_like(left), 16_000), 16_000)
    assert sound.codec == "pcm_s16le"
    np.testing.assert_allclose(sound.samples, left / 2, atol=1e-4)


def test_audio_over_max_audio_seconds_is_refused_from_its_header_and_while_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    short = MediaConfig(max_audio_seconds=1.5)
    data = audio("flac", "flac", 44_100)
    with pytest.raises(MediaTooLarge, match=r"2 seconds, over \[media\] max_audio_seconds = 1.5"):
        decode_audio(data, 16_000, short)
    monkeypatch.setattr(pie.media.audio, "stated_seconds", lambda container, stream: None)
    with pytest.raises(MediaTooLarge, match="max_audio_seconds = 1.5"):
        decode_audio(data, 16_000, short)


def test_a_wav_header_claiming_endless_data_stops_at_the_limit() -> None:
    endless = bytearray(wav(sine(8000, 3.0), None, 8000))
    endless[4:8] = endless[40:44] = struct.pack("<I", 0xFFFF_FFFF)
    with pytest.raises(MediaTooLarge, match="max_audio_seconds = 1.5"):
        decode_audio(bytes(endless), 8000, MediaConfig(max_audio_seconds=1.5))
    assert decode_audio(bytes(endless), 8000).seconds == pytest.approx(3.0)


def test_audio_over_max_audio_mb_is_refused() -> None:
    data = wav(sine(8000, 0.1), None, 8000) + b"\0" * (1 << 20)
    with pytest.raises(MediaTooLarge, match="max_audio_mb = 1"):
        decode_audio(data, 8000, MediaConfig(max_audio_mb=1))


# Config


def test_media_config_refuses_inconsistent_limits() -> None:
    with pytest.raises(ConfigError, match="video_frames"):
        config_from_dict({"media": {"video_frames": 65}})
    with pytest.raises(ConfigError, match="max_image_pixels"):
        config_from_dict({"media": {"max_image_pixels": 100_000_000}})
    config = config_from_dict({"media": {"max_video_seconds": 60, "video_frames": 8}})
    assert (config.media.max_video_seconds, config.media.video_frames) == (60, 8)
