"""Metrics over (render, ground truth) pairs; LPIPS from weight files in torch.hub's cache."""

from __future__ import annotations

import math
import shutil
import socket
import urllib.error
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gstrain import metrics
from gstrain.lpips_net import WEIGHT_FILES, weight_paths
from gstrain.metrics import Metrics, load_lpips, score_images


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test: LPIPS must never download."""

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(metrics, "_lpips_cache", {})


@pytest.fixture
def hub_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    return tmp_path


def _standin_weights(folder: Path, net: str = "alex", seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Stand-in weight files with the real files' names, keys and shapes (torchvision's AlexNet
    `features.*` entries and lpips' `lin{k}.model.1.weight`); random values, built here."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 3, 11), (192, 64, 5), (384, 192, 3), (256, 384, 3), (256, 256, 3)]
    backbone = {}
    for index, (c_out, c_in, k) in zip((0, 3, 6, 8, 10), shapes, strict=True):
        backbone[f"features.{index}.weight"] = torch.randn(c_out, c_in, k, k, generator=gen) / (c_in * k * k) ** 0.5
        backbone[f"features.{index}.bias"] = 0.1 * torch.randn(c_out, generator=gen)
    backbone["classifier.1.weight"] = torch.zeros(2, 2)  # the real file has a classifier too
    linear = {f"lin{i}.model.1.weight": torch.rand(1, c, 1, 1, generator=gen) for i, (c, _, _) in enumerate(shapes)}
    (folder / "checkpoints").mkdir(parents=True, exist_ok=True)
    backbone_file, linear_file = (folder / "checkpoints" / name for name, _ in WEIGHT_FILES[net])
    torch.save(backbone, backbone_file)
    torch.save(linear, linear_file)
    return {"backbone": backbone, "linear": linear}


def _reference_lpips(img: torch.Tensor, gt: torch.Tensor, weights) -> float:
    """LPIPS v0.1 over AlexNet written out layer by layer from the paper's definition."""
    b, lin = weights["backbone"], weights["linear"]
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    feats = []
    for x in (img, gt):
        x = ((x.permute(2, 0, 1)[None] * 2 - 1) - shift) / scale
        taps = []
        x = F.relu(F.conv2d(x, b["features.0.weight"], b["features.0.bias"], stride=4, padding=2))
        taps.append(x)
        x = F.relu(F.conv2d(F.max_pool2d(x, 3, 2), b["features.3.weight"], b["features.3.bias"], padding=2))
        taps.append(x)
        x = F.relu(F.conv2d(F.max_pool2d(x, 3, 2), b["features.6.weight"], b["features.6.bias"], padding=1))
        taps.append(x)
        x = F.relu(F.conv2d(x, b["features.8.weight"], b["features.8.bias"], padding=1))
        taps.append(x)
        x = F.relu(F.conv2d(x, b["features.10.weight"], b["features.10.bias"], padding=1))
        taps.append(x)
        feats.append(taps)
    total = 0.0
    for k, (fa, fb) in enumerate(zip(*feats, strict=True)):
        na = fa / (fa.norm(dim=1, keepdim=True) + 1e-10)
        nb = fb / (fb.norm(dim=1, keepdim=True) + 1e-10)
        w = lin[f"lin{k}.model.1.weight"].view(1, -1, 1, 1)
        total += float(((na - nb) ** 2 * w).sum(dim=1).mean())
    return total


def _pairs(size: int = 7):
    gt = torch.zeros(size, size + 1, 3)
    return [(torch.full((size, size + 1, 3), 0.1), gt), (torch.full((size, size + 1, 3), 0.01), gt)]


def test_lpips_weights_missing_offline(hub_dir):
    fn, reason = load_lpips("cpu")
    assert fn is None and "\n" not in reason
    assert reason.startswith("LPIPS weights not available offline")
    for name, url in WEIGHT_FILES["alex"]:  # says what to fetch and where it goes
        assert url in reason and str(hub_dir / "checkpoints" / name) in reason
    result = score_images(_pairs(), "cpu")  # PSNR and SSIM still come
    assert result["lpips"] is None and result["psnr"] is not None and result["ssim"] is not None
    assert result["lpips_note"] == reason


def test_lpips_with_standin_weights_matches_the_definition(hub_dir):
    weights = _standin_weights(hub_dir)
    gen = torch.Generator().manual_seed(1)
    gt = torch.rand(70, 90, 3, generator=gen)
    img = (gt + 0.2 * torch.randn(70, 90, 3, generator=gen)).clamp(0, 1)
    result = score_images([(img, gt), (gt, gt)], "cpu")
    assert result["lpips_note"] is None
    want = _reference_lpips(img, gt, weights)
    assert want > 0.01 and math.isclose(result["per_image"][0]["lpips"], want, rel_tol=1e-4)
    assert result["per_image"][1]["lpips"] == pytest.approx(0.0, abs=1e-7)  # a distance: zero to itself


