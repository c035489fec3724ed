"""Distributed training: each rank owns a shard of the Gaussians (and its Adam state) and renders
the batch views whose home it is (sharded_render.py).

Set-up: every rank builds the initial model from the same seed and takes rank 0's copy; rank 0
profiles which training views touch which Gaussians, partitions them (dist.partition), counts
how much of each view each rank owns, and reorders the model so that the shards are contiguous
in rank order (the global row order of checkpoints). Each step's views go to the ranks owning
most of what they see, floor(B/W) or ceil(B/W) views per rank (assign_homes on the batch).
The step: the global batch of train.batch_size views is the
sequence one process with that batch size draws (one sampler, same seed on every rank); each
renderer divides its views' losses by B, so the summed gradient is that of the mean loss; each
owner steps Adam on its rows and densifies with the statistics its Gaussians received (children
stay with their parent's owner). W ranks with batch B equal one process with batch B, to float
tolerance (sums run in another order). Partitioning again during training moves only the
Gaussians whose owner changes (migrate.py).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gstrain.config import Config
from gstrain.data.scene import Scene
from gstrain.distributed.checkpoint import load_own_shard, save_sharded
from gstrain.distributed.launch import collective_errors
from gstrain.distributed.migrate import move_rows, owners_of, plan_order
from gstrain.distributed.partition import AccessProfile, LoadWindow, access_profile, assign_homes, view_owner_counts
from gstrain.distributed.view_partition import views_plan
from gstrain.errors import UserError
from gstrain.train.checkpoint import load_latest_checkpoint, to_host
from gstrain.train.context import ShardInfo
from gstrain.train.run_record import FitResult
from gstrain.train.shards import SOURCE_KEY, read_manifest, select_rows
from gstrain.train.trainer import Agreement, Trainer, _rng_state, _set_rng_state, seed_everything

__all__ = ["DistTrainer"]


def _check_sharded(cfg: Config) -> None:
    """What the sharded step (several ranks) cannot do yet, as one line naming what is missing."""
    if cfg.strategy.absgrad:
        raise UserError("strategy.absgrad with several ranks: the record exchange returns each owner's screen-space "
                        "gradients but not their absolute values; train it on one process or with --nproc-per-node=1")
    if cfg.train.pose_refine:
        raise UserError("train.pose_refine with several ranks: the sharded step does not carry camera gradients yet; "
                        "train it on one process or with --nproc-per-node=1")


def hold_while_paused(viewer: Any, device: torch.device, should_stop: Any) -> None:
    """fit --viewer with several ranks: while rank 0's page is paused (`viewer`, None on the
    other ranks) every rank waits. Rank 0 polls its pause a quarter second at a time and
    broadcasts it, so no rank waits in one collective for long (dist.timeout_s)."""
    flag = torch.ones(1, device=device)
    while bool(flag):
        flag.fill_(float(viewer is not None and viewer.still_paused(should_stop)))
        dist.broadcast(flag, 0)


class DistTrainer(Trainer):
    """Trainer on one rank of an initialised process group (torchrun or dist.local.run_local):
    the loop is Trainer.fit's; this class brings the sharded engine's set-up (ShardInfo), the
    ranks' agreement, partitioning, and sharded save and load."""

    signal_every_step = False  # the ranks agree on a stop at their sync steps

    def __init__(self, cfg: Config, scene: Scene, run_dir: Path, device: torch.device, log=print) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world > 1:
            _check_sharded(cfg)
        super().__init__(cfg, scene, run_dir, device, log=log if self.rank == 0 else (lambda m: None))
        if self.world > 1:
            self.strategy.for_owners(self.world)  # densification per owner (MCMC: its share of cap_max)
        # [V, W]: how many of what training view v touches rank r owns (at the last partition);
        # each step's views go to their homes by it, balanced over the ranks (assign_homes)
        self.view_counts = torch.zeros(0, self.world, dtype=torch.int64)
        # rows of the partitioned model in the whole model's order before it (rank-major)
        self.row_order = torch.arange(0)
        self.loads: list[float] = [0.0] * self.world  # every rank's, as of the last agreement
        self.partition_used = cfg.dist.partition  # the last plan's: views may fall back to locality
        with collective_errors(self.rank, cfg.dist.timeout_s):
            for p in self.params.values():  # rank 0 decides the initial model
                dist.broadcast(p.data, 0)
        # partitioned when fit starts, unless a checkpoint brings its shards (no profile wasted)

    # ----------------------------------------------------------------- partition
    def _profile(self) -> AccessProfile:
        """Which training views touch this rank's Gaussians (projected on the training device, one
        pass per view; the profile itself on the host)."""
        p = {k: v.detach() for k, v in self.params.items()}
        views = self.scene.train
        viewmats = torch.stack([c[0] for c in self.train_cams])
        Ks = torch.stack([c[1] for c in self.train_cams])
        prof = access_profile(p["means"], p["quats"], torch.exp(p["scales"]), viewmats, Ks,
                              [v.width for v in views], [v.height for v in views])  # fmt: skip
        prof.ids = prof.ids.cpu()
        return prof

    def _plan(self) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """(global order of the rows, rows per rank, [V, W] view-owner counts) of the model this
        rank holds whole (rank 0, at the start or a resume at another world size)."""
        prof = self._profile()
        order, rows = self._plan_rows(prof, self.params["means"].detach().cpu(), prof.access_counts(), 0)
        return order, rows, view_owner_counts(prof, owners_of(order, rows), self.world)

    def _plan_rows(self, prof: AccessProfile, means: torch.Tensor, load: torch.Tensor, offset: int,
                   collective: bool = False) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
        """(order, rows per rank) by dist.partition, from every row's mean and load (rank-major)
        and the profile of this process's rows (from `offset`); `collective`: every rank plans."""
        cfg = self.cfg
        self.partition_used = cfg.dist.partition
        if cfg.dist.partition != "views":
            return plan_order(cfg.dist.partition, means, load, self.world, cfg.train.seed, cfg.dist.count_weight)
        reduce, gather = (self._sum_over_ranks, self._gather_rows) if collective else (lambda t: t, lambda t: t)
        order, rows, kept = views_plan(prof, means, load, offset, self.world, cfg.dist.count_weight,
                                       cfg.dist.max_imbalance, reduce, gather)  # fmt: skip
        if not kept:
            self.partition_used = "locality"
            self.log(f"gstrain: dist.partition=views would leave a rank over {cfg.dist.max_imbalance}x the mean "
                     "load or Gaussian count, worse than locality; partitioned by locality instead")  # fmt: skip
        return order, rows

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        on_device = t.to(self.device)
        dist.all_reduce(on_device)
        return on_device.cpu()

    def _gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, t)
        return torch.cat(parts)

    def _distribute(self) -> None:
        """Every rank holds the whole model: rank 0 plans, each rank keeps its rows."""
        plan: list[Any] = [self._plan() if self.rank == 0 else None]
        dist.broadcast_object_list(plan, src=0)
        order, rows, self.view_counts = plan[0]
        self.row_order = order
        start = sum(rows[: self.rank])
        self.load_state_dict(select_rows(self.state_dict(), order[start : start + rows[self.rank]]))
        self.log(f"gstrain: {self.world} ranks, dist.partition={self.partition_used}: "
                 f"Gaussians per rank {rows}")  # fmt: skip

    def repartition(self) -> None:
        """Partition again (dist.reprofile_every, dist.rebalance_above): each rank profiles its
        own Gaussians, all share means and loads and plan alike, and only the Gaussians whose
        owner changes move, with their Adam moments and statistics (gstrain/distributed/migrate.py).
        Each rank keeps its own random state. Collective."""
        own_rng = _rng_state()
        prof = self._profile()
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, (self.params["means"].detach().cpu(), prof.access_counts()))
        sizes = [len(m) for m, _ in parts]
        offset = sum(sizes[: self.rank])
        order, rows = self._plan_rows(prof, torch.cat([m for m, _ in parts]), torch.cat([load for _, load in parts]),
                                      offset, collective=True)  # fmt: skip
        mine = owners_of(order, rows)[offset : offset + sizes[self.rank]]
        counts = view_owner_counts(prof, mine, self.world).to(self.device)  # my rows' share, summed
        dist.all_reduce(counts)
        self.view_counts = counts.cpu()
        self.load_state_dict(move_rows(to_host(self.state_dict()), order, rows, sizes, self.rank, self.device))
        _set_rng_state(own_rng)
        self.row_order = self.row_order[order]  # composed: it maps to the first partition's input
        self.log(f"gstrain: step {self.step}: partitioned again; Gaussians per rank {rows}")

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "view_counts": self.view_counts.clone()}

    def resume(self, state: dict[str, Any] | None = None) -> bool:
        """Go on from `state` (a whole-model checkpoint; None: the newest one). Shards written at
        this world size are each rank's own file again; otherwise the whole model is partitioned."""
        if state is None:
            state = load_latest_checkpoint(self.run_dir, map_location="cpu")
        if state is None:
            return False
        path = Path(state.get(SOURCE_KEY, ""))
        if SOURCE_KEY in state and int(read_manifest(path)["world"]) == self.world:
            self.partition_used = read_manifest(path).get("partition", self.partition_used)
            # same world size: each rank takes its own shard back (a bit-identical continuation)
            state = load_own_shard(path, self.rank)
            self.load_state_dict(state)
            self.view_counts = state["view_counts"]
            return True
        self.load_state_dict(state)
        self._distribute()  # another world size: partition again
        return True

    def save(self, wait: bool = False) -> Path:
        rows: list[Any] = [None] * self.world
        dist.all_gather_object(rows, len(self.params["means"]))
        return save_sharded(self.run_dir, self.step, self.state_dict(), self.rank, self.world, rows,
                            self.partition_used, keep=self.cfg.log.keep_ckpts)  # fmt: skip

    @contextmanager
    def _whole_model(self):
        """Rank 0 holds every rank's Gaussians (in the global order) inside the block."""
        if self.world == 1:  # its shard is the whole model: no copy through the host
            yield True
            return
        mine = {k: v.detach().cpu() for k, v in self.params.items()}
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        shard = self.params
        if parts is not None:
            self.params = torch.nn.ParameterDict(
                {k: torch.nn.Parameter(torch.cat([p[k] for p in parts]).to(self.device)) for k in mine}
            )
        try:
            yield self.rank == 0
        finally:
            self.params = shard

    # ----------------------------------------------------------------- step
    def _shard(self) -> ShardInfo:
        return ShardInfo(self.rank, self.world, self.homes_of)

    def homes_of(self, idx: list[int]) -> list[int]:
        """The renderer rank of each batch view: the rank owning most of what it sees, with
        floor(B/W) or ceil(B/W) views per rank (the same on every rank: a function of the batch)."""
        if self.world == 1:
            return [0] * len(idx)
        return assign_homes(self.view_counts.index_select(0, torch.tensor(idx))).tolist()

    # ----------------------------------------------------------------- the ranks' agreement
    def fit(self, resume: bool = False, state: dict[str, Any] | None = None) -> FitResult:
        """Trainer.fit on every rank; a failed collective becomes one line."""
        with collective_errors(self.rank, self.cfg.dist.timeout_s):
            return super().fit(resume, state)

    def _begin(self, resume: bool, state: dict[str, Any] | None) -> None:
        if not ((resume or state is not None) and self.resume(state)):
            if resume:
                self.log(f"gstrain: {self.run_dir} has no checkpoint yet; starting at step 0")
            seed_everything(self.cfg.train.seed)
            self._distribute()
        # dist.rebalance_above's window of loads
        self._window = LoadWindow(self.world, self.cfg.dist.rebalance_window, self.step)

    def _agree(self, loss: torch.Tensor, stop: bool, check_params: bool) -> Agreement:
        """The one host sync of a sync step, and the only collective outside the render: the
        summed loss, the Gaussian count, any rank's stop request and any non-finite parameter;
        self.loads becomes every rank's records sent since the last agreement (its load)."""
        bad = check_params and not self._params_finite()
        flags = torch.zeros(4 + self.world, dtype=torch.float64, device=self.device)
        flags[4 + self.rank] = self._records  # host numbers: one small copy, no sync
        flags[1:4] = torch.tensor([len(self.params["means"]), float(stop), float(bad)], dtype=torch.float64)
        flags[0] += loss.double()
        dist.all_reduce(flags)
        total, count, stops, bads, *self.loads = flags.tolist()
        self._records = 0
        return Agreement(total, int(count), stops > 0, bads > 0 or not math.isfinite(total))

    def _all_finite(self) -> bool:
        return not self._agree(torch.zeros((), device=self.device), False, True).bad

    def gaussian_count(self) -> int:
        return self._agree(torch.zeros((), device=self.device), False, False).count

    def _between_steps(self, step: int, end: int) -> None:
        if self.cfg.dist.reprofile_every and step % self.cfg.dist.reprofile_every == 0 and step < end:
            self.repartition()  # the same step on every rank

    def _after_agreement(self, step: int) -> None:
        """dist.rebalance_above: partition again when the busiest owner's load (records sent over
        the last dist.rebalance_window steps) exceeds that many times the mean. Every rank decides
        from the same all-reduced loads, so all of them partition at the same step."""
        limit = self.cfg.dist.rebalance_above
        if not limit or self.world == 1:
            return
        ratio = self._window.add(self.loads, step)
        if ratio is not None and ratio > limit:
            self.log(f"gstrain: step {step}: the busiest rank sent {ratio:.2f}x the mean records; partitioning again")
            self.repartition()
            self.record.rebalanced_at.append(step)

    def _hold_while_paused(self, should_stop: Any) -> None:
        hold_while_paused(self.viewer if self.lead else None, self.device, should_stop)

    def backend_label(self) -> str:
        return f"sharded/{self.renderer.backend}" if self.world > 1 else self.renderer.backend

