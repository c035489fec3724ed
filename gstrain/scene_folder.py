"""Scene folders that gstrain writes (`gstrain sfm`, `gstrain demo-scene`), and replacing them safely.

Each writer leaves a manifest in the folder (sfm.json, demo-scene.json) whose "files" lists every
file it wrote. A later run may replace exactly those files and nothing else: a folder without
the manifest holds the user's files and is refused, even with --force; files that are not listed
stay where they are, and a stray one inside the scene's own folders (images/, sparse/, masks/)
is refused too, as the new scene would be read together with it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gstrain.errors import UserError

# What gstrain's scene loader reads (data/colmap.py, data/masks.py): a user's file in one of
# these would be mixed into the scene written there.
_SCENE_PART = re.compile(r"^((images|masks)(_\d+)?|sparse)$")
_SHOWN = 3  # file names quoted in a refusal


def files_of(folder: Path) -> list[str]:
    """Every entry under folder that is not a real folder (files, links, pipes), relative, sorted."""
    found = []
    for root, dirs, names in os.walk(folder):  # never follows a link to a folder
        rel = Path(root).relative_to(folder)
        found += [(rel / n).as_posix() for n in names]
        found += [(rel / d).as_posix() for d in dirs if os.path.islink(os.path.join(root, d))]
    return sorted(found)


def listed_files(folder: Path, manifest: str,
                 legacy: Callable[[dict[str, Any]], list[str]] | None = None) -> set[str] | None:
    """The files the manifest says gstrain wrote (the manifest included); None without a readable one.

    legacy(manifest) lists them for a manifest written before it carried "files"."""
    try:
        data = json.loads((folder / manifest).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    names = data.get("files")
    if names is None and legacy is not None:
        names = legacy(data)
    if not isinstance(names, list):
        return None
    return {n for n in names if isinstance(n, str) and _is_plain_relative(n)} | {manifest}


def _is_plain_relative(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def _quote(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_replace(folder: Path, manifest: str, what: str, force: bool, same: bool = False,
                  legacy: Callable[[dict[str, Any]], list[str]] | None = None) -> bool:
    """May a new `what` be written into folder? True when it will replace an earlier one.

    Refused (UserError): a file in the way, a folder holding anything gstrain did not list in
    its manifest inside the scene's folders, or any files at all without a manifest; an earlier
    `what` unless `force` or `same` (a re-run that would write the same thing).
    """
    if os.path.lexists(folder) and not folder.is_dir():
        raise UserError(f"{folder} exists and is not a folder")
    if not folder.exists():
        return False
    present = files_of(folder)
    if not present:
        return False
    ours = listed_files(folder, manifest, legacy)
    if ours is None:
        raise UserError(f"{folder} holds files that gstrain did not write ({_quote(present)}; no {manifest} "
                        "lists them); choose a new or empty folder")
    stray = [n for n in present if n not in ours and _SCENE_PART.match(n.split("/")[0])]
    if stray:
        raise UserError(f"{folder} holds an earlier {what}, and files that gstrain did not write in its "
                        f"scene folders ({_quote(stray)}); move them out or choose another folder")
    if not (force or same):
        raise UserError(f"{folder} holds an earlier {what} (listed in {manifest}); "
                        "pass --force to replace it, or choose another folder")
    return True


@contextmanager
def workspace(folder: Path, label: str) -> Iterator[Path]:
    """A temporary folder beside `folder` (so the finished files move in by rename); removed after."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.{label}-", dir=folder.parent))
    except OSError as exc:
        raise UserError(f"cannot write to the output folder {folder}: {exc.strerror or exc}") from None
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_manifest(result: Path, manifest: str, record: dict[str, Any]) -> None:
    """result/manifest: the record plus "files", every file now in result."""
    record = {**record, "files": [n for n in files_of(result) if n != manifest]}
    (result / manifest).write_text(json.dumps(record, indent=2))


def install(result: Path, folder: Path, manifest: str, trash: Path, what: str,
            legacy: Callable[[dict[str, Any]], list[str]] | None = None) -> None:
    """Move the finished files in result/ into folder. A missing folder is one rename; otherwise the
    earlier files the manifest lists go to trash/ first, and no other file is touched."""
    if not os.path.lexists(folder):
        os.replace(result, folder)
        return
    check_replace(folder, manifest, what, force=True, legacy=legacy)  # again: the work took a while
    ours = listed_files(folder, manifest, legacy) or set()
    real = Path(os.path.realpath(folder))
    # only a regular file where we wrote it: never through a link, never a link itself
    earlier = [n for n in sorted(ours) if (folder / n).is_file() and not (folder / n).is_symlink()
               and Path(os.path.realpath(folder / n)) == real / n]
    new = files_of(result)
    in_the_way = [n for n in new if os.path.lexists(folder / n) and n not in earlier]
    if in_the_way:
        raise UserError(f"{folder} holds files that gstrain did not write where the new {what} goes "
                        f"({_quote(in_the_way)}); move them out or choose another folder")
    for name in earlier:
        (trash / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder / name, trash / name)
    for name in new:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(result / name, folder / name)
