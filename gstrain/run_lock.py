"""One fit at a time per run folder: an exclusive flock on a file inside the run.

The kernel drops an flock when its holder exits, however it ends (a crash or SIGKILL too), so
the lock can never be left stale; the file itself stays (removing a lock file races with the
next holder). Only the process that writes the run takes it (rank 0 of a sharded run, through
fit's on_rank_zero, so every rank reports a refusal alike and none waits on another). eval,
render, export and view take no lock: they read checkpoints, which are renamed into place
whole, and write only their own outputs.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from gstrain.errors import UserError
from gstrain.files import os_error_text

LOCK_FILE = ".gstrain.lock"


class RunLock:
    """The lock of `run_dir`, taken by acquire() and dropped by release() (or by the process ending)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise a UserError naming the folder when another process holds it."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UserError(f"{self.path} is a symbolic link; gstrain will not lock through it") from None
            raise UserError(os_error_text(exc, self.path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f" (pid {holder})" if holder else ""
            raise UserError(f"{self.path.parent} is in use by another gstrain{who}, a fit still writing it; "
                            "wait for it to end, or choose another --out") from None
        except OSError as exc:
            os.close(fd)
            raise UserError(f"cannot lock {self.path}: {exc.strerror or exc}") from None
        self._fd = fd
        try:  # who holds it, for the next one's message (best effort: the lock is what counts)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
