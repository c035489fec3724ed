"""Full training state on disk: written atomically, found again for --resume."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from gstrain.errors import UserError
from gstrain.train.shards import gather_shards

# step_<N>.pt, or the folder step_<N>.shards of a distributed run (train/shards.py)
_CKPT_RE = re.compile(r"^step_(\d+)\.(pt|shards)$")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write to a temp file in the same folder, fsync, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "ckpt" / f"step_{step}.pt"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    folder = run_dir / "ckpt"
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _CKPT_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Save state as ckpt/step_<step>.pt and prune older ones beyond `keep` (0 keeps all)."""
    path = checkpoint_path(run_dir, step)
    atomic_torch_save(state, path)
    if keep > 0:
        remove_checkpoints(list_checkpoints(run_dir)[:-keep])
    return path


def remove_checkpoints(old: list[tuple[int, Path]]) -> None:
    """Delete checkpoints found by list_checkpoints (a sharded one is a folder)."""
    for _, path in old:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def to_host(obj: Any) -> Any:
    """A copy of a nested state (dicts, lists, tuples) with every tensor copied to host memory."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(v) for v in obj)
    return obj


class CheckpointWriter:
    """Writes checkpoints on a background thread, so training pays only for the copy to host memory.

    `save` snapshots the state (every tensor copied to the host, so later steps cannot change
    it), then writes it atomically and prunes old ones off the loop. At most one write is in
    flight: the next `save`, or `wait`, blocks until it is on disk and re-raises its error.
    """

    def __init__(self, run_dir: Path, keep: int = 2) -> None:
        self.run_dir = run_dir
        self.keep = keep
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        self.wait()
        snapshot = to_host(state)
        path = checkpoint_path(self.run_dir, step)
        self._thread = threading.Thread(target=self._write, args=(step, snapshot), name="gstrain-ckpt", daemon=False)
        self._thread.start()
        return path

    def _write(self, step: int, snapshot: dict[str, Any]) -> None:
        try:
            save_checkpoint(self.run_dir, step, snapshot, keep=self.keep)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise UserError(f"could not write a checkpoint under {self.run_dir / 'ckpt'}: {error}")


def load_latest_checkpoint(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """The newest readable checkpoint, or None if the run has none. A corrupt newest file falls
    back to the one before it (it can only be corrupt if written by something other than us)."""
    for _step, path in reversed(list_checkpoints(run_dir)):
        try:
            if path.is_dir():  # a distributed run's shards, gathered into the whole model
                return gather_shards(path, map_location)
            return torch.load(path, map_location=map_location, weights_only=False)
        except Exception:  # noqa: BLE001 - any unreadable file: try the previous checkpoint
            continue
    return None


def require_checkpoint(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    state = load_latest_checkpoint(run_dir, map_location)
    if state is None:
        raise UserError(f"no checkpoint found under {run_dir / 'ckpt'}")
    return state
