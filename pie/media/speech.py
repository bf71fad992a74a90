"""Audio a model produced, as a value: float32 samples at a rate, and its encoding as a 16-bit PCM
WAV file (written with av)."""

from __future__ import annotations

import io

import numpy as np
from attrs import frozen
from numpy.typing import NDArray

_LAYOUTS = {1: "mono", 2: "stereo"}


@frozen(kw_only=True, eq=False)
class SpeechClip:
    samples: NDArray[np.float32]
    """[channels, count], nominally in [-1, 1]."""
    sample_rate: int
    """Samples a second."""

    def __attrs_post_init__(self) -> None:
        shape = self.samples.shape
        if self.samples.ndim != 2 or shape[0] not in _LAYOUTS:
            raise ValueError(f"speech samples must be [1 or 2 channels, count], got {shape}")
        if self.samples.dtype != np.float32:
            raise ValueError(f"speech samples must be float32, got {self.samples.dtype}")
        if self.sample_rate < 1:
            raise ValueError(f"sample_rate must be at least 1, got {self.sample_rate}")

    @property
    def channels(self) -> int:
        return int(self.samples.shape[0])

    def duration(self) -> float:
        """Seconds."""
        return self.samples.shape[1] / self.sample_rate

    def to_wav(self) -> bytes:
        """A WAV file of 16-bit PCM; samples outside [-1, 1] are clipped."""
        layout = _LAYOUTS[self.channels]
        # x * 32768 rounded is what a reader's division by 32768 inverts to within half a step.
        pcm = np.clip(np.rint(self.samples * 32768.0), -32768, 32767).astype(np.int16)
        out = io.BytesIO()
        import av

        with av.open(out, mode="w", format="wav") as container:
            stream = container.add_stream("pcm_s16le", rate=self.sample_rate, layout=layout)
            container.start_encoding()  # the header, even for a clip of no samples
            if pcm.shape[1]:
                frame = av.AudioFrame.from_ndarray(
                    np.ascontiguousarray(pcm.T).reshape(1, -1), format="s16", layout=layout
                )
                frame.sample_rate = self.sample_rate
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        return out.getvalue()
