"""Writing sharded checkpoints: every rank its own file, published only when all succeeded.

Each rank writes rank<r>.pt (stamped with its rank, the step and the world size) into a temp
folder; every rank's outcome and its file's size and sha256 are gathered, then rank 0 writes the
manifest and renames the folder to ckpt/step_<N>.shards (train/shards.py reads and checks it).
A rank that fails to write fails every rank, so no rank publishes a checkpoint missing a shard.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gstrain.errors import UserError
from gstrain.train.checkpoint import list_checkpoints, remove_checkpoints, to_host
from gstrain.train.shards import (
    MANIFEST,
    MANIFEST_FORMAT,
    SUFFIX,
    DamagedShard,
    file_digest,
    load_shard,
    read_manifest,
    shard_file,
)
from gstrain.train.state_file import save_state

__all__ = ["load_own_shard", "save_sharded"]


def load_own_shard(folder: Path, rank: int) -> dict[str, Any]:
    """This rank's shard of the sharded checkpoint `folder`, checked against its manifest; a
    mismatch is one line naming the file. Reads no other rank's file and needs no collective."""
    try:
        return load_shard(folder, rank, read_manifest(folder))
    except DamagedShard as exc:
        raise UserError(f"checkpoint {folder} is damaged ({exc})") from None


def save_sharded(run_dir: Path, step: int, state: dict[str, Any], rank: int, world: int, rows: list[int],
                 partition: str, keep: int = 2) -> Path:  # fmt: skip
    """Collective: every rank calls it with its shard's state. Returns the published folder.
    rows: every rank's row count (the manifest's global order is rank-major)."""
    folder = run_dir / "ckpt" / f"step_{step}{SUFFIX}"
    tmp = run_dir / "ckpt" / f".step_{step}{SUFFIX}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died mid-write
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    outcome: dict[str, Any]
    try:
        path = shard_file(tmp, rank)
        save_state(to_host({**state, "shard": {"rank": rank, "world": world, "step": step}}), path)
        outcome = {"file": path.name, **file_digest(path)}
    except (OSError, UserError) as exc:  # write_atomic puts an OSError in one line (a UserError)
        outcome = {"error": str(exc)}
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, outcome)  # every shard on disk, or none published
    failed = [o["error"] for o in outcomes if "error" in o]
    if failed:
        mine = outcome.get("error")
        raise UserError(f"could not write a sharded checkpoint under {run_dir / 'ckpt'}"
                        + (f": {mine}" if mine else f" (another rank failed to write its shard: {failed[0]})"))
    if rank == 0:
        manifest = {"format": MANIFEST_FORMAT, "step": step, "world": world, "partition": partition, "rows": rows,
                    "shards": outcomes}  # fmt: skip
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        if keep > 0:
            remove_checkpoints(list_checkpoints(run_dir)[:-keep])
    dist.barrier()
    return folder
