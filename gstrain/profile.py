"""`gstrain profile`: time training iterations per rasterizer, on the same Gaussians and views.

A column is one of our atomic modes (render.backend=cuda) or "gsplat" (render.backend=gsplat).

Every mode starts from the same parameters and optimizer state and walks the same views, so the
per-phase medians differ only by the rasterizer. Densification runs its bookkeeping but never
changes the Gaussian set, so all modes see the same population. Timings are CUDA events.
"""

from __future__ import annotations

import copy
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from gstrain.choices import ATOMIC_MODES, PROFILE_BACKENDS
from gstrain.config import Config, build_config
from gstrain.config_checks import check_atomic_mode
from gstrain.errors import UserError

GSPLAT_COLUMN = "gsplat"  # render.backend=gsplat: gsplat's rasterizer, the peer we compare with
PROFILE_COLUMNS = (*ATOMIC_MODES, GSPLAT_COLUMN)
STEP_PHASES = ("forward", "loss", "backward", "optimizer", "densify")
# `--switches`: each speed feature and the value that turns it off (the baseline has all off).
SWITCHES = {
    "gsplat raster": ("render", "backend", "gsplat"),
    "conv SSIM": ("dev", "fused_ssim", False),
    "torch Adam": ("dev", "fused_adam", False),
    "gsplat stats": ("dev", "fast_stats", False),
    "no ellipse cull": ("dev", "ellipse_cull", False),
    "gsplat SH": ("dev", "fused_sh", False),
    "no CUDA graphs": ("dev", "cuda_graphs", False),
    "shN Adam after backward": ("dev", "adam_in_backward", False),
}
# Opt-in switches (off by default): profiled turned on over the configuration as given; off in the baseline.
OPT_IN = {
    "+ sparse Adam": ("optim", "sparse_adam", True),
}
# (label, phase key) rows of the table; backward_rest and total are derived.
TABLE_ROWS = (
    ("projection", "projection"),
    ("rasterize forward", "raster_fwd"),
    ("loss", "loss"),
    ("rasterize backward", "raster_bwd"),
    ("rest of backward", "backward_rest"),
    ("optimizer", "optimizer"),
    ("densification", "densify"),
    ("step total (GPU events)", "total"),
    ("tile pairs per view (thousands)", "pairs_k"),
    ("host time", "host"),
    ("step wall clock, timed steps", "timed_wall"),
    ("step wall clock, as fit runs", "wall"),
    ("share of steps as CUDA graphs", "graph_share"),
    ("peak memory (GiB)", "peak_gib"),
)


@dataclass
class Workload:
    """What every mode trains on: parameters, cameras and target images, all on the device."""

    name: str
    params: dict[str, torch.Tensor]
    cameras: list[tuple[torch.Tensor, torch.Tensor, int, int]]  # (viewmat, K, width, height)
    targets: list[torch.Tensor]  # [H, W, 3] float in [0, 1]
    extent: float
    sh_degree: int


def _views_workload(name: str, params, views, extent: float, sh_degree: int, device) -> Workload:
    return Workload(
        name=name,
        params={k: v.detach().to(device) for k, v in params.items()},
        cameras=[(v.viewmat.to(device), v.K.to(device), v.width, v.height) for v in views],
        targets=[v.image.to(device).float() / 255.0 for v in views],
        extent=extent,
        sh_degree=sh_degree,
    )


def load_workload(
    target: Path, cfg: Config, device: torch.device, npz_scale: int = 1, factor: int | None = None
) -> Workload:
    """A COLMAP scene (Gaussians from its SfM points), a trained run (its last checkpoint), or a
    test_garden-style .npz (means3d, colors, viewmats, Ks, width, height)."""
    from gstrain.data.inputs import load_scene
    from gstrain.model import init_gaussians
    from gstrain.run_dir import is_run_dir, open_run, run_scene

    if not target.exists():
        raise UserError(f"profile target not found: {target}")
    if target.suffix == ".npz":
        return _npz_workload(target, cfg, device, npz_scale)
    if is_run_dir(target):
        run = open_run(target, load_views=factor is None, renderer=False)
        scene = run.scene or load_scene(run_scene(target, run.meta), factor=factor, background=run.cfg.data.background,
                                        max_side=run.cfg.data.max_side)
        return _views_workload(target.name, run.params, scene.train, scene.extent, run.sh_degree, device)
    scene = load_scene(target, factor=factor or cfg.data.factor, test_every=cfg.data.test_every,
                       background=cfg.data.background, max_side=cfg.data.max_side)
    if len(scene.points) == 0:
        raise UserError(f"the sparse model in {target} has no 3D points to profile with")
    params = init_gaussians(scene.points, scene.point_colors, sh_degree=cfg.model.sh_degree,
                            init_opacity=cfg.model.init_opacity, device="cpu")
    return _views_workload(target.name, params, scene.train, scene.extent, cfg.model.sh_degree, device)


