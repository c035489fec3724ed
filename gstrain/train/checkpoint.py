"""Full training state on disk: written atomically, found again for --resume.

A checkpoint that cannot be read is never skipped in silence: loading names it and refuses,
unless the caller allows the older one, which is then named too. A checkpoint holds only plain
data and is read without unpickling objects (train/state_file.py): one that asks for more is
refused like a damaged one.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gstrain.errors import UserError
from gstrain.train.shards import DamagedShard, gather_shards
from gstrain.train.state_file import UnsafeStateFile, load_state, save_state

# step_<N>.pt, or the folder step_<N>.shards of a distributed run (train/shards.py)
_CKPT_RE = re.compile(r"^step_(\d+)\.(pt|shards)$")
DAMAGED_SUFFIX = ".damaged"


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
    save_state(state, path)
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
    """A copy of a nested state (dicts, lists, tuples) with every tensor copied to host memory,
    complete when this returns. GPU tensors go to pinned memory without a wait each, then one
    wait per device: a pageable copy would stall the host once per tensor, at a fraction of the
    bandwidth (the training loop pays for it at every checkpoint)."""
    devices: set[torch.device] = set()
    out = _copy_to_host(obj, devices)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return out


def _copy_to_host(obj: Any, devices: set[torch.device]) -> Any:
    if torch.is_tensor(obj):
        t = obj.detach()
        if t.device.type != "cuda":
            return t.to("cpu", copy=True)
        host = torch.empty_like(t, device="cpu", pin_memory=True)  # pinned blocks are cached by torch
        host.copy_(t, non_blocking=True)
        devices.add(t.device)
        return host
    if isinstance(obj, dict):
        return {k: _copy_to_host(v, devices) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_to_host(v, devices) for v in obj)
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
        # set when the write in flight has ended: waiting on it survives a Ctrl-C, where an
        # interrupted Thread.join (CPython 3.11) may leave the thread looking finished to the
        # interpreter's exit, which then stops it inside torch.save (a native abort)
        self._done = threading.Event()
        self._done.set()

    def save(self, step: int, state: dict[str, Any]) -> Path:
        self.wait()
        snapshot = to_host(state)
        path = checkpoint_path(self.run_dir, step)
        self._done.clear()
        self._thread = threading.Thread(target=self._write, args=(step, snapshot), name="gstrain-ckpt", daemon=False)
        self._thread.start()
        return path

    def _write(self, step: int, snapshot: dict[str, Any]) -> None:
        try:
            save_checkpoint(self.run_dir, step, snapshot, keep=self.keep)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._done.wait()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, UserError):  # an OSError already put in one line by write_atomic
                raise UserError(f"could not write a checkpoint: {error}")
            raise UserError(f"could not write a checkpoint under {self.run_dir / 'ckpt'}: {error}")


def _read(path: Path, map_location: str | torch.device) -> tuple[dict[str, Any] | None, str]:
    """(state, "") for a usable checkpoint, else (None, why not)."""
    try:
        if path.is_dir():  # a distributed run's shards, gathered into the whole model
            state = gather_shards(path, map_location)
        else:
            state = load_state(path, map_location)
    except (UnsafeStateFile, DamagedShard, UserError) as exc:  # gstrain's own one-line reasons, whole
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - truncated, garbage, or from an incompatible torch
        return None, " ".join(str(exc).split())[:120] or type(exc).__name__
    if not isinstance(state, dict) or "step" not in state or "params" not in state:
        return None, "not a gstrain checkpoint"
    return state, ""


def find_checkpoint(
    run_dir: Path,
    map_location: str | torch.device = "cpu",
    allow_older: bool = False,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], Path, list[Path]] | None:
    """(state, its file, the newer damaged files) of the newest checkpoint, or None if there is none.

    A damaged newest file is a user error that names it, unless `allow_older`: then the newest
    readable one is used and `log` says which files were passed over.
    """
    found = list_checkpoints(run_dir)
    if not found:
        return None
    damaged: list[tuple[Path, str]] = []
    for _step, path in reversed(found):
        state, why = _read(path, map_location)
        if state is None:
            damaged.append((path, why))
            continue
        if damaged:
            names = ", ".join(str(p) for p, _ in damaged)
            if not allow_older:
                raise UserError(
                    f"checkpoint {damaged[0][0]} is damaged ({damaged[0][1]}); pass --allow-older-checkpoint "
                    f"to use {path} (step {state['step']}) instead"
                )
            if log is not None:
                log(f"gstrain: damaged checkpoint {names} passed over; using {path} (step {state['step']})")
        return state, path, [p for p, _ in damaged]
    if len(damaged) == 1:
        raise UserError(f"the run's only checkpoint {damaged[0][0]} is damaged ({damaged[0][1]})")
    raise UserError(f"every checkpoint under {run_dir / 'ckpt'} is damaged ({len(damaged)} files, "
                    f"newest {damaged[0][0]}: {damaged[0][1]})")


def set_aside(paths: list[Path], log: Callable[[str], None]) -> None:
    """Rename damaged checkpoints to *.damaged, so that a resumed run never overwrites one unseen."""
    for path in paths:
        target = path.with_name(path.name + DAMAGED_SUFFIX)
        path.replace(target)
        log(f"gstrain: kept the damaged {path.name} as {target}")


def load_latest_checkpoint(
    run_dir: Path,
    map_location: str | torch.device = "cpu",
    allow_older: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """The newest checkpoint's state, or None if the run has none (damaged files: see find_checkpoint)."""
    found = find_checkpoint(run_dir, map_location, allow_older, log)
    return None if found is None else found[0]


def require_checkpoint(
    run_dir: Path,
    map_location: str | torch.device = "cpu",
    allow_older: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    state = load_latest_checkpoint(run_dir, map_location, allow_older, log)
    if state is None:
        raise UserError(f"no checkpoint found under {run_dir / 'ckpt'}")
    return state
