"""Media as programs use them, for engine tests; `probe` picks a family of modes (each module
says what its modes do): `describe` (the default: pictures appended between runs of tokens,
and the refusals of media), `passes` (media in passes a program builds, the media bounds,
snapshots holding media), `files` (files sent to a session, a chat turn about a picture) and
`speech` (text to speech)."""

from __future__ import annotations

from typing import Any

import probe_describe
import probe_files
import probe_passes
import probe_speech

FAMILIES = {
    "describe": probe_describe.MODES,
    "passes": probe_passes.MODES,
    "files": probe_files.MODES,
    "speech": probe_speech.MODES,
}


async def main(input: dict[str, Any]) -> Any:
    return await FAMILIES[input.get("probe", "describe")][input["mode"]](input)