def _npz_workload(path: Path, cfg: Config, device: torch.device, scale: int) -> Workload:
    from gstrain.model import init_gaussians

    try:
        data = np.load(path)
        means, colors = data["means3d"], data["colors"]
        viewmats, Ks = data["viewmats"], data["Ks"].copy()
        width, height = int(data["width"]) * scale, int(data["height"]) * scale
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"{path}: not a test_garden-style .npz ({exc})") from None
    Ks[:, :2] *= scale
    params = init_gaussians(means, colors, sh_degree=cfg.model.sh_degree, init_opacity=cfg.model.init_opacity)
    gen = torch.Generator().manual_seed(0)
    # No photos come with it: a fixed random target makes every pixel carry a gradient.
    targets = [torch.rand(height, width, 3, generator=gen).to(device) for _ in range(len(viewmats))]
    cameras = [
        (torch.from_numpy(v).float().to(device), torch.from_numpy(k).float().to(device), width, height)
        for v, k in zip(viewmats, Ks, strict=True)
    ]
    centres = np.stack([-v[:3, :3].T @ v[:3, 3] for v in viewmats])
    extent = float(1.1 * np.linalg.norm(centres - centres.mean(0), axis=1).max())
    params = {k: v.detach().to(device) for k, v in params.items()}
    return Workload(path.stem, params, cameras, targets, max(extent, 1e-3), cfg.model.sh_degree)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WorkloadSteps:
    """The trainer's own step (StepRunner) on a workload's Gaussians and views, built from `cfg`.

    Densification keeps its per-step bookkeeping but never changes the set of Gaussians, so
    every configuration measured on a workload sees the same population.
    """

    def __init__(self, work: Workload, cfg: Config) -> None:
        from gstrain.render import Renderer
        from gstrain.train.optim import build_optimizers
        from gstrain.train.step import StepRunner
        from gstrain.train.strategies import build_strategy
        from gstrain.train.timing import PhaseTimer

        self.work = work
        self.device = work.targets[0].device
        run_cfg = copy.deepcopy(cfg)
        run_cfg.strategy.refine_start = 10**9
        self.params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone()) for k, v in work.params.items()})
        self.optimizers = build_optimizers(self.params, run_cfg.optim, work.extent)
        renderer = Renderer(run_cfg.render, self.device, absgrad=run_cfg.strategy.absgrad, dev=run_cfg.dev)
        renderer.set_training_cameras(work.cameras)  # render.filter_3d's sampling rates
        self.timer = PhaseTimer(self.device)
        strategy = build_strategy(run_cfg.strategy, work.extent, self.device, run_cfg.dev)
        self.runner = StepRunner(run_cfg, renderer, strategy, self.timer, self.device)
        self.tuner = renderer.tuner
        self.cfg = run_cfg
        self.background = torch.zeros(3, device=self.device)
        self.step = 0
        self.pairs: tuple[int, int, int] | None = None  # the last step's (StepResult.pairs)

    def __call__(self) -> None:
        """One training step on the next view."""
        work, i = self.work, self.step
        viewmat, K, _, _ = work.cameras[i % len(work.cameras)]
        from gstrain.train.step import StepView

        view = StepView(viewmat, K, work.targets[i % len(work.targets)])
        result = self.runner.run(self.params, self.optimizers, i, [view], work.sh_degree, self.background)
        self.pairs = result.pairs
        self.step += 1


