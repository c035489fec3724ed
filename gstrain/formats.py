"""Export formats for web viewers: 3DGS PLY, antimatter15 .splat, and PlayCanvas compressed PLY.

PLY goes through our own writer (gstrain.model.save_ply, which also writes the zero normals
that the original 3DGS files carry); .splat and compressed PLY come from gsplat's exporter.
Every file is written to a temporary file beside the target and renamed into place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from gstrain.choices import EXPORT_FORMATS
from gstrain.errors import UserError
from gstrain.files import check_new_or_forced, mark_ply_header, write_atomic

DEFAULT_FORMAT = "ply"
SUFFIXES = {"ply": ".ply", "splat": ".splat", "ply-compressed": ".compressed.ply"}
_GSPLAT_NAMES = {"splat": "splat", "ply-compressed": "ply_compressed"}


def default_export_name(fmt: str) -> str:
    """File name inside point_cloud/iteration_N/ (point_cloud.ply keeps the 3DGS layout)."""
    return "point_cloud" + SUFFIXES[check_format(fmt)]


def check_format(fmt: str) -> str:
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unsupported export format '{fmt}' (supported: {' | '.join(EXPORT_FORMATS)})")
    return fmt


def format_of_name(name: str) -> str | None:
    """The format a file name's extension names (the longest known suffix wins), or None."""
    lower = name.lower()
    known = sorted(SUFFIXES.items(), key=lambda item: -len(item[1]))
    return next((fmt for fmt, suffix in known if lower.endswith(suffix)), None)


def export_format(out: Path | None, fmt: str | None) -> str:
    """The format to write: --format, else the one --out's extension names, else ply.

    A --format that contradicts a known extension is refused; compressed PLY may also be named
    plain .ply, since it is a PLY file and viewers tell it by its header.
    """
    implied = format_of_name(out.name) if out is not None else None
    if fmt is None:
        return implied or DEFAULT_FORMAT
    check_format(fmt)
    if implied is not None and implied != fmt and (fmt, implied) != ("ply-compressed", "ply"):
        raise UserError(f"--format {fmt} does not match --out {out} (a {implied} name); "
                        f"name it *{SUFFIXES[fmt]} or leave --format out")
    return fmt


def check_export_target(out: Path, fmt: str, force: bool, ours: Path) -> None:
    """Refuse an existing --out that gstrain may not replace (files.check_new_or_forced). A .splat
    is bare 32-byte records with no room for gstrain's mark: --force never replaces one outside
    `ours`, since gstrain's own .splat and a user's look the same."""
    markless = "a .splat file has no room for gstrain's mark" if fmt == "splat" else None
    check_new_or_forced(out, force, ours=ours, markless=markless)


def finite_rows(tensors: Iterable[Tensor]) -> Tensor:
    """[N] bool: the Gaussians whose every value in every tensor (leading dim N) is finite."""
    rows = [torch.isfinite(v).flatten(1).all(1) if v.dim() > 1 else torch.isfinite(v) for v in tensors]
    return torch.stack(rows).all(0)


def export_gaussians(params: Mapping[str, Tensor], path: Path, fmt: str) -> int:
    """Write the Gaussians in `fmt` to `path`; returns how many were written.

    .splat and compressed PLY drop non-finite Gaussians (a viewer cannot place them), and
    compressed PLY also those with opacity <= 1/255 (invisible); the count says what is in the
    file. Nothing to write (0 Gaussians, or none kept) is a UserError in every format: an
    empty file would load as a blank scene and hide that the run has nothing.
    """
    check_format(fmt)
    total = int(params["means"].shape[0])
    if total == 0:
        raise UserError("nothing to export: the checkpoint holds 0 Gaussians")
    if fmt == "ply":
        from gstrain.model import save_ply

        save_ply(params, path)
        return total
    from gsplat import export_splats

    p = {k: v.detach().to("cpu", torch.float32) for k, v in params.items()}
    # filtered here, not only by gsplat: its check flags every row when one opacity is NaN
    keep = finite_rows(p.values())
    if fmt == "ply-compressed":
        keep &= torch.sigmoid(p["opacities"]) > 1 / 255
    kept = int(keep.sum())
    if kept == 0:
        visible = " and visible (opacity > 1/255)" if fmt == "ply-compressed" else ""
        raise UserError(f"nothing to export as {fmt}: none of the {total} Gaussians is finite{visible}")
    p = {k: v[keep] for k, v in p.items()}
    data = export_splats(
        p["means"], p["scales"], p["quats"], p["opacities"], p["sh0"], p["shN"], format=_GSPLAT_NAMES[fmt]
    )
    if fmt == "ply-compressed":
        data = mark_ply_header(data)  # a later --force may replace it
    write_atomic(path, lambda fh: fh.write(data))  # temp file + rename; links and devices refused
    return kept
