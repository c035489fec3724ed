"""Writing files that gstrain owns: atomically, never over something it did not write.

Every file goes to a temp file in its target's folder, is fsynced, then renamed over the
target; a crash or a full disk leaves the old file whole. Only a regular file is replaced: a
symlink, device node or folder at the target is refused with one line.

Single-file outputs carry gstrain's mark inside them (a PLY header comment, an MP4 comment tag), so
it survives copying; `--force` replaces an existing file only when it carries the mark.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO

from gstrain.errors import UserError


def os_error_text(exc: OSError, target: Path | str) -> str:
    """One line for a failed write; a full disk names the device, as the user will look for it."""
    if exc.errno == errno.ENOSPC:
        return f"no space left on device while writing {target}"
    if exc.errno in (errno.EROFS,):
        return f"cannot write {target}: the file system is read-only"
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"cannot write {target}: {reason}"


def check_replaceable(path: Path) -> None:
    """Refuse a target that exists and is not a regular file (symlink, device, folder, FIFO)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(os_error_text(exc, path)) from None
    if stat.S_ISLNK(mode):
        raise UserError(f"{path} is a symbolic link; gstrain writes only new or regular files (give another path)")
    if stat.S_ISDIR(mode):
        raise UserError(f"{path} is a folder; give a file path")
    if not stat.S_ISREG(mode):
        raise UserError(f"{path} is not a regular file (a device or pipe); gstrain will not replace it")


PLY_MARK = b"comment written by gstrain"  # a header line after `format`; PLY readers skip comments
VIDEO_MARK = "written by gstrain"  # the MP4's comment tag (ffmpeg -metadata comment=...)
_MARK_SCAN = 1 << 20  # an MP4's moov box (with the tag) sits at its start or its end


def mark_ply_header(ply: bytes) -> bytes:
    """A PLY file's bytes with gstrain's comment line inserted right after its `format` line."""
    start = ply.find(b"\nformat ") + 1
    end = ply.find(b"\n", start) + 1
    if not ply.startswith(b"ply\n") or start == 0 or end == 0:
        raise ValueError("not a PLY header: no 'format' line")
    return ply[:end] + PLY_MARK + b"\n" + ply[end:]


def carries_gstrain_mark(path: Path) -> bool:
    """Whether the file holds gstrain's mark: a PLY header comment line, or an MP4 (ftyp box first)
    with the comment tag in its first or last MiB. Unreadable files carry none."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_MARK_SCAN)
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(size - _MARK_SCAN, len(head)))
            tail = fh.read(_MARK_SCAN)
    except OSError:
        return False
    if head.startswith(b"ply\n"):
        end = head.find(b"\nend_header")
        return end >= 0 and PLY_MARK in head[:end].split(b"\n")
    if head[4:8] == b"ftyp":
        mark = VIDEO_MARK.encode("ascii")
        return mark in head or mark in tail
    return False


def check_new_or_forced(path: Path, force: bool, ours: Path | None = None, markless: str | None = None) -> None:
    """Refuse to replace an existing file unless it lies under `ours` (a folder that holds only what
    gstrain wrote, such as a run's renders/), or `force` is given and the file carries gstrain's
    mark; links and devices: never. `markless` says why a format cannot carry the mark."""
    check_replaceable(path)
    if not os.path.lexists(path):
        return
    if ours is not None and is_within(path, ours):
        return
    if not force:
        raise UserError(f"--out {path} exists; pass --force to replace it, or choose another name")
    if markless is not None:
        raise UserError(f"--out {path} exists and {markless}, so gstrain cannot tell it wrote it; "
                        "move or delete it yourself, or choose another name")
    if not carries_gstrain_mark(path):
        raise UserError(f"--out {path} exists and gstrain did not write it (it has no gstrain mark); "
                        "move or delete it yourself, or choose another name")


def is_within(path: Path, folder: Path) -> bool:
    """Whether path lies somewhere under folder (links in their parents resolved)."""
    parent = Path(path).parent.resolve()
    base = Path(folder).resolve()
    return parent == base or base in parent.parents


def create_beside(path: Path, suffix: str = ".tmp") -> tuple[int, Path]:
    """A new, empty temp file in path's folder, opened for writing: (fd, its path).

    Its mode is what open() would give `path`: an existing target's permission bits (replacing
    a file keeps them), else 0666 minus the umask. mkstemp's 0600 would hide every output from
    the user's group and other readers.
    """
    try:
        keep = os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        keep = None
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        except FileExistsError:
            continue
        if keep is not None:
            os.fchmod(fd, keep)
        return fd, tmp


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """write(fh) into a temp file beside `path`, fsync, rename over it. OSError -> one-line UserError."""
    path = Path(path)
    check_replaceable(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = create_beside(path)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise UserError(os_error_text(exc, path)) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def make_dir(path: Path) -> None:
    """mkdir -p with a one-line error (read-only place, a file in the way, full disk)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{path} exists and is not a folder") from None
    except OSError as exc:
        raise UserError(os_error_text(exc, path)) from None
