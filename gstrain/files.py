"""Writing files that gstrain owns: atomically, never over something it did not write.

Every file goes to a temp file in its target's folder, is fsynced, then renamed over the
target; a crash or a full disk leaves the old file whole. Only a regular file is replaced: a
symlink, device node or folder at the target is refused with one line.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
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


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """write(fh) into a temp file beside `path`, fsync, rename over it. OSError -> one-line UserError."""
    path = Path(path)
    check_replaceable(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
