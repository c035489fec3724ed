"""End-to-end on the GPU: `gstrain fit` / `eval` / `profile` on our kernels (run by bench/gpu_tests.sh)."""

from __future__ import annotations

import json

import pytest
import torch
from cli_util import run_cli

from gstrain.choices import ATOMIC_MODES

pytestmark = pytest.mark.cuda


def test_fit_and_eval_on_cuda_with_arc(demo_scene, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("fit", demo_scene, "--out", run, "--steps", "400", "--device", "cuda",
                   "--atomic-mode", "arc", "--set", "strategy.refine_start=50",
                   "--set", "strategy.refine_every=50", "--set", "log.tb_every=50", "--set", "log.eval_steps=[0]")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["backend"] == "cuda" and summary["atomic_mode"] == "arc"
    assert 1 <= summary["atomic_threshold"] <= 32
    pairs = summary["isect_pairs_per_view"]  # the ellipse cull is on by default: fewer pairs
    assert 0 < pairs["after_cull"] < pairs["before_cull"]
    assert summary["final_test_psnr"] > summary["initial_test_psnr"] + 4.0, summary
    proc = run_cli("eval", run, "--device", "cuda")
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((run / "metrics.json").read_text())
    assert abs(metrics["psnr"] - summary["final_test_psnr"]) < 0.05


def test_modes_agree_on_a_training_step(demo_scene):
    from gstrain.config import build_config
    from gstrain.data.colmap import load_scene
    from gstrain.model import init_gaussians
    from gstrain.render import Renderer
    from gstrain.train.losses import photometric_loss

    scene = load_scene(demo_scene)
    base = init_gaussians(scene.points, scene.point_colors, sh_degree=1, device="cuda")
    # SfM init is isotropic with identity rotations, where the rotation gradient is zero in exact
    # arithmetic (float noise only): tilt and stretch every Gaussian so each gradient carries signal
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        base["quats"].copy_(torch.nn.functional.normalize(
            base["quats"] + 0.5 * torch.randn(base["quats"].shape, generator=gen, device="cuda"), dim=-1))
        base["scales"].add_(0.4 * torch.randn(base["scales"].shape, generator=gen, device="cuda"))
        base["shN"].add_(0.1 * torch.randn(base["shN"].shape, generator=gen, device="cuda"))
    view = scene.train[0]
    gt = view.image.cuda().float() / 255
    grads, losses = {}, {}
    # every mode, gsplat's rasterizer included, against the pure-PyTorch reference renderer in
    # float64 (as tests/test_cuda_render.py does; float32 projection adds its own rounding)
    for mode in ("reference", *ATOMIC_MODES, "gsplat"):
        # gsplat's rasterizer is the render.backend=gsplat; the others are our backward's reductions
        render = {"backend": mode} if mode in ("reference", "gsplat") else {"backend": "cuda", "atomic_mode": mode}
        dtype = torch.float64 if mode == "reference" else torch.float32
        cfg = build_config(overrides=[{"render": render}])
        params = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.detach().clone().to(dtype)) for k, v in base.items()}
        )
        image, _, _ = Renderer(cfg.render, torch.device("cuda"))(
            params, view.viewmat.cuda().to(dtype), view.K.cuda().to(dtype), view.width, view.height, 1,
            torch.zeros(3, device="cuda", dtype=dtype),
        )
        loss, _ = photometric_loss(image, gt.to(dtype))
        loss.backward()
        losses[mode] = float(loss.detach())
        grads[mode] = {k: p.grad.detach().double() for k, p in params.items()}
    assert set(grads["reference"]) == {"means", "scales", "quats", "opacities", "sh0", "shN"}
    for mode in (*ATOMIC_MODES, "gsplat"):
        assert abs(losses[mode] - losses["reference"]) < 1e-4 * abs(losses["reference"]), mode
        assert grads[mode].keys() == grads["reference"].keys(), mode
        for key, g in grads[mode].items():
            ref = grads["reference"][key]
            assert ref.norm() > 0, key  # the reference's gradient is not trivially zero
            err = (g - ref).norm() / ref.norm()
            assert err < 2e-3, (mode, key, float(err))


def test_depth_on_cuda_matches_reference(demo_scene):
    from gstrain.config import RenderConfig
    from gstrain.data.colmap import load_scene
    from gstrain.model import init_gaussians
    from gstrain.render import Renderer

    scene = load_scene(demo_scene)
    params = init_gaussians(scene.points, scene.point_colors, sh_degree=1, device="cuda")
    view = scene.test[0]
    args = (params, view.viewmat.cuda(), view.K.cuda(), view.width, view.height)
    ref = Renderer(RenderConfig(backend="reference"), torch.device("cuda")).render_depth(*args)
    for backend in ("cuda", "gsplat"):  # our kernels and gsplat's rasterizer
        ours = Renderer(RenderConfig(backend=backend), torch.device("cuda")).render_depth(*args)
        assert (ours - ref).abs().max() < 1e-3 * ref.abs().max(), backend


def test_profile_command_on_demo(demo_scene, tmp_path):
    proc = run_cli("profile", demo_scene, "--iters", "5", "--warmup", "2", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "profile.json").read_text())
    assert set(report["median_ms"]) == {"atomic", "warp", "distwar", "arc", "gsplat"}
    for mode, med in report["median_ms"].items():
        assert med["raster_bwd"] > 0 and med["total"] >= med["raster_bwd"], mode
    assert "speedup vs gsplat" in proc.stdout


def test_profile_switches_on_demo(demo_scene, tmp_path):
    proc = run_cli("profile", demo_scene, "--switches", "--atomic-mode", "arc", "--iters", "10", "--warmup", "2",
                   "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["switches"] is True
    assert list(report["median_ms"]) == ["all on", "gsplat raster", "conv SSIM", "torch Adam", "gsplat stats",
                                         "no ellipse cull", "gsplat SH", "no CUDA graphs", "shN Adam after backward",
                                         "+ sparse Adam",
                                         "baseline"]
    for label, med in report["median_ms"].items():
        assert med["wall"] > 0 and med["host"] > 0 and med["loss"] > 0, label
        assert 0 < med["peak_gib"] <= torch.cuda.get_device_properties(0).total_memory / 2**30, label
    assert "step (wall clock) speedup vs baseline" in proc.stdout and "peak memory (GiB)" in proc.stdout
    # the cull's effect shows: fewer (Gaussian, tile) pairs than the same configuration without it
    assert 0 < report["median_ms"]["all on"]["pairs_k"] < report["median_ms"]["no ellipse cull"]["pairs_k"]
    assert "tile pairs per view" in proc.stdout
    # the untimed steps ran as CUDA graphs where the switch is on, eagerly where it is off
    med = report["median_ms"]
    assert med["all on"]["graph_share"] > 0.5 and med["no CUDA graphs"]["graph_share"] == 0.0, med["all on"]
    assert med["baseline"]["graph_share"] == 0.0 and med["all on"]["timed_wall"] > 0


def test_render_on_cuda_png_frames(demo_scene, tmp_path):
    run = tmp_path / "run"
    assert run_cli("fit", demo_scene, "--out", run, "--steps", "30", "--device", "cuda").returncode == 0
    for what in ("rgb", "depth"):
        out = tmp_path / what
        proc = run_cli("render", run, "--path", "orbit", "--frames", "4", "--what", what, "--out", out)
        assert proc.returncode == 0, proc.stderr
        assert len(list(out.glob("*.png"))) == 4
