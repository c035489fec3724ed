"""bench/big_scene.py (the generated city as a COLMAP folder), bench/city.py (the shared generator)
and bench/big_curve.py (the cost curve), on tiny CPU sizes."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pycolmap
import pytest
import torch
from PIL import Image
from plyfile import PlyData

from bench import big_curve, big_curve_plot, big_scene
from bench.city import BLOCK, city_points, quats_facing
from gstrain.render.projection import _quat_to_rotmat

TINY = dict(views=12, width=96, height=64, n=20_000, points=500, device="cpu", batch=5, workers=2)


@pytest.fixture(scope="module")
def tiny_scene(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("city") / "scene"
    big_scene.write_scene(out, **TINY, log=lambda _msg: None)
    return out


def _digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != big_scene.SCENE_FILE}  # fmt: skip


def test_tiny_scene_is_a_colmap_folder_that_fit_loads(tiny_scene, tmp_path):
    rec = pycolmap.Reconstruction(str(tiny_scene / "sparse" / "0"))
    assert rec.num_images() == 12 and rec.num_cameras() == 2 and rec.num_points3D() == 500
    # intrinsics from the fields of view alone: 65 degrees for phones, 80 for drones
    for cam_id, fov in ((1, 65.0), (2, 80.0)):
        cam = rec.cameras[cam_id]
        f = 48 / math.tan(math.radians(fov / 2))
        assert cam.model_name == "PINHOLE" and (cam.width, cam.height) == (96, 64)
        np.testing.assert_allclose(cam.params, [f, f, 48, 32], rtol=1e-9)
    images = sorted(rec.images.values(), key=lambda im: im.image_id)
    assert [im.name for im in images] == sorted(im.name for im in images) == [f"{i:05d}.jpg" for i in range(12)]
    assert [im.camera_id for im in images] == [1, 2] * 6  # half drones, interleaved
    for im in images:
        pixels = np.asarray(Image.open(tiny_scene / "images" / im.name))
        assert pixels.shape == (64, 96, 3)
        # each camera sees the city: a good part of the frame is lit (black is the sky)
        assert (pixels.max(axis=2) > 20).mean() > 0.3, im.name
    # every SfM point lies on the model: within 6 sigma of the 2 cm noise of a Gaussian's mean
    # (brute force over all 20k means), with that Gaussian's colour
    v = PlyData.read(str(tiny_scene / "model.ply"))["vertex"]
    means = np.stack([v["x"], v["y"], v["z"]], 1).astype(np.float64)
    rgb = np.stack([v[f"f_dc_{c}"] for c in range(3)], 1) * 0.28209479177387814 + 0.5
    assert len(means) == 20_000
    pts = np.stack([p.xyz for p in rec.points3D.values()])
    cols = np.stack([p.color for p in rec.points3D.values()]).astype(np.float64) / 255
    dist = torch.cdist(torch.from_numpy(pts), torch.from_numpy(means))
    nearest, which = dist.min(dim=1)
    assert float(nearest.max()) < 6 * 0.02 * math.sqrt(3)
    assert np.abs(cols - rgb[which.numpy()]).max() < 12 / 255

    proc = subprocess.run([sys.executable, "-m", "gstrain", "fit", str(tiny_scene), "--out", str(tmp_path / "run"),
                           "--steps", "2", "--device", "cpu", "--set", "model.sh_degree=0"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 0, err
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["status"] == "done" and summary["num_gaussians"] == 500
    assert "10 train / 2 test views at 96x64, 500 SfM points" in err


def test_same_seed_same_files_other_seed_differs(tmp_path):
    small = dict(views=4, width=48, height=32, n=3000, points=100, device="cpu", log=lambda _msg: None)
    big_scene.write_scene(tmp_path / "a", seed=3, **small)
    big_scene.write_scene(tmp_path / "b", seed=3, **small)
    big_scene.write_scene(tmp_path / "c", seed=4, **small)
    a, b, c = (_digests(tmp_path / x) for x in "abc")
    assert len(a) == 4 + 1 + 5 and a == b  # images, model.ply, sparse/0 (cameras, images, points, frames, rigs)
    assert all(a[k] != c[k] for k in ("images/00000.jpg", "model.ply", "sparse/0/points3D.bin", "sparse/0/images.bin"))


def test_refuses_a_folder_that_holds_files(tmp_path, capsys):
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    with pytest.raises(SystemExit) as exc:
        big_scene.main([str(tmp_path), "--views", "2", "--width", "16", "--height", "16", "--n", "100",
                        "--points", "10", "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("gstrain: error:")]
    assert len(errors) == 1 and "not an empty folder" in errors[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and mine.read_text() == "keep me"


def test_city_keeps_dist_comm_stream_and_flat_gaussians_face_out():
    from bench.dist_comm import scene_city

    # digests from dist_comm's own generator before it moved to bench/city.py
    prof, means, _ = scene_city(5000, 20, 120.0, seed=3)
    assert hashlib.sha256(means.numpy().tobytes()).hexdigest()[:16] == "a2c0845610418191"
    assert hashlib.sha256(prof.ids.numpy().tobytes()).hexdigest()[:16] == "970e87e2a7359477"

    pts = city_points(4000, torch.Generator().manual_seed(0), blocks=3)
    normals = torch.tensor([[1.0, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1]])
    rot = _quat_to_rotmat(quats_facing(normals))
    torch.testing.assert_close(rot[:, :, 2], normals)  # the thin (local z) axis along the normal
    # walls face away from their building's centre; roofs and streets face up
    centre = torch.div(pts.means[:, :2], pts.pitch, rounding_mode="floor") * pts.pitch + BLOCK / 2
    wall = pts.normals[:, 2] == 0
    outward = ((pts.means[wall, :2] - centre[wall]) * pts.normals[wall, :2]).sum(1)
    assert wall.any() and bool((outward > 0).all())
    assert bool((pts.normals[~wall] == torch.tensor([0.0, 0, 1])).all())
    assert pts.colors.min() >= 0 and pts.colors.max() <= 1


def test_curve_records_skips_done_points_and_finds_oom(tiny_scene, tmp_path, monkeypatch):
    out = tmp_path / "curve"
    argv = [str(tiny_scene), "--n", "300,700", "--pipelines", "gstrain,baseline", "--warmup", "1", "--steps", "2",
            "--device", "cpu", "--in-process", "--out", str(out)]  # fmt: skip
    big_curve.main(argv)
    records = big_curve.load_records(out)
    assert [(r["pipeline"], r["n"]) for r in records] == [("gstrain", 300), ("baseline", 300),
                                                          ("gstrain", 700), ("baseline", 700)]  # fmt: skip
    for r in records:
        assert r["status"] == "ok" and r["ms_per_step"] > 0 and r["peak_gib"] > 0 and r["images_per_s"] > 0
        assert 0 <= r["decode_s"] <= r["load_s"]  # the decode alone, found from load_scene's own lines
        # the model had N Gaussians, not the scene's 500 SfM points; every view trained at 96x64
        assert (r["num_gaussians"], r["views"], r["width"], r["height"]) == (r["n"], 12, 96, 64)
    rows = (out / "curve.csv").read_text().splitlines()
    assert rows[0].split(",") == list(big_curve.FIELDS) and len(rows) == 5
    big_curve.main(argv)  # every point is there already: nothing runs again
    assert len(big_curve.load_records(out)) == 4

    def no_memory(spec):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(big_curve, "measure", no_memory)
    rec = big_curve.child_record({"pipeline": "gstrain", "n": 10})
    assert rec["status"] == "oom" and rec["error"].startswith("CUDA out of memory") and rec["n"] == 10
    monkeypatch.setattr(big_curve, "measure", lambda spec: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # not an OOM: a bug, never a point of the curve
        big_curve.child_record({"pipeline": "gstrain", "n": 10})


def test_curve_point_in_a_child_process(tiny_scene):
    spec = {"scene": str(tiny_scene), "pipeline": "baseline", "factor": 2, "n": 400, "cap_gib": None,
            "init": "sfm", "warmup": 1, "steps": 1, "extra": "", "probe": True, "device": "cpu",
            "sets": big_curve.pipeline_sets(big_curve.PIPELINES["baseline"], "cpu")}  # fmt: skip
    rec = big_curve.run_point(spec)
    assert rec["status"] == "ok", rec
    assert (rec["num_gaussians"], rec["width"], rec["height"], rec["probe"]) == (400, 48, 32, True)


def test_a_point_frees_its_trainer_before_it_returns(tiny_scene, monkeypatch):
    """A measured trainer (on a GPU: its CUDA graphs and their memory pool) is gone once the point's
    record is made, not left to the interpreter's teardown or to the next in-process point."""
    from gstrain.train.trainer import Trainer

    made: list[weakref.ref] = []
    init = Trainer.__init__

    def remembered(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(Trainer, "__init__", remembered)
    spec = {"scene": str(tiny_scene), "pipeline": "gstrain", "factor": 2, "n": 300, "cap_gib": None,
            "init": "model", "warmup": 1, "steps": 1, "extra": "", "probe": False, "device": "cpu",
            "sets": []}  # fmt: skip
    assert big_curve.child_record(spec)["status"] == "ok"
    assert len(made) == 1 and made[0]() is None


def test_a_failed_child_brings_its_stderr_back(tmp_path):
    spec = {"scene": str(tmp_path / "no_scene"), "pipeline": "gstrain", "factor": 1, "n": 10, "cap_gib": None,
            "init": "model", "warmup": 1, "steps": 1, "extra": "", "probe": False, "device": "cpu",
            "sets": []}  # fmt: skip
    rec = big_curve.run_point(spec)
    assert rec["status"] == "error" and rec["error"].startswith("exit 1 before writing its record"), rec
    # the whole traceback, not only its last lines: where the child failed
    assert "Traceback" in rec["stderr"] and "in measure" in rec["stderr"], rec["stderr"]
    assert "FileNotFoundError" in rec["stderr"] and "no_scene" in rec["stderr"]
    assert "stderr" not in big_curve.FIELDS  # the CSV keeps one line per point


def test_pipeline_flags_bisection_and_counts():
    sets = big_curve.pipeline_sets(["--backend", "gsplat", "--set", "train.fused_ssim=false"], "cuda")
    assert sets == ["render.backend=gsplat", "train.fused_ssim=false"]
    assert big_curve.pipeline_sets(["--backend", "gsplat", "--atomic-mode", "arc"], "cpu") == ["render.atomic_mode=arc"]
    with pytest.raises(ValueError):
        big_curve.pipeline_sets(["--steps", "3"], "cuda")
    assert [big_curve.parse_count(x) for x in ("2e6", "500k", "4M", "1234")] == [2_000_000, 500_000, 4_000_000, 1234]

    probes: list[int] = []

    def fits(n: int) -> bool:
        probes.append(n)
        return n <= 12_345

    lo, hi = big_curve.largest_n(fits, 1000, 1_000_000, 0.05)
    assert lo <= 12_345 < hi and hi <= lo * 1.05 and len(probes) < 20
    assert big_curve.largest_n(lambda n: False, 10, 100, 0.1) == (None, 10)
    assert big_curve.largest_n(lambda n: True, 10, 100, 0.1) == (100, None)


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    records = [{"pipeline": p, "factor": 1, "n": n, "cap_gib": None, "status": "ok" if n < 4e6 else "oom",
                "ms_per_step": n / 1e5 * (2 if p == "baseline" else 1), "peak_gib": n / 1e6, "width": 1920,
                "height": 1080} for p in ("gstrain", "baseline") for n in (1e6, 2e6, 4e6)]  # fmt: skip
    path = big_curve_plot.plot_curve(records, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.cuda
def test_cuda_scene_matches_the_reference_and_the_cap_ends_in_oom(tmp_path):
    """On a GPU: the CUDA backend's views equal the reference renderer's up to JPEG and float noise,
    a capped point trains under its cap, and a cap too small for the model is an OOM record."""
    small = dict(views=4, width=96, height=64, n=20_000, points=300, log=lambda _msg: None)
    big_scene.write_scene(tmp_path / "gpu", device="cuda", **small)
    big_scene.write_scene(tmp_path / "cpu", device="cpu", **small)
    for i in range(4):
        a, b = (np.asarray(Image.open(tmp_path / d / "images" / f"{i:05d}.jpg"), dtype=np.float64)
                for d in ("gpu", "cpu"))
        assert np.abs(a - b).mean() < 2.0, i

    base = {"scene": str(tmp_path / "gpu"), "pipeline": "gstrain", "factor": 1, "init": "model", "warmup": 3,
            "steps": 3, "extra": "", "probe": False, "device": "cuda",
            "sets": big_curve.pipeline_sets(big_curve.PIPELINES["gstrain"], "cuda")}  # fmt: skip
    ok = big_curve.run_point({**base, "n": 20_000, "cap_gib": 4.0})
    assert ok["status"] == "ok", _child_failure(ok)
    assert ok["peak_gib"] <= 4.0 and ok["num_gaussians"] == 20_000, ok
    oom = big_curve.run_point({**base, "n": 5_000_000, "cap_gib": 0.25})
    assert oom["status"] == "oom", _child_failure(oom)


def _child_failure(rec: dict) -> str:
    """A failed point's record with the child's stderr in full lines, for the assertion message."""
    shown = {k: v for k, v in rec.items() if k != "stderr"}
    return f"{shown}\n--- the child's stderr (last {big_curve.STDERR_LINES} lines) ---\n{rec.get('stderr')}"
