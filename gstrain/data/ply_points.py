"""Read a point cloud (x, y, z and optional red, green, blue) from a PLY file.

For the initial points of a scene (nerfstudio's `ply_file_path`): ASCII and binary PLY, any other
vertex properties skipped. The 3DGS Gaussian layout has its own reader (gstrain/model.py load_ply).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gstrain.errors import UserError

_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1", "short": "i2", "int16": "i2",
    "ushort": "u2", "uint16": "u2", "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}
_ENCODINGS = {"ascii": None, "binary_little_endian": "<", "binary_big_endian": ">"}


def read_ply_points(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """([P, 3] float32 positions, [P, 3] uint8 colours; mid grey where the file has none)."""
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read point cloud {path}: {exc.strerror or exc}") from None
    end = blob.find(b"end_header")
    if not blob.startswith(b"ply") or end < 0:
        raise UserError(f"point cloud {path} is not a PLY file (no 'ply' ... 'end_header' header)")
    body_start = blob.index(b"\n", end) + 1
    encoding, count, props = _parse_header(blob[:end].decode("ascii", "replace"), path)
    names = [name for name, _ in props]
    if not {"x", "y", "z"} <= set(names):
        raise UserError(f"point cloud {path}: the vertex element has no x, y, z properties")
    order = _ENCODINGS[encoding]
    if count == 0:
        return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)
    try:
        if order is None:
            rows = np.loadtxt(blob[body_start:].decode("ascii").splitlines()[:count], dtype=np.float64, ndmin=2)
            if rows.shape != (count, len(props)):
                raise ValueError(f"{rows.shape[0]} rows of {rows.shape[1]} values")
            columns = {name: rows[:, i] for i, name in enumerate(names)}
        else:
            dtype = np.dtype([(name, order + _TYPES[kind]) for name, kind in props])
            data = np.frombuffer(blob, dtype=dtype, count=count, offset=body_start)
            columns = {name: data[name] for name in names}
    except ValueError as exc:
        raise UserError(f"point cloud {path} is truncated or corrupt: {exc}") from None
    xyz = np.stack([columns[k] for k in "xyz"], axis=1).astype(np.float32)
    if not np.isfinite(xyz).all():
        raise UserError(f"point cloud {path} has non-finite positions")
    if {"red", "green", "blue"} <= set(names):
        rgb = np.stack([columns[k] for k in ("red", "green", "blue")], axis=1)
        rgb = np.clip(np.rint(rgb), 0, 255).astype(np.uint8)
    else:
        rgb = np.full((count, 3), 128, np.uint8)
    return xyz, rgb


def _parse_header(header: str, path: Path) -> tuple[str, int, list[tuple[str, str]]]:
    """(encoding, vertex count, [(name, type)] of the vertex element); the vertex element must come first."""
    encoding, count, props, element = None, None, [], None
    for line in header.splitlines()[1:]:
        words = line.split()
        if not words or words[0] in ("comment", "obj_info"):
            continue
        if words[0] == "format" and len(words) >= 2:
            encoding = words[1]
        elif words[0] == "element" and len(words) == 3:
            if element == "vertex":
                break  # only what precedes the vertex data matters
            element = words[1]
            if element != "vertex":
                raise UserError(f"point cloud {path}: element {element!r} comes before 'vertex' (not supported)")
            count = int(words[2]) if words[2].isdigit() else None
        elif words[0] == "property" and element == "vertex":
            if len(words) != 3 or words[1] not in _TYPES:
                raise UserError(f"point cloud {path}: unsupported vertex property {' '.join(words[1:])!r}")
            props.append((words[2], words[1]))
    if encoding not in _ENCODINGS:
        raise UserError(f"point cloud {path}: unknown PLY format {encoding!r}")
    if count is None:
        raise UserError(f"point cloud {path}: no 'element vertex <count>' line")
    return encoding, count, props
