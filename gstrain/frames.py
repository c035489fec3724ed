"""Where a render may write: a new or empty folder, or one holding an earlier render's frames.

A folder of frames carries a manifest of the PNGs gstrain wrote there; `--force` removes those
and nothing else, so a user's own files beside them (or a folder of their own frames) survive.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from gstrain.errors import UserError
from gstrain.files import check_new_or_forced, make_dir, os_error_text, write_text_atomic
from gstrain.run_dir import check_not_run_record

FRAMES_MANIFEST = ".gstrain-frames.json"  # the PNGs a render wrote into a folder: all --force may remove


def check_output(out: Path, is_video: bool, force: bool, ours: Path) -> None:
    """Refuse an output that would replace files gstrain did not write, or land among a run's
    records (its checkpoints, config); then check it is writable."""
    check_not_run_record(out)
    if is_video:
        if out.is_dir():
            raise UserError(f"--out {out} is a folder; give a FILE.mp4 path")
        check_new_or_forced(out, force, ours=ours)
        folder = out.parent
    else:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} exists and is not a folder")
        if out.is_dir() and any(out.iterdir()):
            if not (out / FRAMES_MANIFEST).is_file():
                raise UserError(f"--out {out} holds files that gstrain did not write; choose a new or empty folder")
            if not force:
                raise UserError(f"--out {out} holds an earlier render's frames; pass --force to replace them")
        folder = out
    make_dir(folder)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise UserError(os_error_text(exc, out)) from None


def _remove_earlier_frames(folder: Path) -> None:
    """Delete the PNGs an earlier render listed in the folder's manifest, and nothing else."""
    manifest = folder / FRAMES_MANIFEST
    if not manifest.is_file():
        return
    try:
        names = json.loads(manifest.read_text()).get("frames", [])
    except (OSError, ValueError, AttributeError):
        raise UserError(f"{manifest} is unreadable; remove the folder's frames yourself") from None
    for name in names:
        if isinstance(name, str) and "/" not in name and re.fullmatch(r"\d{5}\.png", name):
            (folder / name).unlink(missing_ok=True)
    manifest.unlink()


def start_frames(folder: Path, count: int) -> list[str]:
    """Clear an earlier render's frames, record this one's names first (an interrupted render's
    frames are still known to be ours), and return them: 00000.png, 00001.png, ..."""
    _remove_earlier_frames(folder)
    names = [f"{i:05d}.png" for i in range(count)]
    write_text_atomic(folder / FRAMES_MANIFEST, json.dumps({"frames": names}))
    return names
