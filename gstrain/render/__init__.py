"""render(params, view) -> (image, alpha, info), on our CUDA kernels, gsplat's rasterizer or the
PyTorch reference (render.backend; choices.BACKENDS).

`info` carries what gsplat's strategies read: means2d (the tensor whose gradient they collect),
radii, width, height, n_cameras.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gstrain.choices import CUDA_BACKENDS
from gstrain.config import RenderConfig
from gstrain.dev_config import DevConfig
from gstrain.errors import UserError
from gstrain.render.common import RasterOptions

RETUNE_CHANGE = 0.2  # ARC re-tunes after densification once the population moved by this fraction


def resolve_device(requested: str) -> torch.device:
    """auto -> cuda when a GPU is usable, else cpu; an explicit cuda without a GPU is a user error."""
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if requested == "cuda":
        raise UserError("--device cuda was asked for, but no CUDA GPU is available to PyTorch")
    return torch.device("cpu")


class Renderer:
    """Chooses the backend once, and owns the ARC tuner that re-tunes after densification.

    `dev`: the speed switches and distwar's threshold (a config's dev section; None: their defaults)."""

    def __init__(self, cfg: RenderConfig, device: torch.device, absgrad: bool = False,
                 dev: DevConfig | None = None) -> None:  # fmt: skip
        backend = cfg.backend
        if backend == "auto":
            backend = "cuda" if device.type == "cuda" else "reference"
        if backend in CUDA_BACKENDS and device.type != "cuda":
            raise UserError(f"render.backend={backend} needs a CUDA GPU; use --device cuda on a GPU machine")
        self.backend = backend
        self.cfg = cfg
        self.device = device
        self.dev = dev = dev if dev is not None else DevConfig()
        self.absgrad = absgrad
        self.tuner = None
        self._tuned_count: int | None = None  # population when ARC last started a round
        if backend == "cuda":
            from gstrain import extensions
            from gstrain.render.arc import ArcTuner

            extensions.raster()
            if cfg.atomic_mode == "arc":  # one tuner per renderer: its own scene, sizes and population
                self.tuner = ArcTuner()
        # backend gsplat is gsplat's own pipeline (the comparisons' baseline): its intersection and SH too
        ours = backend != "gsplat"
        self.options = RasterOptions(
            absgrad=absgrad, atomic_mode=cfg.atomic_mode, atomic_threshold=dev.atomic_threshold,
            tuner=self.tuner, gsplat_raster=not ours, ellipse_cull=dev.ellipse_cull and ours,
            fused_sh=dev.fused_sh and ours, antialiased=cfg.antialiased,
        )  # fmt: skip
        # render.filter_3d: the training cameras the rates come from, and the filter's per-Gaussian std
        self._filter_views: tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]] | None = None
        self._filter_std: torch.Tensor | None = None
        self._filter_stale = True

    def set_training_views(self, views: Sequence[Any]) -> None:
        """The training views (gstrain.data.scene.View) whose sampling rates set render.filter_3d."""
        self.set_training_cameras([(v.viewmat, v.K, v.width, v.height) for v in views])

    def set_training_cameras(self, cameras: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]]) -> None:
        """set_training_views from (viewmat, K, width, height) tuples."""
        from gstrain.render.filter3d import stack_cameras

        viewmats, Ks, sizes = stack_cameras(cameras)
        self._filter_views = (viewmats.to(self.device), Ks.to(self.device), sizes)
        self._filter_stale = True

    def filtered(self, params: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """params through the 3D filter when render.filter_3d is on (recomputing its rates when the
        population changed); else params unchanged."""
        if self.cfg.filter_3d <= 0:
            return params
        from gstrain.render.filter3d import apply_filter_3d

        if self._filter_views is None:
            raise UserError("render.filter_3d needs the training views' cameras; this command has no scene to take "
                            "them from (pass the scene, or --set render.filter_3d=0)")  # fmt: skip
        if self._filter_stale or self._filter_std is None or self._filter_std.shape[0] != params["means"].shape[0]:
            self._update_filter(params)
        return apply_filter_3d(params, self._filter_std)

    def _update_filter(self, params: Mapping[str, torch.Tensor]) -> None:
        from gstrain.render.filter3d import filter_std, max_sampling_rate

        assert self._filter_views is not None
        viewmats, Ks, sizes = self._filter_views
        with torch.no_grad():
            std = filter_std(max_sampling_rate(params["means"], viewmats, Ks, sizes), self.cfg.filter_3d)
        if self._filter_std is not None and self._filter_std.shape == std.shape:
            self._filter_std.copy_(std)  # in place: a captured CUDA graph reads this storage
        else:
            self._filter_std = std
        self._filter_stale = False

    def __call__(
        self,
        params: torch.nn.ParameterDict,
        viewmat: torch.Tensor,
        K: torch.Tensor,
        width: int,
        height: int,
        sh_degree: int,
        background: torch.Tensor | None = None,
        timer: Any = None,
        options: RasterOptions | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Render one view. A PhaseTimer, when given, gets the projection / raster_fwd / raster_bwd
        split. `options`: this render's, instead of the renderer's own (a CUDA-graph step's view
        with its own pair budget and valid size: train/step.StepView)."""
        options = self.options if options is None else options
        params = self.filtered(params)
        if self.backend in CUDA_BACKENDS:
            from gstrain.render.cuda import render_cuda

            return render_cuda(params, viewmat, K, width, height, sh_degree, background, options, timer=timer)
        from gstrain.render.reference import render_reference

        return render_reference(
            params, viewmat, K, width, height, sh_degree, background, absgrad=self.absgrad, timer=timer,
            antialiased=options.antialiased,
        )

    def render_depth(
        self,
        params: torch.nn.ParameterDict,
        viewmat: torch.Tensor,
        K: torch.Tensor,
        width: int,
        height: int,
    ) -> torch.Tensor:
        """Expected depth along each pixel ray, [H,W,1]: sum(w_i d_i) / alpha, 0 where nothing is hit.

        Camera-space z of each Gaussian's centre, composited with the same weights as colour.
        """
        params = self.filtered(params)
        antialiased = self.options.antialiased
        if self.backend in CUDA_BACKENDS:
            from gstrain.render.cuda import render_depth_cuda

            acc, alpha = render_depth_cuda(params, viewmat, K, width, height, self.options.gsplat_raster, antialiased)
        else:
            from gstrain.render.reference import project_gaussians, rasterize

            means = params["means"]
            proj = project_gaussians(means, params["quats"], torch.exp(params["scales"]), viewmat.to(means),
                                     K.to(means), width, height, antialiased=antialiased)  # fmt: skip
            opacities = torch.sigmoid(params["opacities"])
            if proj.compensations is not None:
                opacities = opacities * proj.compensations
            acc, alpha = rasterize(
                proj.means2d, proj.conics, proj.depths[:, None], opacities, proj.radii, proj.depths, width, height,
            )  # fmt: skip
        # below 1/255 coverage the ratio is noise (and 0/0 where nothing is hit)
        covered = alpha > 1.0 / 255.0
        return torch.where(covered, acc / alpha.clamp_min(1e-10), torch.zeros_like(acc))

    def gaussians_changed(self, count: int | None = None, params: Mapping[str, torch.Tensor] | None = None) -> None:
        """Densification changed the population: the best atomic threshold may have moved. With
        the population's size, ARC re-tunes only once it has moved RETUNE_CHANGE from the last
        round's (a round is ~19 backward calls that a CUDA-graph step cannot make). The 3D
        filter's rates follow the Gaussians' means: recomputed now from `params`, else at the next
        render."""
        self._filter_stale = True
        if params is not None and self.cfg.filter_3d > 0 and self._filter_views is not None:
            self._update_filter(params)
        if self.tuner is None:
            return
        if count is not None and self._tuned_count and abs(count / self._tuned_count - 1.0) < RETUNE_CHANGE:
            return
        self._tuned_count = count
        self.tuner.invalidate()

    @property
    def atomic_threshold(self) -> int | None:
        """The threshold our backward uses now (the tuned one for arc); None off our CUDA kernels."""
        if self.backend != "cuda":
            return None
        if self.tuner is not None:
            return int(self.tuner.threshold)
        return self.dev.atomic_threshold
