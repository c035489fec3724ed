"""The training loop: data -> render -> loss -> backward -> Adam -> densification, with logging,
checkpoints, Ctrl-C and NaN safety. The trainer owns the loop; the modules it calls do not call back.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gstrain.config import Config
from gstrain.data.scene import Scene, View
from gstrain.errors import UserError
from gstrain.metrics import Metrics, metric_target, psnr
from gstrain.model import init_gaussians, random_points, save_ply
from gstrain.render import Renderer
from gstrain.render.sh import sh_degree_at
from gstrain.train.checkpoint import CheckpointWriter, list_checkpoints, load_latest_checkpoint
from gstrain.train.gaussian_count import check_gaussians_left
from gstrain.train.graph_step import GraphSteps, graphs_possible
from gstrain.train.masking import prepare_mask
from gstrain.train.optim import build_means_scheduler, build_optimizers, current_lrs
from gstrain.train.run_record import FitResult, RunRecord, write_run_record
from gstrain.train.run_state import ViewSampler, _rng_state, _set_rng_state, _StopFlag, seed_everything
from gstrain.train.step import BatchView, StepRunner
from gstrain.train.strategies import build_strategy
from gstrain.train.strategies.default import DefaultStrategy  # noqa: F401 - gsplat loads with the trainer, not mid-start-up
from gstrain.train.timing import PhaseTimer, timed_step

__all__ = ["FitResult", "Trainer", "ViewSampler", "seed_everything"]


def _memory_text(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}G"
    try:
        import resource

        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}G"
    except Exception:  # noqa: BLE001 - memory display is best effort
        return "?"


class Trainer:
    def __init__(self, cfg: Config, scene: Scene, run_dir: Path, device: torch.device, log=print) -> None:
        if not scene.train:
            raise UserError("the scene has no training views (all images went to the test split)")
        self.cfg = cfg
        self.scene = scene
        self.run_dir = run_dir
        self.device = device
        self.log = log
        self.background = torch.tensor(cfg.data.background, dtype=torch.float32, device=device)
        self.renderer = Renderer(cfg.render, device, absgrad=cfg.strategy.absgrad)
        # Images live on the device as uint8 (a quarter of float32) and are converted per step.
        self.train_images = [v.image.to(device) for v in scene.train]
        self.train_cams = [(v.viewmat.to(device), v.K.to(device)) for v in scene.train]
        self.train_masks = [prepare_mask(v.mask, device) for v in scene.train]  # masks: None = unmasked
        self.params = self._initial_params()
        self.optimizers = build_optimizers(self.params, cfg.optim, scene.extent)
        self.scheduler = build_means_scheduler(self.optimizers["means"], cfg.optim, cfg.train.steps)
        self.strategy = build_strategy(cfg.strategy, scene.extent, device)
        self.strategy.check(self.params, self.optimizers)
        self.sampler = ViewSampler(len(scene.train), cfg.train.seed)
        self.step = 0
        self.timer = PhaseTimer(device)
        self.runner = StepRunner(cfg, self.renderer, self.strategy, self.timer, device)
        self.viewer = None  # gstrain.viewer.live.LiveViewer for fit --viewer (set by the CLI)
        # train.cuda_graphs: single-view steps replayed as CUDA graphs (None: every step eager)
        self.graphs = GraphSteps(self) if graphs_possible(cfg, self.renderer, self.runner, device) else None
        self.record = RunRecord()  # what this process reports in train_summary.json
        self._window_start: tuple[int, float] | None = None  # (step, perf_counter) of the timing window
        self.writer = None
        self.checkpoints = CheckpointWriter(run_dir, keep=cfg.log.keep_ckpts)

    # ----------------------------------------------------------------- setup
    def _initial_params(self) -> torch.nn.ParameterDict:
        cfg, scene = self.cfg.model, self.scene
        points, colors = scene.points, scene.point_colors
        if cfg.init == "random" or len(points) == 0:
            if cfg.init != "random":
                raise UserError(
                    "the sparse model has no 3D points; pass --set model.init=random to start from random points"
                )
            centers = np.stack([v.camera_center.numpy() for v in scene.train])
            points, colors = random_points(
                cfg.init_points, centers.mean(axis=0), scene.extent, seed=self.cfg.train.seed
            )
            self.log(f"gstrain: initialising {cfg.init_points} random Gaussians (no SfM points used)")
        return init_gaussians(
            points, colors, sh_degree=cfg.sh_degree, init_opacity=cfg.init_opacity,
            init_scale=cfg.init_scale, device=self.device,
        )

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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.to(self.device)) for k, v in state["params"].items()}
        )
        self.optimizers = build_optimizers(self.params, self.cfg.optim, self.scene.extent)
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][name])
        self.scheduler = build_means_scheduler(self.optimizers["means"], self.cfg.optim, self.cfg.train.steps)
        self.scheduler.load_state_dict(state["scheduler"])
        self.strategy.load_state_dict(state["strategy"], self.device)
        self.sampler.load_state_dict(state["sampler"])
        _set_rng_state(state["rng"])
        self.step = int(state["step"])
        if self.graphs is not None:
            self.graphs.warm = False  # new tensors: the next step runs eagerly, then captures

    def resume(self) -> bool:
        state = load_latest_checkpoint(self.run_dir, map_location="cpu")
        if state is None:
            return False
        self.load_state_dict(state)
        return True

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

    # ----------------------------------------------------------------- evaluation
    @torch.no_grad()
    def render_view(self, view: View, sh_degree: int | None = None) -> torch.Tensor:
        degree = self.active_sh_degree() if sh_degree is None else sh_degree
        image, _, _ = self.renderer(
            self.params, view.viewmat.to(self.device), view.K.to(self.device),
            view.width, view.height, degree, self.background,
        )
        return image.clamp(0, 1)

    @torch.no_grad()
    def evaluate_test(self) -> dict[str, float] | None:
        """Mean PSNR / SSIM over the held-out views (LPIPS is left to `gstrain eval`)."""
        scores = self.score_views(self.scene.test)
        if scores is None:
            return None
        self.record.last_test_views = (self.step, scores["views_psnr"])
        return {"psnr": scores["psnr"], "ssim": scores["ssim"]}

    @torch.no_grad()
    def score_views(self, views: list[View]) -> dict[str, Any] | None:
        """Mean PSNR / SSIM over `views`, and each view's PSNR by name; None for no views."""
        if not views:
            return None
        metrics = Metrics(self.device, lpips=False)
        for view in views:
            # masks: kept pixels only (ignore) or against the composited target (background)
            gt, keep = metric_target(view.image.to(self.device).float() / 255.0, view.mask,
                                     self.cfg.data.mask_mode, self.background)
            metrics.add(self.render_view(view), gt, keep)
        summary = metrics.summary()
        per_view = {v.name: round(r["psnr"], 3) for v, r in zip(views, summary["per_image"], strict=True)}
        return {"psnr": summary["psnr"], "ssim": summary["ssim"], "views_psnr": per_view}

    def active_sh_degree(self) -> int:
        return sh_degree_at(self.step, self.cfg.train.sh_degree_interval, self.cfg.model.sh_degree)

    # ----------------------------------------------------------------- loop
    def _tb(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
        return self.writer

    def train_step(self, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor | int]:
        """One optimisation step. Returns (loss, loss terms, render, target) as device tensors: no
        sync. The target may be a training view's index instead (train_target makes it a tensor)."""
        if self.cfg.train.batch_size > 1:
            with self.timer.phase("data"):
                views = [self.batch_view(self.sampler.next()) for _ in range(self.cfg.train.batch_size)]
            result = self.runner.run_batch(self.params, self.optimizers, step, views, self.active_sh_degree(),
                                           self.background, scheduler=self.scheduler)  # fmt: skip
            gt = views[0].gt  # the batch's first view stands for it in the train PSNR
        elif self.graphs is not None:
            idx = self.sampler.next()
            result, gt = self.graphs.run(step, idx), idx
        else:
            with self.timer.phase("data"):
                idx = self.sampler.next()
                viewmat, K = self.train_cams[idx]
                gt = self.train_images[idx].float() / 255.0
            result = self.runner.run(
                self.params, self.optimizers, step, viewmat, K, gt, self.active_sh_degree(), self.background,
                scheduler=self.scheduler, mask=self.train_masks[idx],
            )
        self.record.add_pairs(result.pairs)
        if result.changed:  # the count is known on the host: no sync
            self.record.max_gaussians = max(self.record.max_gaussians, len(self.params["means"]))
            check_gaussians_left(len(self.params["means"]), self.cfg.strategy, step + 1)
        return result.loss, result.terms, result.image, gt

    def train_target(self, gt: torch.Tensor | int) -> torch.Tensor:
        return self.train_images[gt].float() / 255.0 if isinstance(gt, int) else gt

    def batch_view(self, idx: int) -> BatchView:
        """Training view `idx` as a batch step reads it (the target as floats in 0..1)."""
        viewmat, K = self.train_cams[idx]
        return BatchView(viewmat, K, self.train_images[idx].float() / 255.0, self.train_masks[idx])

    def fit(self, resume: bool = False, state: dict[str, Any] | None = None) -> FitResult:
        """Train to the end (or train.stop_at); `state` (or, with `resume`, the newest checkpoint)
        is where it goes on from. A run with no checkpoint yet starts at step 0, seeded."""
        cfg = self.cfg
        if state is None and resume:
            state = load_latest_checkpoint(self.run_dir, map_location="cpu")
        if state is not None:
            self.load_state_dict(state)
        else:
            if resume:
                self.log(f"gstrain: {self.run_dir} has no checkpoint yet; starting at step 0")
            seed_everything(cfg.train.seed)
        total = cfg.train.steps
        # train.stop_at pauses the run there (checkpoint, evaluation, PLY as at the end); the
        # learning-rate decay and the eval/save steps still follow `total`, so --resume goes on
        # exactly as an unpaused run would
        end = cfg.train.stop_at or total
        start_step = self.step
        self.record = RunRecord(first_step=start_step, max_gaussians=len(self.params["means"]))
        initial = self.evaluate_test() if start_step == 0 else None
        if initial is not None:
            self.log(f"gstrain: initial test PSNR {initial['psnr']:.2f} dB over {len(self.scene.test)} views")
            self.record.test_history.append({"step": 0, **initial})
        eval_steps = set(cfg.log.eval_steps) | {end}
        save_steps = set(cfg.log.save_steps) | {end}
        last_psnr = float("nan")
        status = "done"
        ckpt: Path | None = None
        t_start = time.perf_counter()
        bar = tqdm(total=end, initial=start_step, desc="fit", dynamic_ncols=True, unit="step")
        with _StopFlag() as stop:
            while self.step < end:
                self.timer.enabled = timed_step(self.step, cfg.log.time_every)
                loss, terms, image, gt = self.train_step(self.step)
                self.step += 1
                step = self.step
                logging = step % cfg.log.tb_every == 0
                progress = step % cfg.log.progress_every == 0 or step == end
                saving = (cfg.log.ckpt_every and step % cfg.log.ckpt_every == 0) or step == end
                reads = logging or progress or saving or step in eval_steps or step in save_steps
                if self.graphs is not None and (reads or stop.requested or self.viewer is not None):
                    redone = self.graphs.settle()  # graph steps are exact before anything is read
                    if redone is not None:
                        loss, terms, image = redone.loss, redone.terms, redone.image
                # train PSNR only when someone reads it: four launches saved on the other steps
                train_psnr = psnr(image, self.train_target(gt)) if logging or progress else None
                if self.viewer is not None:
                    self.viewer.on_step(step, self.params, loss, train_psnr)
                    self.viewer.wait_if_paused(lambda: stop.requested)
                if progress:
                    loss_value = float(loss)  # the one host sync per progress_every steps
                    if not math.isfinite(loss_value):
                        status = "nan"
                        break
                    last_psnr = float(train_psnr)
                    bar.set_postfix(
                        loss=f"{loss_value:.4f}", psnr=f"{last_psnr:.2f}",
                        gaussians=len(self.params["means"]), mem=_memory_text(self.device),
                    )
                    bar.update(step - bar.n)
                if logging:
                    self._log_scalars(step, loss, terms, train_psnr)
                if step in eval_steps:
                    metrics = self.evaluate_test()
                    if metrics is not None:
                        self.record.test_history.append({"step": step, **metrics})
                        self._tb().add_scalar("test/psnr", metrics["psnr"], step)
                        self._tb().add_scalar("test/ssim", metrics["ssim"], step)
                        self._log_test_renders(step)
                        bar.write(f"step {step}: test PSNR {metrics['psnr']:.2f} SSIM {metrics['ssim']:.4f}")
                if saving:
                    if not (math.isfinite(float(loss)) and self._params_finite()):
                        status = "nan"
                        break
                    # on disk before the PLY: on a nearly full disk the run's state comes first
                    ckpt = self.save(wait=step in save_steps)
                if step in save_steps:
                    self.export_ply()
                if stop.requested:
                    status = "interrupted"
                    break
        bar.close()
        if self.graphs is not None:
            self.graphs.settle()
            self.record.add_pairs(self.graphs.pair_totals())
            self.record.graphs = self.graphs.summary()
        self.checkpoints.wait()  # the last write is part of the run's time
        seconds = time.perf_counter() - t_start
        if status == "done" and self.step < total:
            status = "stopped"  # at train.stop_at, with its checkpoint: --resume goes on
        finished = status in ("done", "stopped")
        if ckpt is None and finished:  # resumed at or past the end: nothing to train
            good = list_checkpoints(self.run_dir)
            ckpt = good[-1][1] if good else None

        if status == "interrupted":
            if self._params_finite():
                ckpt = self.save(wait=True)
                self.log(f"gstrain: interrupted at step {self.step}; checkpoint saved to {ckpt}")
            else:
                status = "nan"
        if status == "nan":
            good = list_checkpoints(self.run_dir)
            where = f"last good checkpoint: {good[-1][1]}" if good else "no checkpoint had been written yet"
            self.log(f"gstrain: loss became NaN by step {self.step}; stopped. {where}")
            ckpt = good[-1][1] if good else None
        final = None
        if finished:  # the loop's own evaluation of the last step, when it made one
            last = self.record.test_history[-1] if self.record.test_history else None
            final = last if last is not None and last["step"] == self.step else self.evaluate_test()
        result = FitResult(
            status=status, step=self.step, seconds=seconds, num_gaussians=len(self.params["means"]),
            initial_test_psnr=initial["psnr"] if initial else None,
            final_test_psnr=final["psnr"] if final else None, checkpoint=ckpt,
            final_train_psnr=last_psnr if math.isfinite(last_psnr) else None,
        )
        train_views = self.score_views(self.scene.train) if finished and cfg.log.eval_train_views else None
        on_ours = self.renderer.backend == "cuda"  # the atomic mode means something on our kernels only
        write_run_record(self.run_dir, self.record, result, final, train_views, self.renderer.backend,
                         self.cfg.render.atomic_mode if on_ours else None, self.renderer.atomic_threshold,
                         self.device)  # fmt: skip
        if self.writer is not None:
            self.writer.close()
        return result

    # ----------------------------------------------------------------- logging
    def _log_scalars(self, step: int, loss: torch.Tensor, terms: dict[str, torch.Tensor], train_psnr) -> None:
        tb = self._tb()
        tb.add_scalar("train/loss", float(loss), step)
        for name, value in terms.items():
            tb.add_scalar(f"train/{name}", float(value), step)
        tb.add_scalar("train/psnr", float(train_psnr), step)
        tb.add_scalar("train/num_gaussians", len(self.params["means"]), step)
        for name, lr in current_lrs(self.optimizers).items():
            tb.add_scalar(f"lr/{name}", lr, step)
        window = self.timer.pending_steps
        phase_ms = self.timer.summary()  # synchronises: the window's GPU work is done
        for phase, ms in phase_ms.items():
            tb.add_scalar(f"time_ms/{phase}", ms, step)
        for phase, ms in self.timer.last_host_ms.items():
            tb.add_scalar(f"host_ms/{phase}", ms, step)
        self.record.add_window(phase_ms, self.timer.last_host_ms, window)
        now = time.perf_counter()
        if self._window_start is not None and step > self._window_start[0]:
            # wall clock per step over the window, logging included: what the user waits for
            wall = (now - self._window_start[1]) * 1e3 / (step - self._window_start[0])
            tb.add_scalar("time_ms/step_wall", wall, step)
        self._window_start = (step, now)
        threshold = self.renderer.atomic_threshold
        if threshold is not None:
            tb.add_scalar("render/atomic_threshold", threshold, step)
        if self.device.type == "cuda":
            tb.add_scalar("memory/peak_gib", torch.cuda.max_memory_allocated(self.device) / 2**30, step)

    def _log_test_renders(self, step: int) -> None:
        for i, view in enumerate(self.scene.test[:2]):
            image = self.render_view(view)
            self._tb().add_image(f"test/{view.name}", image.permute(2, 0, 1).cpu(), step)
            if i >= 1:
                break
