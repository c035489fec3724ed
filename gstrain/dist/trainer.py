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
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from gstrain.config import Config
from gstrain.data.scene import Scene
from gstrain.dist.checkpoint import save_sharded
from gstrain.dist.exchange import CommCounter
from gstrain.dist.launch import collective_errors
from gstrain.dist.migrate import move_rows, owners_of, plan_order
from gstrain.dist.partition import AccessProfile, LoadWindow, access_profile, assign_homes, view_owner_counts
from gstrain.dist.sharded_render import ViewBatch, render_sharded
from gstrain.dist.view_partition import views_plan
from gstrain.errors import UserError
from gstrain.metrics import psnr
from gstrain.train.checkpoint import list_checkpoints, load_latest_checkpoint, to_host
from gstrain.train.gaussian_count import check_gaussians_left
from gstrain.train.masking import masked_loss
from gstrain.train.optim import current_lrs
from gstrain.train.run_record import FitResult, RunRecord, write_run_record
from gstrain.train.shards import SOURCE_KEY, read_manifest, select_rows, shard_file
from gstrain.train.timing import timed_step
from gstrain.train.trainer import Trainer, _rng_state, _set_rng_state, seed_everything

__all__ = ["DistTrainer"]


class _Signals:
    """Ctrl-C / SIGTERM ask for a stop; the ranks agree on it at the next flag all-reduce. Never
    aborts on a second signal: torchrun forwards SIGTERM after the terminal's SIGINT."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        def handler(signum: int, frame: Any) -> None:
            self.requested = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, but one tensor becomes a view (no copy launched for a batch of one)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


class DistTrainer(Trainer):
    """Trainer on one rank of an initialised process group (torchrun or dist.local.run_local)."""

    def __init__(self, cfg: Config, scene: Scene, run_dir: Path, device: torch.device, log=print) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.strategy.name != "default" or cfg.strategy.absgrad:
            raise UserError("distributed training supports strategy.name=default without strategy.absgrad")
        super().__init__(cfg, scene, run_dir, device, log=log if self.rank == 0 else (lambda m: None))
        self.graphs = None  # a sharded step exchanges records between ranks: not a CUDA graph
        # [V, W]: how many of what training view v touches rank r owns (at the last partition);
        # each step's views go to their homes by it, balanced over the ranks (assign_homes)
        self.view_counts = torch.zeros(0, self.world, dtype=torch.int64)
        # rows of the partitioned model in the whole model's order before it (rank-major)
        self.row_order = torch.arange(0)
        self.comm = CommCounter()  # this rank's exchange bytes, folded into the run record every step
        self._records = 0  # records this rank's Gaussians sent since the ranks last agreed
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
        owner changes move, with their Adam moments and statistics (gstrain/dist/migrate.py).
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
            try:
                state = torch.load(shard_file(path, self.rank), map_location="cpu", weights_only=False)
            except Exception as exc:  # noqa: BLE001 - any unreadable shard: one line, not a traceback
                raise UserError(f"cannot read {shard_file(path, self.rank)}: {exc}") from None
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
                            self.partition_used, self.device, keep=self.cfg.log.keep_ckpts)  # fmt: skip

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
    def homes_of(self, idx: list[int]) -> list[int]:
        """The renderer rank of each batch view: the rank owning most of what it sees, with
        floor(B/W) or ceil(B/W) views per rank (the same on every rank: a function of the batch)."""
        if self.world == 1:
            return [0] * len(idx)
        return assign_homes(self.view_counts.index_select(0, torch.tensor(idx))).tolist()

    def train_step(self, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any, Any]:
        """One step of the global batch. Returns (this rank's share of the loss, terms, its first
        rendered view and target, or None and None when it rendered none)."""
        cfg, b = self.cfg, self.cfg.train.batch_size
        with self.timer.phase("data"):
            idx = [self.sampler.next() for _ in range(b)]
            views = [self.scene.train[i] for i in idx]
            cams = [self.train_cams[i] for i in idx]
            batch = ViewBatch(_stacked([c[0] for c in cams]), _stacked([c[1] for c in cams]),
                              [v.width for v in views], [v.height for v in views], self.homes_of(idx))  # fmt: skip
        with self.timer.phase("forward"):
            out = render_sharded(self.params, batch, self.active_sh_degree(), self.background, cfg.dist.compress,
                                 counter=self.comm, backend=self.renderer.backend, options=self.renderer.options)
        self.strategy.step_pre_backward(self.params, self.optimizers, step, out.owner_info)
        # one rank exchanged nothing (no zero term to tie in); one view has no mean to take
        loss, terms, gts = (out.zero_term if self.world > 1 else None), {}, []
        with self.timer.phase("loss"):
            for j, i in enumerate(out.views):
                gts.append(self.train_images[idx[i]].float() / 255.0)
                part, parts = masked_loss(self.runner.loss_fn, out.images[j], gts[-1], cfg.train.ssim_lambda,
                                          self.train_masks[idx[i]], cfg.data.mask_mode, self.background)  # fmt: skip
                share = part / b if b > 1 else part
                loss = share if loss is None else loss + share
                for k, t in parts.items():
                    t = t.detach() / b if b > 1 else t.detach()
                    terms[k] = terms[k] + t if k in terms else t
        loss = out.zero_term if loss is None else loss
        if self.runner.finish(self.params, self.optimizers, step, loss, lambda: out.owner_info, self.scheduler):
            # refinement steps are the same on every rank, so all join this sum: no deadlock
            total = self._sum_over_ranks(torch.tensor([len(self.params["means"])]))
            check_gaussians_left(int(total[0]), cfg.strategy, step + 1)  # before the next step renders nothing
        self._records += out.owner_records
        self.record.add_pairs(out.pairs)  # this rank's views (rank 0 writes the record)
        sent, received = self.comm.total()  # both exchanges of the step, counts known on the host
        self.record.comm_sent += sent
        self.record.comm_received += received
        self.comm.reset()
        image = out.images[0].detach() if out.views else None
        return loss.detach(), terms, image, gts[0] if gts else None

    # ----------------------------------------------------------------- loop
    def fit(self, resume: bool = False, state: dict[str, Any] | None = None) -> FitResult:
        """As Trainer.fit: from `state` or, with `resume`, the newest checkpoint; else from step 0."""
        with collective_errors(self.rank, self.cfg.dist.timeout_s):
            return self._fit(resume, state)

    def _agree(self, loss: torch.Tensor, stop: bool, check_params: bool) -> tuple[float, int, bool, bool]:
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
        return total, int(count), stops > 0, bads > 0 or not math.isfinite(total)

    def _rebalance_if_uneven(self, step: int) -> None:
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

    def _fit(self, resume: bool, state: dict[str, Any] | None) -> FitResult:
        cfg, lead = self.cfg, self.rank == 0
        if not ((resume or state is not None) and self.resume(state)):
            if resume:
                self.log(f"gstrain: {self.run_dir} has no checkpoint yet; starting at step 0")
            seed_everything(cfg.train.seed)
            self._distribute()
        total = cfg.train.steps
        end = cfg.train.stop_at or total
        start_step = self.step
        self.record = RunRecord(first_step=start_step, max_gaussians=0)
        self._window = LoadWindow(self.world, cfg.dist.rebalance_window, start_step)  # dist.rebalance_above's
        self._evaluated_at = -1
        eval_steps, save_steps = set(cfg.log.eval_steps) | {end}, set(cfg.log.save_steps) | {end}
        status, ckpt, saved_at, last_psnr = "done", None, -1, float("nan")
        t_start = time.perf_counter()
        bar = tqdm(total=end, initial=start_step, desc="fit", dynamic_ncols=True, unit="step", disable=not lead)
        with _Signals() as signals:
            while self.step < end:
                self.timer.enabled = timed_step(self.step, cfg.log.time_every)
                loss, terms, image, gt = self.train_step(self.step)
                self.step += 1
                step = self.step
                if cfg.dist.reprofile_every and step % cfg.dist.reprofile_every == 0 and step < end:
                    self.repartition()  # the same step on every rank
                logging = step % cfg.log.tb_every == 0
                saving = bool(cfg.log.ckpt_every and step % cfg.log.ckpt_every == 0) or step == end
                # ranks agree every progress_every steps, not every step: each agreement is a host sync
                if not (logging or saving or step % cfg.log.progress_every == 0 or step == end):
                    continue
                loss_value, count, stop, bad = self._agree(loss, signals.requested, saving)
                self.record.max_gaussians = max(self.record.max_gaussians, count)
                if bad:
                    status = "nan"
                    break
                if not stop and step < end:
                    self._rebalance_if_uneven(step)
                if image is not None:
                    last_psnr = float(psnr(image, gt))
                bar.set_postfix(loss=f"{loss_value:.4f}", psnr=f"{last_psnr:.2f}", gaussians=count)
                bar.update(step - bar.n)
                if logging:  # every rank: the timer's pending events are drained either way
                    self._log_window(step, loss_value, count)
                if step in eval_steps or step in save_steps:
                    self._evaluate_and_export(step, step in eval_steps, step in save_steps)
                if saving or stop:
                    ckpt, saved_at = self.save(), step
                if stop:
                    status = "interrupted"
                    break
        bar.close()
        seconds = time.perf_counter() - t_start
        if status == "done" and self.step < total:
            status = "stopped"
        if status == "interrupted":
            self.log(f"gstrain: interrupted at step {self.step}; checkpoint saved to {ckpt}")
        if status == "nan":
            good = list_checkpoints(self.run_dir)
            ckpt = good[-1][1] if good else None
            self.log(f"gstrain: loss became NaN by step {self.step}; stopped. last good checkpoint: {ckpt}")
        if ckpt is None and saved_at < 0:
            good = list_checkpoints(self.run_dir)
            ckpt = good[-1][1] if good else None
        final = self._final_eval() if status in ("done", "stopped") else None
        count = self._agree(torch.zeros(()), False, False)[1]
        result = FitResult(status=status, step=self.step, seconds=seconds, num_gaussians=count,
                           initial_test_psnr=None, final_test_psnr=final["psnr"] if final else None,
                           checkpoint=ckpt, final_train_psnr=last_psnr if math.isfinite(last_psnr) else None)
        if lead:
            on_ours = self.renderer.backend == "cuda"
            write_run_record(self.run_dir, self.record, result, final, None, f"sharded/{self.renderer.backend}",
                             self.cfg.render.atomic_mode if on_ours else None, self.renderer.atomic_threshold,
                             self.device)  # fmt: skip
            if self.writer is not None:
                self.writer.close()
        return result

    def _evaluate_and_export(self, step: int, evaluate: bool, export: bool) -> None:
        if evaluate:
            self._evaluated_at = step
        with self._whole_model() as lead:
            if not lead:
                return
            metrics = self.evaluate_test() if evaluate else None
            if metrics is not None:
                self.record.test_history.append({"step": step, **metrics})
                self._tb().add_scalar("test/psnr", metrics["psnr"], step)
                self._tb().add_scalar("test/ssim", metrics["ssim"], step)
                tqdm.write(f"step {step}: test PSNR {metrics['psnr']:.2f} SSIM {metrics['ssim']:.4f}")
            if export:
                self.export_ply()

    def _final_eval(self) -> dict[str, float] | None:
        if self._evaluated_at == self.step:  # known on every rank: they gather together or not at all
            last = self.record.test_history[-1] if self.record.test_history else None
            return last if last is not None and last["step"] == self.step else None
        with self._whole_model() as lead:
            return self.evaluate_test() if lead else None

    def _log_window(self, step: int, loss: float, count: int) -> None:
        """The timing window into the run record, and (rank 0) TensorBoard: rank 0's phases."""
        window = self.timer.pending_steps
        phase_ms = self.timer.summary()
        self.record.add_window(phase_ms, self.timer.last_host_ms, window)
        if self.rank != 0:
            return
        tb = self._tb()
        tb.add_scalar("train/loss", loss, step)
        tb.add_scalar("train/num_gaussians", count, step)
        for name, lr in current_lrs(self.optimizers).items():
            tb.add_scalar(f"lr/{name}", lr, step)
        for phase, ms in phase_ms.items():
            tb.add_scalar(f"time_ms/{phase}", ms, step)