def test_lpips_first_use_fetches_through_torch_hub(hub_dir, tmp_path_factory, monkeypatch):
    source = tmp_path_factory.mktemp("standin")
    weights = _standin_weights(source)
    fetched = []

    def fake_download(url, dst, progress=True):  # what torch.hub would fetch, from a local folder
        name = next(n for n, u in WEIGHT_FILES["alex"] if u == url)
        fetched.append(name)
        shutil.copy(source / "checkpoints" / name, dst)

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    assert load_lpips("cpu")[0] is None  # no download unless asked
    fn, reason = load_lpips("cpu", download=True)
    assert reason is None and sorted(fetched) == sorted(n for n, _ in WEIGHT_FILES["alex"])
    img, gt = _pairs(40)[0]
    assert math.isclose(float(fn(img, gt)), _reference_lpips(img, gt, weights), rel_tol=1e-4)


def test_lpips_download_failure_is_one_line(hub_dir, monkeypatch):
    def offline(url, dst, progress=True):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    fn, reason = load_lpips("cpu", download=True)
    assert fn is None and "\n" not in reason and "download failed: URLError" in reason
    assert str(hub_dir / "checkpoints" / WEIGHT_FILES["alex"][0][0]) in reason


def test_lpips_setup_failure_is_a_reason(hub_dir):
    _standin_weights(hub_dir)
    (hub_dir / "checkpoints" / WEIGHT_FILES["alex"][0][0]).write_bytes(b"not a checkpoint")
    fn, reason = load_lpips("cpu")
    assert fn is None and "LPIPS could not be set up" in reason and "\n" not in reason


def test_score_images_here():
    result = score_images(_pairs(), "cpu")
    assert result["count"] == 2
    assert [round(r["psnr"], 3) for r in result["per_image"]] == [20.0, 40.0]
    assert math.isclose(result["psnr"], 30.0, rel_tol=1e-5)
    assert 0.0 < result["ssim"] < 1.0
    # LPIPS has a value exactly when its weight files are in torch.hub's cache on this machine
    can_lpips = all(p.is_file() for p in weight_paths("alex"))
    assert (result["lpips"] is not None) == can_lpips
    assert (result["per_image"][0]["lpips"] is not None) == can_lpips
    assert (result["lpips_note"] is None) == can_lpips


def test_metrics_clamps_render_and_handles_empty():
    m = Metrics("cpu", lpips=False)
    assert m.summary()["psnr"] is None and m.summary()["count"] == 0
    row = m.add(torch.full((4, 4, 3), 1.5), torch.ones(4, 4, 3))
    assert math.isinf(row["psnr"]) and math.isclose(row["ssim"], 1.0, rel_tol=1e-6)
    assert m.summary()["lpips_note"] == "LPIPS disabled"
    with pytest.raises(ValueError):
        m.add(torch.zeros(4, 4, 3), torch.zeros(4, 5, 3))


def test_eval_says_where_the_weights_go_and_uses_them_once_there(demo_scene, tmp_path, monkeypatch):
    import json

    from cli_util import call_cli, run_cli

    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "2", "--device", "cpu",
                         "--set", "model.sh_degree=0", "--set", "log.eval_steps=[]")
    assert code == 0, err
    torch_home = tmp_path / "torch"
    monkeypatch.setenv("TORCH_HOME", str(torch_home))  # the eval subprocess's torch.hub cache
    offline = run_cli("eval", run, "--device", "cpu")  # conftest sets GSTRAIN_OFFLINE=1: no download
    assert offline.returncode == 0, offline.stderr
    lines = [line for line in offline.stdout.splitlines() if "LPIPS" in line]
    assert len(lines) == 1 and "LPIPS n/a (LPIPS weights not available offline: put" in lines[0], offline.stdout
    assert str(torch_home / "hub" / "checkpoints" / WEIGHT_FILES["alex"][0][0]) in lines[0]
    written = json.loads((run / "metrics.json").read_text())
    assert written["lpips"] is None and written["psnr"] > 0 and 0 < written["ssim"] <= 1

    _standin_weights(torch_home / "hub")
    online = run_cli("eval", run, "--device", "cpu")
    assert online.returncode == 0, online.stderr
    written = json.loads((run / "metrics.json").read_text())
    assert written["lpips_note"] is None and written["lpips"] > 0
