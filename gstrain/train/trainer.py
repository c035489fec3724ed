"""The training loop: the one loop of gstrain, for one process and for every rank under torchrun.

Data flows one way: scene -> model -> render -> loss -> backward -> optimizer -> strategy. The
loop owns the schedule (steps, evaluations, checkpoints, PLY exports, Ctrl-C / SIGTERM, the NaN
stop, progress and logging); each step goes through the step engine chosen at set-up
(train/engine.py), which works on a StepContext and never calls back. The distributed trainer
(gstrain/distributed/trainer.py) brings only what is its own: the sharded engine, the ranks' agreement
on stop / NaN / progress every log.progress_every steps, partitioning, and sharded save and load.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gstrain.config import Config
from gstrain.data.image_store import ResidentStore, TrainImages, build_image_store, decoded
from gstrain.data.scene import Scene
from gstrain.errors import UserError
from gstrain.metrics import psnr
from gstrain.model import save_ply
from gstrain.render import Renderer
from gstrain.train import moment_modes
from gstrain.train.appearance import build_corrections
from gstrain.train.checkpoint import CheckpointWriter, list_checkpoints, load_latest_checkpoint
from gstrain.train.context import ShardInfo, StepContext, TrainViews
from gstrain.train.corrections import corrections_state, engine_note, graph_refusers, saved_correction
from gstrain.train.engine import StepEngine, build_engine, choose_engine
from gstrain.train.gaussian_count import check_gaussians_left
from gstrain.train.graph_step import held_pool_margin
from gstrain.train.initial_model import initial_params
from gstrain.train.masking import prepare_mask
from gstrain.train.memory_budget import budget_free, budget_gate
from gstrain.train.optim import build_means_scheduler, build_optimizers
from gstrain.train.pose_refine import attach_pose_refiner, describe_change
from gstrain.train.reporting import RunReporting, memory_text
from gstrain.train.run_record import FitResult, RunRecord, seconds_since_process_start, write_run_record
from gstrain.train.run_state import Agreement, ViewSampler, _Due, _rng_state, _set_rng_state, _StopFlag, seed_everything
from gstrain.train.step import StepRunner, StepView
from gstrain.train.strategies import build_strategy, strategy_class
from gstrain.train.strategies.default import DefaultStrategy  # noqa: F401 - gsplat loads with the trainer, not mid-start-up
from gstrain.train.timing import PhaseTimer, timed_step

__all__ = ["Agreement", "FitResult", "Trainer", "ViewSampler", "seed_everything"]


class Trainer(RunReporting):
    rank, world = 0, 1
    # one process polls Ctrl-C at every step (and a second one aborts); ranks agree on it at sync steps
    signal_every_step = True

    def __init__(self, cfg: Config, scene: Scene, run_dir: Path, device: torch.device, log=print) -> None:
        if not scene.train:
            raise UserError("the scene has no training views (all images went to the test split)")
        self.cfg = cfg
        self.scene = scene
        self.run_dir = run_dir
        self.device = device
        self.log = log
        began = time.perf_counter()  # start-up phases, for train_summary.json's startup_phases
        self.background = torch.tensor(cfg.data.background, dtype=torch.float32, device=device)
        self.renderer = Renderer(cfg.render, device, absgrad=cfg.strategy.absgrad, dev=cfg.dev)
        self.renderer.set_training_views(scene.train)  # render.filter_3d's sampling rates
        self.setup_seconds = {"renderer (CUDA context, kernels)": time.perf_counter() - began}
        # Images as uint8 (a quarter of float32), converted per step; where they live between
        # steps is data.images_on's (data/image_store.py): on the device, or fetched a step ahead.
        began = time.perf_counter()
        self.image_store = build_image_store(scene.train, cfg.data.images_on, device, log=log,
                                             per_step=cfg.train.batch_size, device_free=budget_free(cfg, device),
                                             decode_in=cfg.dev.decode_in,
                                             decode_workers=cfg.data.decode_workers,
                                             fused_remap=cfg.dev.fused_remap)  # fmt: skip
        if self.image_store.where != "disk":  # the test views are scored every evaluation: decoded once
            scene.test = decoded(scene.test)
        self.setup_seconds["images"] = time.perf_counter() - began
        store = self.image_store
        images = store.images if isinstance(store, ResidentStore) else TrainImages(store)  # resident: the list
        views = TrainViews(images, [(v.viewmat.to(device), v.K.to(device)) for v in scene.train],
                           [prepare_mask(v.mask, device) for v in scene.train])  # fmt: skip
        self.sampler = ViewSampler(len(scene.train), cfg.train.seed)
        # host/disk: the first steps' images start now, while the model and the engine are built
        # (a resume's checkpoint moves the sampler; fit() fetches ahead again from there)
        views.prefetch(self.sampler)
        began = time.perf_counter()
        params = self._initial_params()
        self.setup_seconds["initial model"] = time.perf_counter() - began
        began = time.perf_counter()
        optimizers = build_optimizers(params, cfg.optim, scene.extent)
        on_device = sum(math.prod(s) for s in views.shapes()) if self.image_store.where == "gpu" else 0
        pool = held_pool_margin(cfg, self.renderer, device, views.masks)  # graphs' pool beside eager steps
        self.gate = budget_gate(cfg, on_device, views.shapes(), log, pool, gpu=device.type == "cuda")  # max_memory_gib
        self.gate.check_start(len(params["means"]))
        strategy_cfg = cfg.strategy
        if strategy_class(cfg.strategy.name).capped:  # its own cap, lowered to what fits (said once)
            strategy_cfg = replace(cfg.strategy, cap_max=self.gate.cap_for(cfg.strategy.cap_max))
        self.strategy = build_strategy(strategy_cfg, scene.extent, device, cfg.dev)
        self.strategy.gate = self.gate
        self.strategy.check(params, optimizers)
        self.step = 0
        self.timer = PhaseTimer(device)
        self.runner = StepRunner(cfg, self.renderer, self.strategy, self.timer, device)
        # per-view corrections on the step (train/corrections.py): train.pose_refine, train.appearance
        self.pose_refiner = attach_pose_refiner(cfg, scene.train, scene.points, scene.extent, self.runner, device)
        self.runner.corrections.extend(build_corrections(cfg, len(scene.train), device))
        self.ctx = StepContext(
            cfg=cfg, device=device, params=params, optimizers=optimizers,
            scheduler=build_means_scheduler(optimizers["means"], cfg.optim, cfg.train.steps),
            strategy=self.strategy, runner=self.runner, views=views, sampler=self.sampler,
            sh_degree=self.active_sh_degree, timer=self.timer, background=self.background,
            shard=self._shard(), batch_size=cfg.train.batch_size,
        )  # fmt: skip
        engine = choose_engine(self.ctx)
        if graph_refusers(self.ctx.corrections) and engine != "graph" and cfg.dev.cuda_graphs and device.type == "cuda":
            log(engine_note(self.ctx.corrections, engine))
        self.engine: StepEngine = build_engine(engine, self.ctx)
        self.setup_seconds["optimizers, strategy and step engine"] = time.perf_counter() - began
        self._viewer = None  # gstrain.viewer.live.LiveViewer for fit --viewer (set by the CLI)
        self.watch_every = 0  # fit --viewer under several ranks: steps between the whole-model refreshes
        self.record = RunRecord()  # what this process reports in train_summary.json
        self._window_start: tuple[int, float] | None = None  # (step, perf_counter) of the timing window
        self._evaluated_at = -1  # the last step evaluated on the test views
        self._records = 0  # records this rank's Gaussians sent since the ranks last agreed (sharded)
        self.writer = None
        self.checkpoints = CheckpointWriter(run_dir, keep=cfg.log.keep_ckpts)

    def _shard(self) -> ShardInfo | None:
        """The sharded engine's set-up (the distributed trainer's); None: one process."""
        return None

    # the model lives in the engine's context: one owner, replaced on load
    params = property(lambda self: self.ctx.params, lambda self, v: setattr(self.ctx, "params", v))
    optimizers = property(lambda self: self.ctx.optimizers, lambda self, v: setattr(self.ctx, "optimizers", v))
    scheduler = property(lambda self: self.ctx.scheduler, lambda self, v: setattr(self.ctx, "scheduler", v))
    train_images = property(lambda self: self.ctx.views.images)
    train_cams = property(lambda self: self.ctx.views.cams)
    train_masks = property(lambda self: self.ctx.views.masks)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def viewer(self) -> Any:
        return self._viewer

    @viewer.setter
    def viewer(self, viewer: Any) -> None:
        self._viewer = viewer
        self.ctx.watched = viewer is not None  # the graph engine runs watched steps eagerly

    @property
    def graphs(self) -> Any:
        """The CUDA-graph engine when it runs the steps, else None (bench scripts read it)."""
        return self.engine if self.engine.name == "graph" else None

    @graphs.setter
    def graphs(self, engine: Any) -> None:
        self.engine = engine if engine is not None else build_engine("batch" if self.ctx.batch_size > 1 else "eager",
                                                                     self.ctx)  # fmt: skip

    def _initial_params(self) -> torch.nn.ParameterDict:
        """The model the run starts from (train/initial_model.py); bench scripts that start from
        a model of their own override it."""
        return initial_params(self.cfg, self.scene, self.device, self.log)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "params": {k: v.detach() for k, v in self.params.items()},  # CheckpointWriter copies
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "scheduler": self.scheduler.state_dict(),
            "strategy": self.strategy.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": _rng_state(),
            "config": self.cfg.to_dict(),
            **corrections_state(self.ctx.corrections),
        }

    def _load_corrections(self, state: dict[str, Any]) -> None:
        for correction in self.ctx.corrections:
            saved = saved_correction(state, correction.name)
            if saved is None:
                raise UserError(f"the checkpoint at step {state['step']} has no {correction.name} corrections; "
                                "resume with the config it was trained with")
            correction.load_state_dict(saved)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.to(self.device)) for k, v in state["params"].items()}
        )
        self.optimizers = build_optimizers(self.params, self.cfg.optim, self.scene.extent)
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][name])
        moment_modes.restore(self.optimizers, state["optimizers"], self.cfg.optim.moments, self.log)
        self.scheduler = build_means_scheduler(self.optimizers["means"], self.cfg.optim, self.cfg.train.steps)
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.load_state_dict(state["strategy"], self.device)
        self.sampler.load_state_dict(state["sampler"])
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        self._load_corrections(state)
        self.engine.state_replaced()

    def resume(self) -> bool:
        state = load_latest_checkpoint(self.run_dir, map_location="cpu")
        if state is None:
            return False
        self.load_state_dict(state)
        return True

    def training_views(self) -> list[Any]:
        """The training views as the model learned them: with train.pose_refine, at their refined poses."""
        return self.pose_refiner.refined(self.scene.train) if self.pose_refiner is not None else self.scene.train

    def _params_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.params.values())

    def save(self, wait: bool = False) -> Path:
        """Checkpoint the current state; written in the background unless `wait`."""
        path = self.checkpoints.save(self.step, self.state_dict())
        if wait:
            self.checkpoints.wait()
        return path

    def export_ply(self) -> Path:
        path = self.run_dir / "point_cloud" / f"iteration_{self.step}" / "point_cloud.ply"
        save_ply(self.params, path)
        return path

    # ----------------------------------------------------------------- what the ranks share
    # One process: these are local. The distributed trainer overrides them with collectives.
    def _begin(self, resume: bool, state: dict[str, Any] | None) -> None:
        """Where fit starts: `state`, or with `resume` the newest checkpoint; else step 0, seeded."""
        if state is None and resume:
            state = load_latest_checkpoint(self.run_dir, map_location="cpu")
        if state is not None:
            self.load_state_dict(state)
            return
        if resume:
            self.log(f"gstrain: {self.run_dir} has no checkpoint yet; starting at step 0")
        seed_everything(self.cfg.train.seed)

    def _agree(self, loss: torch.Tensor, stop: bool, check_params: bool) -> Agreement:
        """The sync step's one host read of the loss; `check_params`: a non-finite parameter is bad too."""
        value = float(loss)
        bad = not math.isfinite(value) or (check_params and not self._params_finite())
        return Agreement(value, len(self.params["means"]), stop, bad)

    def _between_steps(self, step: int, end: int) -> None:
        """After step `step` on every rank alike (the distributed trainer partitions again here)."""

    def _after_agreement(self, step: int) -> None:
        """After a sync step that goes on (the distributed trainer rebalances here)."""

    def _all_finite(self) -> bool:
        return self._params_finite()

    def gaussian_count(self) -> int:
        return len(self.params["means"])

    @contextmanager
    def _whole_model(self):
        """Inside the block the lead rank's self.params is the whole model; yields whether this is it."""
        yield True

    def backend_label(self) -> str:
        return self.renderer.backend

    # ----------------------------------------------------------------- step
    def train_step(self, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None, Any]:
        """One optimisation step through the engine. Returns (loss, loss terms, render, target) as
        device tensors, no sync; the target may be a training view's index (train_target makes it
        an image); render and target are None on a rank that rendered no view."""
        result = self.engine.step(step)
        self.record.add_pairs(result.pairs)
        if result.comm is not None:
            self.record.comm_sent += result.comm[0]
            self.record.comm_received += result.comm[1]
        self._records += result.records
        if result.changed:  # one process: the count is known on the host, no sync
            count = len(self.params["means"]) if self.world == 1 else self.gaussian_count()  # ranks refine alike
            if self.world == 1:
                self.record.max_gaussians = max(self.record.max_gaussians, count)
            check_gaussians_left(count, self.cfg.strategy, step + 1)  # before a step renders an empty model
        return result.loss, result.terms, result.image, result.target

    def train_target(self, gt: torch.Tensor | int) -> torch.Tensor:
        return self.ctx.views.target(gt) if isinstance(gt, int) else gt

    def batch_view(self, idx: int) -> StepView:
        """Training view `idx` as a step reads it (the target as floats in 0..1)."""
        return self.ctx.views.step_view(idx)

    # ----------------------------------------------------------------- the loop
    def fit(self, resume: bool = False, state: dict[str, Any] | None = None) -> FitResult:
        """Train to the end (or train.stop_at); `state` (or, with `resume`, the newest checkpoint)
        is where it goes on from. A run with no checkpoint yet starts at step 0, seeded."""
        cfg = self.cfg
        self._begin(resume, state)
        self.ctx.views.prefetch(self.sampler)  # data.images_on=host/disk: the first steps' images
        total = cfg.train.steps
        # train.stop_at pauses the run there (checkpoint, evaluation, PLY as at the end); the
        # learning-rate decay and the eval/save steps still follow `total`, so --resume goes on
        # exactly as an unpaused run would
        end = cfg.train.stop_at or total
        start_step = self.step
        self.record = RunRecord(first_step=start_step, max_gaussians=self.gaussian_count())
        self.record.startup_phases = dict(self.setup_seconds)
        initial = None
        if start_step == 0 and 0 in cfg.log.eval_steps:  # asked for: the first step waits for it
            began = time.perf_counter()
            initial = self._evaluate(0)
            self.record.startup_phases["step-0 evaluation"] = time.perf_counter() - began
        eval_steps = set(cfg.log.eval_steps) | {end}
        save_steps = set(cfg.log.save_steps) | {end}
        last_psnr = float("nan")
        status, ckpt, saved_at = "done", None, -1
        t_start = time.perf_counter()
        if start_step < end:
            self.record.startup_s = seconds_since_process_start()
        bar = tqdm(total=end, initial=start_step, desc="fit", dynamic_ncols=True, unit="step", disable=not self.lead)
        with _StopFlag(abort_on_second=self.signal_every_step) as signals:
            while self.step < end:
                self.timer.enabled = timed_step(self.step, cfg.dev.time_every)
                loss, terms, image, gt = self.train_step(self.step)
                self.step += 1
                step = self.step
                self._between_steps(step, end)
                due = _Due(logging=step % cfg.log.tb_every == 0,
                           progress=step % cfg.log.progress_every == 0 or step == end,
                           saving=bool(cfg.log.ckpt_every and step % cfg.log.ckpt_every == 0) or step == end,
                           evaluating=step in eval_steps, exporting=step in save_steps)  # fmt: skip
                # a sync step reads the GPU (the ranks agree on it): every progress_every steps, not every step
                local = self.signal_every_step and (signals.requested or self.viewer is not None)
                watching = bool(self.watch_every) and step % self.watch_every == 0  # the same on every rank
                if not (due.any or local or watching):
                    continue
                redone = self.engine.settle()  # the steps are exact before anything is read
                if redone is not None:
                    loss, terms, image = redone.loss, redone.terms, redone.image
                # train PSNR only when someone reads it: four launches saved on the other steps
                shown = (due.logging or due.progress) and image is not None
                train_psnr = psnr(image, self.train_target(gt)) if shown else None
                self._show(step, loss, train_psnr, signals, watching)
                stop = signals.requested and self.signal_every_step  # ranks stop only once they agree
                if due.any:
                    agreed = self._agree(loss, signals.requested, due.saving)
                    self.record.max_gaussians = max(self.record.max_gaussians, agreed.count)
                    if agreed.bad:
                        status = "nan"
                        break
                    stop = agreed.stop
                    if not stop and step < end:
                        self._after_agreement(step)
                    last_psnr = float(train_psnr) if train_psnr is not None else last_psnr
                    if due.progress:
                        bar.set_postfix(loss=f"{agreed.loss:.4f}", psnr=f"{last_psnr:.2f}", gaussians=agreed.count,
                                        mem=memory_text(self.device))  # fmt: skip
                        bar.update(step - bar.n)
                    if due.logging:
                        self._log_scalars(step, agreed.loss, terms, train_psnr, agreed.count, self.lead)
                if due.evaluating:
                    self._evaluate(step, bar)
                if due.saving:  # on disk before the PLY: on a nearly full disk the run's state comes first
                    ckpt, saved_at = self.save(wait=due.exporting), step
                if due.exporting:
                    self._export()
                if stop:
                    status = "interrupted"
                    break
        bar.close()
        return self._finish(status, ckpt, saved_at, initial, last_psnr, t_start)

    def _finish(self, status: str, ckpt: Path | None, saved_at: int, initial: dict[str, float] | None,
                last_psnr: float, t_start: float) -> FitResult:  # fmt: skip
        """After the loop: the engine's account, the interrupted save, the NaN line, the final
        evaluation and the run record."""
        cfg = self.cfg
        self.engine.settle()
        self.record.add_pairs(self.engine.pair_totals())
        self.record.graphs = self.engine.summary()
        self.checkpoints.wait()  # the last write is part of the run's time
        note = self.image_store.note()  # training waited on the images (data-bound), or None
        if note:
            self.log(f"gstrain: {note}")
        self.image_store.close()
        seconds = time.perf_counter() - t_start
        if status == "done" and self.step < cfg.train.steps:
            status = "stopped"  # at train.stop_at, with its checkpoint: --resume goes on
        finished = status in ("done", "stopped")
        if status == "interrupted":
            if saved_at == self.step:
                self.log(f"gstrain: interrupted at step {self.step}; checkpoint saved to {ckpt}")
            elif self._all_finite():
                ckpt = self.save(wait=True)
                self.log(f"gstrain: interrupted at step {self.step}; checkpoint saved to {ckpt}")
            else:
                status = "nan"
        if status == "nan" or (ckpt is None and finished):  # NaN, or resumed at or past the end
            good = list_checkpoints(self.run_dir)
            ckpt = good[-1][1] if good else None
        if status == "nan":
            where = f"last good checkpoint: {ckpt}" if ckpt else "no checkpoint had been written yet"
            self.log(f"gstrain: loss became NaN by step {self.step}; stopped. {where}")
        final = None
        if finished and self._evaluated_at == self.step:  # the loop's own evaluation of the last step
            last = self.record.test_history[-1] if self.record.test_history else None
            final = last if last is not None and last["step"] == self.step else None
        elif finished:
            with self._whole_model() as lead:
                final = self.evaluate_test() if lead else None
        train_views = None
        if finished and cfg.log.eval_train_views:
            with self._whole_model() as lead:
                train_views = self.score_views(self.training_views()) if lead else None
        result = FitResult(
            status=status, step=self.step, seconds=seconds, num_gaussians=self.gaussian_count(),
            initial_test_psnr=initial["psnr"] if initial else None,
            final_test_psnr=final["psnr"] if final else None, checkpoint=ckpt,
            final_train_psnr=last_psnr if math.isfinite(last_psnr) else None, startup_s=self.record.startup_s,
        )
        if self.lead and self.pose_refiner is not None and status != "nan":
            self.record.pose_change = self.pose_refiner.change([v.name for v in self.scene.train])
            self.log(f"gstrain: {describe_change(self.record.pose_change)}")
        if self.lead:
            on_ours = self.renderer.backend == "cuda"  # the atomic mode means something on our kernels only
            write_run_record(self.run_dir, self.record, result, final, train_views, self.backend_label(),
                             cfg.render.atomic_mode if on_ours else None, self.renderer.atomic_threshold,
                             self.device)  # fmt: skip
            if self.writer is not None:
                self.writer.close()
        return result