def profile_config(work: Workload, cfg: Config, iters: int, warmup: int, window: int = 10) -> dict[str, list[float]]:
    """Per-window phase times (ms per step) of `iters` training steps run with `cfg`.

    The steps are the trainer's own (StepRunner). They run in windows of `window` steps with no
    sync inside a window, as in `gstrain fit`, so host overhead and host syncs show up in
    `timed_wall` (wall clock per step) and `host` (host time per step) as they would in training.
    The phase rows are CUDA events: GPU time, plus any time the GPU waited for the host inside a
    phase. Then `iters` more steps run untimed, as fit runs all but every dev.time_every-th step
    (CUDA-graph replays where dev.cuda_graphs applies): their wall clock is `wall`, and
    `graph_share` the share that ran as graphs.
    """
    from gstrain.profile_graphs import ProfileSteps

    gc.collect()  # the previous configuration's tensors, so that its memory is not counted here
    one_step = WorkloadSteps(work, cfg)
    device, timer, tuner = one_step.device, one_step.timer, one_step.tuner

    # warm-up: lazy loading, allocator growth, and (arc) one full tuning round
    while one_step.step < warmup or (tuner is not None and tuner.tuning):
        one_step()
        _sync(device)
        timer.summary()
        if tuner is not None:
            tuner.poll()
        if one_step.step > warmup + 10_000:
            raise RuntimeError("the ARC tuner never finished tuning")
    samples: dict[str, list[float]] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measured = 0
    while measured < iters:
        n = min(window, iters - measured)
        _sync(device)
        t0 = time.perf_counter()
        pairs = 0
        for _ in range(n):
            one_step()
            pairs += one_step.pairs[1] if one_step.pairs else 0
        phases = timer.summary()  # waits for the window's GPU work
        phases["timed_wall"] = (time.perf_counter() - t0) * 1e3 / n
        phases["host"] = sum(timer.last_host_ms.get(k, 0.0) for k in STEP_PHASES)
        phases["backward_rest"] = phases["backward"] - phases.get("raster_bwd", 0.0)
        phases["total"] = sum(phases.get(k, 0.0) for k in STEP_PHASES)
        if one_step.pairs:  # after dev.ellipse_cull: what both raster passes walk
            phases["pairs_k"] = pairs / n / 1e3
        for key, value in phases.items():
            samples.setdefault(key, []).append(value)
        measured += n
    samples["wall"], share = ProfileSteps(one_step, one_step.cfg).windows(iters, window)
    samples["graph_share"] = [share]
    if tuner is not None:
        samples["arc_threshold"] = [float(tuner.threshold)]
    if device.type == "cuda":  # the workload's own tensors (and any graphs' pools) included
        samples["peak_gib"] = [torch.cuda.max_memory_allocated(device) / 2**30]
    return samples


def profile_columns(atomic_mode: str, backend: str, switches: bool = False) -> list[str]:
    """The columns the --atomic-mode and --backend flags ask for; UserError for bad flags.

    --atomic-mode: all (our four modes) or a comma-separated list of them; --backend: cuda (our
    kernels, one column per mode), gsplat (gsplat's rasterizer, one column) or all (both).
    With --switches, all means arc on our kernels.
    """
    if backend not in PROFILE_BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(PROFILE_BACKENDS)}; got '{backend}'")
    if atomic_mode == "all":
        modes = ["arc"] if switches else list(ATOMIC_MODES)
    else:
        modes = [m.strip() for m in atomic_mode.split(",")]
        for mode in modes:
            check_atomic_mode(mode, flag=True)
    if switches and backend == "all":
        backend = "cuda"
    columns = modes if backend in ("cuda", "all") else []
    return columns + ([GSPLAT_COLUMN] if backend in ("gsplat", "all") else [])


def column_config(cfg: Config, column: str) -> Config:
    """A copy of cfg that renders as `column` says (an atomic mode on our kernels, or gsplat)."""
    out = copy.deepcopy(cfg)
    if column == GSPLAT_COLUMN:
        out.render.backend = "gsplat"
    else:
        out.render.backend = "cuda"
        out.render.atomic_mode = column
    return out


def profile_mode(work: Workload, cfg: Config, column: str, iters: int, warmup: int) -> dict[str, list[float]]:
    """profile_config with the rasterizer set to `column` (PROFILE_COLUMNS)."""
    return profile_config(work, column_config(cfg, column), iters, warmup)


