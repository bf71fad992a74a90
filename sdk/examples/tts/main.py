"""Says a text with a model that speaks: the clip goes to the client as one WAV (bytes session
message), and the result tells its length. `model` names one of the engine's models (default:
its first); `speaker` is one of the model's voices (default: its first)."""

from __future__ import annotations

from typing import Any

from inferlet import get_model, session


async def main(input: dict[str, Any] | str) -> dict[str, Any]:
    request = {"text": input} if isinstance(input, str) else input
    model = get_model(request.get("model") or "")
    speaking = model.speak(request["text"])
    if request.get("speaker") is not None:
        speaking = speaking.speaker(int(request["speaker"]))
    if request.get("max_seconds") is not None:
        speaking = speaking.max_duration(float(request["max_seconds"]))
    with await speaking.generate() as speech:
        wav = speech.to_wav()
        session.send(wav)
        return {
            "seconds": speech.duration(),
            "sample_rate": speech.sample_rate,
            "channels": speech.channels,
            "bytes": len(wav),
        }
