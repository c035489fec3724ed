"""Export formats for web viewers: 3DGS PLY, antimatter15 .splat, and PlayCanvas compressed PLY.

PLY goes through our own writer (gstrain.model.save_ply, which also writes the zero normals
that the original 3DGS files carry); .splat and compressed PLY come from gsplat's exporter.
Every file is written to a temporary file beside the target and renamed into place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from gstrain.choices import EXPORT_FORMATS
from gstrain.errors import UserError
from gstrain.files import write_atomic

SUFFIXES = {"ply": ".ply", "splat": ".splat", "ply-compressed": ".compressed.ply"}
_GSPLAT_NAMES = {"splat": "splat", "ply-compressed": "ply_compressed"}


def default_export_name(fmt: str) -> str:
    """File name inside point_cloud/iteration_N/ (point_cloud.ply keeps the 3DGS layout)."""
    return "point_cloud" + SUFFIXES[check_format(fmt)]


def check_format(fmt: str) -> str:
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unsupported export format '{fmt}' (supported: {' | '.join(EXPORT_FORMATS)})")
    return fmt


def export_gaussians(params: Mapping[str, Tensor], path: Path, fmt: str) -> int:
    """Write the Gaussians in `fmt` to `path`; returns how many were written.

    gsplat drops non-finite Gaussians in every format, and compressed PLY also drops those
    with opacity <= 1/255 (they are invisible); the count says what is in the file.
    """
    check_format(fmt)
    if fmt == "ply":
        from gstrain.model import save_ply

        save_ply(params, path)
        return int(params["means"].shape[0])
    from gsplat import export_splats

    p = {k: v.detach().to("cpu", torch.float32) for k, v in params.items()}
    data = export_splats(
        p["means"], p["scales"], p["quats"], p["opacities"], p["sh0"], p["shN"], format=_GSPLAT_NAMES[fmt]
    )
    write_atomic(path, lambda fh: fh.write(data))  # temp file + rename; links and devices refused
    if fmt == "splat":
        return len(data) // 32
    finite = torch.stack([torch.isfinite(v.reshape(len(v), -1)).all(1) for v in p.values()]).all(0)
    return int((finite & (torch.sigmoid(p["opacities"]) > 1 / 255)).sum())