def switch_variants(cfg: Config) -> dict[str, Config]:
    """The configuration as given, the same with each speed switch turned off alone, each opt-in
    switch turned on alone (unless the configuration has it on already), and with all off."""
    variants = {"all on": copy.deepcopy(cfg)}
    baseline = copy.deepcopy(cfg)
    for label, (section, key, off) in SWITCHES.items():
        variant = copy.deepcopy(cfg)
        setattr(getattr(variant, section), key, off)
        setattr(getattr(baseline, section), key, off)
        variants[label] = variant
    for label, (section, key, on) in OPT_IN.items():
        if getattr(getattr(cfg, section), key) != on:
            variant = copy.deepcopy(cfg)
            setattr(getattr(variant, section), key, on)
            variants[label] = variant
        setattr(getattr(baseline, section), key, not on)
    variants["baseline"] = baseline
    return variants


def _median(values: list[float] | None) -> float | None:
    return statistics.median(values) if values else None


def format_table(medians: dict[str, dict[str, float | None]]) -> str:
    modes = list(medians)
    lines = ["| phase (median ms) | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for label, key in TABLE_ROWS:
        cells = [f"{medians[m].get(key):.3f}" if medians[m].get(key) is not None else "-" for m in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for base in ("atomic", "gsplat", "baseline"):
        if base not in medians:
            continue
        for key, label in (("raster_bwd", "rasterize backward"), ("wall", "step (wall clock)")):
            ref = medians[base].get(key)
            cells = []
            for m in modes:
                v = medians[m].get(key)
                cells.append(f"{ref / v:.2f}x" if ref and v else "-")
            lines.append(f"| {label} speedup vs {base} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_profile(
    target: Path,
    modes: list[str],
    iters: int = 50,
    warmup: int = 10,
    factor: int | None = None,
    npz_scale: int = 1,
    config_files: list[Path] | None = None,
    out_dir: Path | None = None,
    log: Callable[[str], None] = print,
    switches: bool = False,
) -> dict[str, Any]:
    """Profile rasterizers (PROFILE_COLUMNS, see profile_columns) side by side or, with `switches`,
    the speed switches one by one (each turned off alone, and all off) with the rasterizer `modes[0]`."""
    for mode in modes:  # bad flags first: they are wrong on any machine
        if mode not in PROFILE_COLUMNS:
            check_atomic_mode(mode, flag=True)
    if iters < 1 or warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    if switches and len(modes) != 1:
        raise UserError("--switches profiles one rasterizer: pass one --atomic-mode (e.g. arc) or --backend gsplat")
    if not torch.cuda.is_available():
        raise UserError("gstrain profile times our CUDA kernels and needs a CUDA GPU")
    cfg = build_config(config_files)
    device = torch.device("cuda")
    work = load_workload(target, cfg, device, npz_scale, factor)
    n = int(work.params["means"].shape[0])
    width, height = work.cameras[0][2], work.cameras[0][3]
    log(f"gstrain: profiling {work.name}: {n} Gaussians, {len(work.cameras)} views at {width}x{height}")
    results: dict[str, dict[str, list[float]]] = {}
    if switches:
        cfg = column_config(cfg, modes[0])
        for label, variant in tqdm(switch_variants(cfg).items(), desc="profile", unit="config"):
            results[label] = profile_config(work, variant, iters, warmup)
    else:
        for mode in tqdm(modes, desc="profile", unit="mode"):
            results[mode] = profile_mode(work, cfg, mode, iters, warmup)
    medians = {m: {k: _median(v) for k, v in s.items()} for m, s in results.items()}
    table = format_table(medians)
    report = {
        "target": str(target),
        "gpu": torch.cuda.get_device_name(),
        "num_gaussians": n,
        "views": len(work.cameras),
        "resolution": [width, height],
        "iters": iters,
        "warmup": warmup,
        "switches": switches,
        "median_ms": medians,
        "samples_ms": results,
        "table": table,
    }
    out_dir = out_dir or (target if target.is_dir() and (target / "run.json").exists() else Path("runs") / "profile")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile.json").write_text(json.dumps(report, indent=2))
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out_dir / "tb")) as writer:
        for mode, med in medians.items():
            for _, key in TABLE_ROWS:
                if med.get(key) is not None:
                    group = "profile_gib" if key == "peak_gib" else "profile_ms"
                    writer.add_scalar(f"{group}/{key}/{mode.replace(' ', '_')}", med[key], 0)
    report["out_dir"] = str(out_dir)
    return report
