"""Names what a byte string looks like from its first bytes: for error messages that say
what was sent, and to send GIF and WebP animations given as video to the image decoder."""

from __future__ import annotations

_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG image"),
    (b"\xff\xd8\xff", "JPEG image"),
    (b"GIF87a", "GIF image"),
    (b"GIF89a", "GIF image"),
    (b"BM", "BMP image"),
    (b"II*\x00", "TIFF image"),
    (b"MM\x00*", "TIFF image"),
    (b"\x00\x00\x01\x00", "ICO image"),
    (b"8BPS", "Photoshop image"),
    (b"%PDF", "PDF document"),
    (b"fLaC", "FLAC audio"),
    (b"OggS", "Ogg file"),
    (b"ID3", "MP3 audio"),
    (b"\x1a\x45\xdf\xa3", "Matroska or WebM file"),
    (b"FLV", "FLV video"),
    (b"PK\x03\x04", "ZIP archive"),
    (b"\x1f\x8b", "gzip data"),
    (b"\x00asm", "WebAssembly module"),
)
_RIFF_KINDS = {b"WEBP": "WebP image", b"WAVE": "WAV audio", b"AVI ": "AVI video"}
_HEIF_BRANDS = {b"heic", b"heix", b"mif1", b"msf1", b"avif", b"avis"}


def describe(data: bytes) -> str:
    """A few words naming the format `data` appears to be in, or how it starts."""
    if not data:
        return "empty data"
    if data[:4] == b"RIFF" and data[8:12] in _RIFF_KINDS:
        return _RIFF_KINDS[data[8:12]]
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        kind = "HEIF or AVIF image" if brand in _HEIF_BRANDS else "MP4 or MOV file"
        return f"{kind} (brand {brand.decode('ascii', 'replace')!r})"
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    if _looks_like_text(data[:512]):
        return "text"
    return f"unknown data (starting {data[:8].hex(' ')})"


def is_animated_image_format(data: bytes) -> bool:
    """GIF or WebP: the image formats that hold animations a video may be sent as."""
    return data[:6] in (b"GIF87a", b"GIF89a") or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def _looks_like_text(head: bytes) -> bool:
    text = head.decode("utf-8", "replace")
    # A multi-byte character cut at the end of `head` decodes as one replacement character.
    return text.count("\ufffd") <= 1 and all(c.isprintable() or c in "\t\r\n\ufffd" for c in text)
