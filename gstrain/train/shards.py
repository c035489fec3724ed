"""Sharded checkpoints (written by distributed runs, gstrain/distributed/checkpoint.py), read back whole.

A sharded checkpoint is a folder ckpt/step_<N>.shards/ with manifest.json (step, world, partition,
rows per rank, every shard's size and sha256) and rank<r>.pt, each rank's own trainer state: its
rows of the Gaussians, of Adam's moments and of the strategy's statistics, plus the state every
rank shares (step, sampler, scheduler) and its own random state. The global row order is
rank-major: rank 0's rows, then rank 1's, and so on. `gather_shards` rebuilds the single-process
checkpoint of that order, so eval, export, render and a resume at another world size read a
sharded run like any other.

Each shard also says which rank, step and world size it belongs to. A shard that is not the one
the manifest lists (copied from another step, another rank's file, changed since) is refused by
name, like any damaged checkpoint, before any rank trains on it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from gstrain.errors import UserError
from gstrain.train.state_file import UnsafeStateFile, load_state

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # 2: the manifest lists every shard's bytes and sha256 (1 did not)
SOURCE_KEY = "sharded_from"
SUFFIX = ".shards"

__all__ = [
    "MANIFEST", "MANIFEST_FORMAT", "SOURCE_KEY", "SUFFIX", "DamagedShard", "file_digest", "gather_shards",
    "load_shard", "merge_shards", "read_manifest", "select_rows", "shard_file",
]  # fmt: skip


class DamagedShard(ValueError):
    """A shard that is unreadable or not the one its manifest lists; the message names its file."""


def shard_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes", "sha256"} of a file, as the manifest lists each shard."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"sharded checkpoint {folder}: cannot read {MANIFEST}: {exc}") from None
    if not (isinstance(manifest, dict) and isinstance(manifest.get("step"), int)
            and isinstance(manifest.get("world"), int) and manifest["world"] >= 1):  # fmt: skip
        raise UserError(f"sharded checkpoint {folder}: {MANIFEST} does not give the step and world size")
    named = folder.name.removeprefix("step_").removesuffix(SUFFIX)
    if named.isdigit() and int(named) != manifest["step"]:
        raise UserError(f"sharded checkpoint {folder}: {MANIFEST} is from step {manifest['step']}, not {named}")
    return manifest


def load_shard(folder: Path, rank: int, manifest: dict[str, Any], map_location: str | torch.device = "cpu",
               ) -> dict[str, Any]:  # fmt: skip
    """Rank `rank`'s trainer state from `folder`, refused (DamagedShard) unless it is the shard the
    manifest lists: that rank's, of that step and world size, with that size and sha256."""
    path = shard_file(folder, rank)
    name, step, world = path.name, manifest["step"], manifest["world"]
    try:
        state = load_state(path, map_location)
    except UnsafeStateFile as exc:
        raise DamagedShard(f"{name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - missing, truncated, garbage: named in one line
        raise DamagedShard(f"{name} cannot be read: {' '.join(str(exc).split())[:120]}") from None
    meta = state.get("shard") if isinstance(state, dict) else None
    if not isinstance(meta, dict) or not isinstance(state.get("step"), int) or "params" not in state:
        raise DamagedShard(f"{name} is not a shard of a gstrain checkpoint")
    if meta.get("rank") != rank:
        raise DamagedShard(f"{name} holds rank {meta.get('rank')}'s shard, not rank {rank}'s")
    if meta.get("world") != world:
        raise DamagedShard(f"{name} is from a run of {meta.get('world')} ranks, not {world}")
    if state["step"] != step:
        raise DamagedShard(f"{name} is from step {state['step']}, not {step}")
    rows = manifest.get("rows")
    if isinstance(rows, list) and len(rows) == world and len(state["params"]["means"]) != rows[rank]:
        raise DamagedShard(f"{name} holds {len(state['params']['means'])} Gaussians, the manifest {rows[rank]}")
    listed = manifest.get("shards")  # absent in format 1
    if listed is not None:
        if not (isinstance(listed, list) and len(listed) == world):
            raise DamagedShard(f"{MANIFEST} lists {len(listed) if isinstance(listed, list) else 'no'} shards, "
                               f"not {world}")  # fmt: skip
        entry = listed[rank] if isinstance(listed[rank], dict) else {}
        if file_digest(path) != {"bytes": entry.get("bytes"), "sha256": entry.get("sha256")}:
            raise DamagedShard(f"{name} is not the file {MANIFEST} lists: its size or sha256 differs, so it "
                               "was changed since it was written or copied from another checkpoint")
    return state


def _cat_rows(parts: list[Any], rows: list[int]) -> Any:
    """Row-aligned tensors (one row per Gaussian) are concatenated in rank order; anything else
    is the same on every rank and rank 0's copy is kept."""
    first = parts[0]
    if torch.is_tensor(first) and first.dim() >= 1 and all(
        torch.is_tensor(p) and p.dim() >= 1 and p.shape[0] == n for p, n in zip(parts, rows, strict=True)
    ):
        return torch.cat(parts)
    return first


def _gather_optimizer(states: list[dict[str, Any]], rows: list[int]) -> dict[str, Any]:
    out = {"param_groups": states[0]["param_groups"], "state": {}}
    for key, value in states[0]["state"].items():
        per_rank = [s["state"].get(key, {}) for s in states]
        out["state"][key] = {name: _cat_rows([p[name] for p in per_rank], rows) for name in value}
    return out


def gather_shards(folder: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The whole-model checkpoint (the single-process trainer's format) of a sharded one."""
    manifest = read_manifest(folder)
    shards = [load_shard(folder, r, manifest, map_location) for r in range(manifest["world"])]
    # where it came from: a resume at the same world size takes each rank's own file instead
    return {**merge_shards(shards), SOURCE_KEY: str(folder)}


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's trainer state (rank order) as the one state of the whole model."""
    rows = [len(s["params"]["means"]) for s in shards]
    state = dict(shards[0])  # step, sampler, scheduler, config and rank 0's random state
    state["params"] = {k: torch.cat([s["params"][k] for s in shards]) for k in shards[0]["params"]}
    state["optimizers"] = {name: _gather_optimizer([s["optimizers"][name] for s in shards], rows)
                           for name in shards[0]["optimizers"]}  # fmt: skip
    state["strategy"] = {k: _cat_rows([s["strategy"][k] for s in shards], rows) for k in shards[0]["strategy"]}
    state.pop("shard", None)
    return state


def select_rows(state: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The trainer state of the Gaussians `rows` (in that order): the inverse of gather_shards.
    Row-aligned tensors of the parameters, Adam's moments and the strategy's statistics are
    indexed; everything else (step, sampler, scheduler, random state) is kept."""
    n = len(state["params"]["means"])

    def pick(v: Any) -> Any:
        if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == n:
            return v.index_select(0, rows.to(v.device))
        return v

    out = dict(state)
    out["params"] = {k: pick(v) for k, v in state["params"].items()}
    out["optimizers"] = {
        name: {**opt, "state": {key: {k: pick(v) for k, v in s.items()} for key, s in opt["state"].items()}}
        for name, opt in state["optimizers"].items()
    }
    out["strategy"] = {k: pick(v) for k, v in state["strategy"].items()}
    return out
