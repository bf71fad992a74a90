"""The default model's GGUF rewritten at other precisions (F32, BF16, Q8_0) for `pie bench
peers`, so that a peer engine can run the same weights at the precision pie runs them at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

TARGETS = {
    "F32": GGMLQuantizationType.F32,
    "BF16": GGMLQuantizationType.BF16,
    "Q8_0": GGMLQuantizationType.Q8_0,
}
# llama.cpp's `general.file_type` numbers (its LLAMA_FTYPE_MOSTLY_* values).
_FILE_TYPES = {"F32": 0, "BF16": 32, "Q8_0": 7}
_REWRITTEN = ("general.architecture", "general.file_type")
"""Written by the writer itself, not copied."""
_KEPT = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
"""Tensors stored this way (norms) stay as they are, as llama.cpp's own quantizer does."""


def at_precision(source: Path, precision: str, cache: Path) -> Path:
    """`source` with every quantized tensor dequantized and stored as `precision`, written once
    into `cache` (a file named after the source and the precision) and reused afterwards."""
    if precision not in TARGETS:
        return source
    target = cache / f"{source.stem}.{precision}.gguf"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    _rewrite(GGUFReader(source), staging, precision)
    staging.replace(target)
    return target


def _rewrite(reader: GGUFReader, out: Path, precision: str) -> None:
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(out, arch)
    writer.add_file_type(_FILE_TYPES[precision])
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in _REWRITTEN:
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    qtype = TARGETS[precision]
    for tensor in reader.tensors:
        data, dtype = _converted(tensor, qtype)
        writer.add_tensor(tensor.name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _converted(tensor: Any, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    if tensor.tensor_type in _KEPT:
        return tensor.data, tensor.tensor_type
    values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    if qtype == GGMLQuantizationType.F32:
        return values, GGMLQuantizationType.F32
    return quantize(values, qtype), qtype
