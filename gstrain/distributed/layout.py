"""The splat record one owner sends to a view's renderer: defined once, here.

Both the real exchange (sharded_render) and the virtual-rank model (comm_model) take their sizes
from this module, so the bytes the model predicts are the bytes the counter measures.
"""

from __future__ import annotations

import torch

from gstrain.choices import COMPRESSIONS

# differentiable part, in this column order: means2d 2, conic 3, opacity 1, colour 3
DIFF_COLUMNS = (("means2d", 2), ("conics", 3), ("opacities", 1), ("colors", 3))
N_DIFF = sum(n for _, n in DIFF_COLUMNS)  # 9
# forward-only part, packed as int32 words: depth (float32 bits) 1, radii 2
META_COLUMNS = (("depth", 1), ("radii", 2))
N_META = sum(n for _, n in META_COLUMNS)  # 3
META_DTYPE = torch.int32
COUNT_DTYPE = torch.int64  # per-view record counts, exchanged before the records


# compress=fp16 keeps the record's leading columns, means2d and conics, at full precision: a
# float16 position is off by up to half a pixel beyond 1,024 px, and the small conics of large
# splats fall into float16's subnormals. Opacity and colour (in [0, 1]-ish) travel as float16.
# Gradients travel as bfloat16: float32's range (float16 runs on beer stopped at a non-finite
# loss within 1,000 steps), 8 bits of mantissa.
FULL_PRECISION_COLUMNS = 5


def _check_compress(compress: str) -> None:
    if compress not in COMPRESSIONS:
        raise ValueError(f"compress must be one of {COMPRESSIONS}, got {compress!r}")


def wire_segments(dtype: torch.dtype, compress: str, n_columns: int = N_DIFF) -> list[tuple[int, torch.dtype]]:
    """How a float payload of n_columns travels: (columns, dtype) runs, in column order."""
    _check_compress(compress)
    if compress == "none":
        return [(n_columns, dtype)]
    keep = min(FULL_PRECISION_COLUMNS, n_columns)
    return [(keep, dtype), (n_columns - keep, torch.float16)]


def grad_wire_dtype(dtype: torch.dtype, compress: str) -> torch.dtype:
    """The dtype the payload's gradient travels back in."""
    _check_compress(compress)
    return torch.bfloat16 if compress == "fp16" else dtype


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


def forward_record_bytes(dtype: torch.dtype = torch.float32, compress: str = "none") -> int:
    """Bytes one record costs on the wire in the forward: payload plus depth and radii."""
    payload = sum(n * _size(dt) for n, dt in wire_segments(dtype, compress))
    return payload + N_META * _size(META_DTYPE)


def backward_record_bytes(dtype: torch.dtype = torch.float32, compress: str = "none") -> int:
    """Bytes one record's gradient costs on the wire in the backward."""
    return N_DIFF * _size(grad_wire_dtype(dtype, compress))


def count_bytes() -> int:
    """Bytes of one per-view record count."""
    return _size(COUNT_DTYPE)
