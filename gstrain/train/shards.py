"""Sharded checkpoints (written by distributed runs, gstrain/dist/checkpoint.py), read back whole.

A sharded checkpoint is a folder ckpt/step_<N>.shards/ with manifest.json (step, world, partition,
rows per rank) and rank<r>.pt, each rank's own trainer state: its rows of the Gaussians, of Adam's
moments and of the strategy's statistics, plus the state every rank shares (step, sampler,
scheduler) and its own random state. The global row order is rank-major: rank 0's rows, then
rank 1's, and so on. `gather_shards` rebuilds the single-process checkpoint of that order, so
eval, export, render and a resume at another world size read a sharded run like any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gstrain.errors import UserError

MANIFEST = "manifest.json"
SOURCE_KEY = "sharded_from"
SUFFIX = ".shards"

__all__ = [
    "MANIFEST", "SOURCE_KEY", "SUFFIX", "gather_shards", "merge_shards", "read_manifest", "select_rows", "shard_file",
]  # fmt: skip


def shard_file(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.pt"


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"sharded checkpoint {folder}: cannot read {MANIFEST}: {exc}") from None
    return manifest


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
    world = int(manifest["world"])
    shards = [torch.load(shard_file(folder, r), map_location=map_location, weights_only=False) for r in range(world)]
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
