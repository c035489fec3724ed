"""What the training loop reports: test evaluations, TensorBoard scalars and renders, the
progress bar's memory figure. A mixin of the Trainer (train/trainer.py): it reads the trainer's
model and record, and never steps."""

from __future__ import annotations

import time
from typing import Any

import torch

from gstrain.data.image_store import images_ahead
from gstrain.data.scene import View
from gstrain.metrics import Metrics, metric_target
from gstrain.render.sh import sh_degree_at
from gstrain.train.appearance import fitted_half, scores_right_half
from gstrain.train.optim import current_lrs


def memory_text(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}G"
    try:
        import resource

        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}G"
    except Exception:  # noqa: BLE001 - memory display is best effort
        return "?"


def _db(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "n/a"


class RunReporting:
    """Evaluation and logging over the trainer's current model (self.params, self.renderer, ...)."""

    cfg: Any
    scene: Any
    device: torch.device
    params: torch.nn.ParameterDict
    renderer: Any
    background: torch.Tensor
    record: Any
    timer: Any
    optimizers: dict[str, torch.optim.Optimizer]
    step: int
    writer: Any
    run_dir: Any
    world: int
    viewer: Any
    watch_every: int
    log: Any
    _evaluated_at: int
    _window_start: tuple[int, float] | None

    def _whole_model(self) -> Any:  # the trainer's (a context manager)
        raise NotImplementedError

    def export_ply(self) -> Any:
        raise NotImplementedError

    def _evaluate(self, step: int, bar: Any = None) -> dict[str, float] | None:
        """Test PSNR / SSIM of the whole model on the lead rank (None elsewhere, or no test views),
        into the record; in the loop (`bar`) also TensorBoard and a line."""
        self._evaluated_at = step
        with self._whole_model() as lead:
            metrics = self.evaluate_test() if lead else None
            if metrics is None:
                return None
            self.record.test_history.append({"step": step, **metrics})
            if bar is None:
                self.log(f"gstrain: initial test PSNR {metrics['psnr']:.2f} dB over {len(self.scene.test)} views")
            else:
                self._log_test(step, metrics)
                bar.write(f"step {step}: test PSNR {metrics['psnr']:.2f} SSIM {metrics['ssim']:.4f} (raw render); "
                          f"fitted on the left half, right half scored: PSNR {_db(metrics['psnr_fitted_half'])}")
        return metrics

    def watch(self, viewer: Any, refresh_every: int) -> None:
        """fit --viewer: `viewer` (the lead rank's; None on the others) sees the model every step
        on one process; with several ranks every rank gathers the whole model for it every
        `refresh_every` steps (a collective, so every rank is told)."""
        self.viewer = viewer
        self.watch_every = refresh_every if self.world > 1 else 0

    def _show(self, step: int, loss: torch.Tensor, train_psnr: Any, signals: Any, watching: bool) -> None:
        if self.world == 1:
            if self.viewer is not None:
                self.viewer.on_step(step, self.params, loss, train_psnr)
                self.viewer.wait_if_paused(lambda: signals.requested)
            return
        if watching:  # rank 0's loss is its share of the batch: the page shows the PSNR of its view
            with self._whole_model() as lead:
                if lead and self.viewer is not None:
                    self.viewer.on_step(step, self.params, None, train_psnr)
            self._hold_while_paused(lambda: signals.requested)

    def _hold_while_paused(self, should_stop: Any) -> None:
        """Several ranks: all wait while the lead rank's page is paused (the distributed trainer's)."""

    def _export(self) -> None:
        with self._whole_model() as lead:
            if lead:
                self.export_ply()


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
        return {"psnr": scores["psnr"], "ssim": scores["ssim"], "psnr_fitted_half": scores["psnr_fitted_half"],
                "ssim_fitted_half": scores["ssim_fitted_half"]}  # fmt: skip

    @torch.no_grad()
    def score_views(self, views: list[View]) -> dict[str, Any] | None:
        """Mean PSNR / SSIM over `views` of the raw render, and each view's PSNR by name; also
        PSNR / SSIM under the fitted_half protocol (train/appearance.py); None for no views."""
        if not views:
            return None
        metrics, fitted = Metrics(self.device, lpips=False), Metrics(self.device, lpips=False)
        for view, target in zip(views, images_ahead(views), strict=True):
            # masks: kept pixels only (ignore) or against the composited target (background)
            gt, keep = metric_target(target.to(self.device).float() / 255.0, view.mask,
                                     self.cfg.data.mask_mode, self.background)  # fmt: skip
            image = self.render_view(view)
            metrics.add(image, gt, keep)
            if scores_right_half(keep):
                fitted.add(*fitted_half(image, gt, keep))
        summary, half = metrics.summary(), fitted.summary()
        per_view = {v.name: round(r["psnr"], 3) for v, r in zip(views, summary["per_image"], strict=True)}
        return {"psnr": summary["psnr"], "ssim": summary["ssim"], "views_psnr": per_view,
                "psnr_fitted_half": half["psnr"], "ssim_fitted_half": half["ssim"]}  # fmt: skip

    def active_sh_degree(self, step: int | None = None) -> int:
        """The SH degree at `step` (None: the current one)."""
        step = self.step if step is None else step
        return sh_degree_at(step, self.cfg.train.sh_degree_interval, self.cfg.model.sh_degree)

    def _tb(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
        return self.writer

    def _log_scalars(self, step: int, loss: float, terms: dict[str, torch.Tensor], train_psnr: Any, count: int,
                     lead: bool) -> None:  # fmt: skip
        """The timing window into the run record (every rank: its pending events are drained
        either way), and, on the lead rank, TensorBoard."""
        window = self.timer.pending_steps
        phase_ms = self.timer.summary()  # synchronises: the window's GPU work is done
        self.record.add_window(phase_ms, self.timer.last_host_ms, window)
        if not lead:
            return
        tb = self._tb()
        tb.add_scalar("train/loss", loss, step)
        if self.world == 1:  # a rank's terms are its share of the batch: not the run's
            for name, value in terms.items():
                tb.add_scalar(f"train/{name}", float(value), step)
        if train_psnr is not None:
            tb.add_scalar("train/psnr", float(train_psnr), step)
        tb.add_scalar("train/num_gaussians", count, step)
        for name, lr in current_lrs(self.optimizers).items():
            tb.add_scalar(f"lr/{name}", lr, step)
        for phase, ms in phase_ms.items():
            tb.add_scalar(f"time_ms/{phase}", ms, step)
        for phase, ms in self.timer.last_host_ms.items():
            tb.add_scalar(f"host_ms/{phase}", ms, step)
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

    def _log_test(self, step: int, metrics: dict[str, float]) -> None:
        self._tb().add_scalar("test/psnr", metrics["psnr"], step)
        self._tb().add_scalar("test/ssim", metrics["ssim"], step)
        if metrics["psnr_fitted_half"] is not None:
            self._tb().add_scalar("test/psnr_fitted_half", metrics["psnr_fitted_half"], step)
        for view in self.scene.test[:2]:
            image = self.render_view(view)
            self._tb().add_image(f"test/{view.name}", image.permute(2, 0, 1).cpu(), step)
