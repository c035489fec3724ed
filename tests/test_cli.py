"""End-to-end CLI tests on the generated demo scene: bad input, fit, eval, export, resume
(Ctrl-C and SIGTERM: test_signals.py; faults: test_faults.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pycolmap
import pytest
import torch
from cli_util import assert_one_error, assert_user_error, call_cli, run_cli

from gstrain.train.checkpoint import list_checkpoints

FAST = ["--set", "log.progress_every=10", "--set", "model.sh_degree=1"]


def test_help_for_every_command():
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("fit", "eval", "export", "demo-scene"):
        assert command in top.stdout
        proc = run_cli(command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "Usage" in proc.stdout


@pytest.fixture
def scene_copy(demo_scene: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "scene"
    shutil.copytree(demo_scene, dst)
    return dst


def test_missing_scene(tmp_path):
    assert_one_error(*call_cli("fit", tmp_path / "nope"), "not found")


def test_no_sparse_model(scene_copy):
    shutil.rmtree(scene_copy / "sparse")
    assert_one_error(*call_cli("fit", scene_copy), "sparse")


def test_image_listed_but_missing(scene_copy):
    victim = sorted((scene_copy / "images").iterdir())[3]
    victim.unlink()
    assert_one_error(*call_cli("fit", scene_copy), victim.name)


def test_corrupt_image(scene_copy):
    victim = sorted((scene_copy / "images").iterdir())[2]
    victim.write_bytes(b"\x89PNG garbage")
    assert_one_error(*call_cli("fit", scene_copy), victim.name)


def test_empty_point_cloud(scene_copy, tmp_path):
    model_dir = scene_copy / "sparse" / "0"
    rec = pycolmap.Reconstruction(str(model_dir))
    for point_id in list(rec.point3D_ids()):
        rec.delete_point3D(point_id)
    rec.write(str(model_dir))
    assert_one_error(*call_cli("fit", scene_copy, "--out", tmp_path / "run"), "no 3D points", "model.init=random")


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--set", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["--steps", "abc"], "steps"),
        (["--device", "tpu"], "train.device"),
        (["--atomic-mode", "fastest"], "--atomic-mode must be one of atomic, warp, distwar, arc"),
        (["--atomic-mode", "gsplat"], "--atomic-mode gsplat is no longer an atomic mode: gsplat's rasterizer is a "
                                      "backend, use --backend gsplat"),
        (["--set", "render.atomic_mode=gsplat"], "use render.backend=gsplat"),
        (["--backend", "vulkan"], "render.backend must be one of auto, reference, cuda, gsplat"),
        (["--factor", "0"], "factor"),
        (["--bogus-flag"], "bogus"),
    ],
)
def test_bad_flags(demo_scene, tmp_path, flags, needle):
    assert_one_error(*call_cli("fit", demo_scene, "--out", tmp_path / "r", *flags), needle)


def test_unknown_key_in_config_file(demo_scene, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("strategy:\n  grow_everything: true\n")
    assert_one_error(*call_cli("fit", demo_scene, "--config", cfg), "strategy.grow_everything")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_gpu(demo_scene, tmp_path):
    assert_one_error(*call_cli("fit", demo_scene, "--device", "cuda", "--out", tmp_path / "r"), "no CUDA GPU")
    assert_one_error(*call_cli("fit", demo_scene, "--backend", "gsplat", "--out", tmp_path / "g"),
                     "render.backend=gsplat needs a CUDA GPU")


def test_eval_and_export_on_non_run(tmp_path):
    assert_one_error(*call_cli("eval", tmp_path), "not a gstrain run")
    assert_one_error(*call_cli("export", tmp_path / "missing"), "not found")


@pytest.mark.slow
def test_fit_eval_export_on_demo(demo_scene, tmp_path):
    run = tmp_path / "run"
    proc = run_cli("fit", demo_scene, "--out", run, "--steps", "150", "--seed", "1", *FAST,
                   "--set", "strategy.refine_start=50", "--set", "strategy.refine_every=50",
                   "--set", "log.ckpt_every=50", "--set", "dev.time_every=25",  # six timed steps
                   "--set", "log.eval_steps=[0]")  # the initial model too
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["status"] == "done" and summary["steps"] == 150
    assert "pose_refinement" not in summary  # only with train.pose_refine
    # Training must clearly beat the initial point-cloud render on held-out views.
    assert summary["final_test_psnr"] > summary["initial_test_psnr"] + 4.0, summary
    # the test curve: step 0 and the last step (the final figures are the last evaluation's)
    history = summary["test_history"]
    assert [h["step"] for h in history] == [0, 150]
    assert history[0]["psnr"] == summary["initial_test_psnr"]
    assert (history[-1]["psnr"], history[-1]["ssim"]) == (summary["final_test_psnr"], summary["final_test_ssim"])
    assert summary["final_train_psnr"] > summary["initial_test_psnr"] + 4.0  # a training view, same bar
    assert summary["max_gaussians"] >= summary["num_gaussians"] > 0
    assert (run / "config.yaml").is_file() and (run / "ckpt" / "step_150.pt").is_file()
    assert (run / "point_cloud" / "iteration_150" / "point_cloud.ply").is_file()
    assert any((run / "tb").iterdir())
    # where the time went: per-phase means, host time, wall clock per step
    phases = summary["phase_ms_per_step"]
    assert {"data", "forward", "loss", "backward", "optimizer", "densify"} <= set(phases)
    assert all(v > 0 for v in phases.values())
    assert set(summary["host_ms_per_step"]) == set(phases)
    # the same unit and scale (a factor of 1,000 would be a unit slip): phases are means over the timed
    # steps, wall over every step, so their order is not asserted
    timed = sum(phases[k] for k in ("data", "forward", "loss", "backward"))
    assert summary["wall_ms_per_step"] / 10 < timed < 10 * summary["wall_ms_per_step"]
    assert [s for s, _ in list_checkpoints(run)] == [100, 150]  # background writes, keep=2

    proc = run_cli("eval", run)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["num_views"] == 2
    assert abs(metrics["psnr"] - summary["final_test_psnr"]) < 1e-3
    assert 0 < metrics["ssim"] <= 1
    # LPIPS runs exactly when its weight files are in torch.hub's cache (tests never download them)
    from gstrain.lpips_net import weight_paths

    can_lpips = all(p.is_file() for p in weight_paths("alex"))
    assert (metrics["lpips"] is not None) == can_lpips, metrics
    assert (metrics["lpips_note"] is None) == can_lpips, metrics
    assert len(list((run / "renders" / "test").glob("*.png"))) == 2

    out = tmp_path / "export.ply"
    proc = run_cli("export", run, "--format", "ply", "--out", out)
    assert proc.returncode == 0, proc.stderr
    from gstrain.model import load_ply

    params = load_ply(out)
    state = torch.load(run / "ckpt" / "step_150.pt", weights_only=False)
    for key, value in state["params"].items():
        assert torch.equal(params[key].detach(), value), key

    assert_one_error(*call_cli("fit", demo_scene, "--out", run, "--steps", "10"), "already holds a run")


# One uninterrupted 80-step run serves the resume and the pause tests (checkpoints every 40 steps
# leave training unchanged: tests/test_trainer.py).
RESUME_ARGS = ["--steps", "80", "--seed", "3", *FAST, "--set", "strategy.refine_start=20",
               "--set", "strategy.refine_every=20", "--set", "log.ckpt_every=40", "--set", "log.keep_ckpts=0"]


@pytest.fixture(scope="module")
def full_80(demo_scene, tmp_path_factory) -> Path:
    full = tmp_path_factory.mktemp("full80") / "run"
    code, err = call_cli("fit", demo_scene, "--out", full, *RESUME_ARGS)
    assert code == 0, err
    return full


def test_resume_matches_uninterrupted_run(demo_scene, tmp_path, full_80):
    """Resuming from the step-40 checkpoint of an 80-step run reproduces its step-80 state exactly."""
    common = RESUME_ARGS
    full, part = full_80, tmp_path / "part"
    shutil.copytree(full, part)
    (part / "ckpt" / "step_80.pt").unlink()  # as if it had stopped right after step 40
    code, err = call_cli("fit", demo_scene, "--out", part, "--resume", *common)
    assert code == 0, err
    a = torch.load(full / "ckpt" / "step_80.pt", weights_only=False)
    b = torch.load(part / "ckpt" / "step_80.pt", weights_only=False)
    assert a["step"] == b["step"] == 80
    # bit for bit on the CPU: parameters, Adam moments and the densification statistics
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    moments = 0
    for name, opt in a["optimizers"].items():
        state_a, state_b = opt["state"].get(0, {}), b["optimizers"][name]["state"].get(0, {})
        assert state_a.keys() == state_b.keys(), name  # empty for a tensor that never had a gradient
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state_a:
                assert torch.equal(state_a[key], state_b[key]), (name, key)
                moments += 1
    assert moments >= 8  # at least means, scales, quats and opacities were stepped
    for key, value in a["strategy"].items():
        if torch.is_tensor(value):
            assert torch.equal(value, b["strategy"][key]), key


def test_stop_at_pauses_and_resume_goes_on_as_if_never_paused(demo_scene, tmp_path, full_80):
    """train.stop_at=40 of 80 steps pauses with a checkpoint and an evaluation; --resume with
    stop_at=0 then ends bit for bit where an unpaused 80-step run ends (the schedules span 80)."""
    common = [*RESUME_ARGS, "--set", "log.ckpt_every=0"]  # only the pause and the end write one
    full, paused = full_80, tmp_path / "paused"
    code, err = call_cli("fit", demo_scene, "--out", paused, *common, "--set", "train.stop_at=40")
    assert code == 0, err
    assert "paused at train.stop_at=40 of 80 steps" in err and "--set train.stop_at=0" in err
    summary = json.loads((paused / "train_summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] == 40
    assert summary["test_history"][-1]["step"] == 40 and summary["final_test_psnr"] is not None
    assert [s for s, _ in list_checkpoints(paused)] == [40]
    # resumed without lifting stop_at: nothing to train, the same pause reported again
    code, err = call_cli("fit", demo_scene, "--out", paused, "--resume")
    assert code == 0 and "paused at train.stop_at=40" in err, err
    assert json.loads((paused / "train_summary.json").read_text())["checkpoint"].endswith("step_40.pt")

    code, err = call_cli("fit", demo_scene, "--out", paused, "--resume", "--set", "train.stop_at=0")
    assert code == 0, err
    assert json.loads((paused / "train_summary.json").read_text())["status"] == "done"
    a = torch.load(full / "ckpt" / "step_80.pt", weights_only=False)
    b = torch.load(paused / "ckpt" / "step_80.pt", weights_only=False)
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key

    bad = call_cli("fit", demo_scene, "--out", tmp_path / "bad", *common, "--set", "train.stop_at=81")
    assert_one_error(*bad, "train.stop_at must be 0 (off) or a step up to train.steps (80)")


def test_fit_on_real_beer_scene_downscaled(beer_scene, tmp_path):
    run = tmp_path / "beer"
    proc = run_cli("fit", beer_scene, "--factor", "8", "--steps", "150", "--out", run, *FAST,
                   "--set", "strategy.refine_start=50", "--set", "strategy.refine_every=50",
                   "--set", "log.eval_steps=[0]")
    assert proc.returncode == 0, proc.stderr
    assert "undistorted" in proc.stderr.lower()  # SIMPLE_RADIAL cameras are undistorted, and it says so
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["final_test_psnr"] > summary["initial_test_psnr"] + 1.0, summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_profile_needs_a_gpu(demo_scene):
    assert_one_error(*call_cli("profile", demo_scene), "needs a CUDA GPU")
    assert_one_error(*call_cli("profile", demo_scene, "--switches"), "needs a CUDA GPU")


def test_profile_bad_flags(demo_scene):
    # in this process (each line a subprocess would cost a torch import): exit 2, one error line
    for args, needle in ((["--atomic-mode", "fast"], "--atomic-mode must be one of"),
                         (["--atomic-mode", "arc,gsplat"], "use --backend gsplat"),
                         (["--backend", "vulkan"], "--backend must be one of"),
                         (["--switches", "--atomic-mode", "arc,warp"], "one rasterizer"),
                         (["--iters", "0"], "--iters must be >= 1")):
        code, err = call_cli("profile", demo_scene, *args)
        errors = [line for line in err.splitlines() if line.startswith("gstrain: error:")]
        assert code == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in err, (args, err)


def test_installed_console_script():
    """The `gstrain` script pip installed beside this Python, not `python -m gstrain` from the tree."""
    script = Path(sys.executable).parent / "gstrain"
    assert script.is_file(), f"no console script at {script}: is the package installed (make setup)?"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "fit" in proc.stdout and "render" in proc.stdout, proc.stderr
    bad = subprocess.run([str(script), "fit", "/nonexistent/scene"], capture_output=True, text=True, timeout=120)
    assert_user_error(bad, "scene folder not found")
