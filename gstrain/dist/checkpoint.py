"""Writing sharded checkpoints: every rank its own file, published only when all succeeded.

Each rank writes rank<r>.pt into a temp folder; after a barrier rank 0 writes the manifest and
renames the folder to ckpt/step_<N>.shards (train/shards.py reads it). A rank that fails to
write fails the all-reduce that follows, so no rank publishes a checkpoint missing a shard.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gstrain.errors import UserError
from gstrain.train.checkpoint import atomic_torch_save, list_checkpoints, remove_checkpoints, to_host
from gstrain.train.shards import MANIFEST, SUFFIX, shard_file

__all__ = ["save_sharded"]


def save_sharded(run_dir: Path, step: int, state: dict[str, Any], rank: int, world: int, rows: list[int],
                 partition: str, device: torch.device, keep: int = 2) -> Path:  # fmt: skip
    """Collective: every rank calls it with its shard's state. Returns the published folder.
    rows: every rank's row count (the manifest's global order is rank-major)."""
    folder = run_dir / "ckpt" / f"step_{step}{SUFFIX}"
    tmp = run_dir / "ckpt" / f".step_{step}{SUFFIX}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died mid-write
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    ok = torch.ones(1, device=device)
    error = ""
    try:
        atomic_torch_save(to_host({**state, "shard": {"rank": rank, "world": world}}), shard_file(tmp, rank))
    except OSError as exc:
        ok.zero_()
        error = str(exc)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every shard on disk, or none published
    if float(ok) < 1:
        raise UserError(f"could not write a sharded checkpoint under {run_dir / 'ckpt'}"
                        + (f": {error}" if error else " (another rank failed to write its shard)"))
    if rank == 0:
        manifest = {"format": 1, "step": step, "world": world, "partition": partition, "rows": rows}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
        if keep > 0:
            remove_checkpoints(list_checkpoints(run_dir)[:-keep])
    dist.barrier()
    return folder
