"""Metrics over (render, ground truth) pairs; LPIPS only when it can run offline."""

from __future__ import annotations

import math
import socket
import sys
import types

import pytest
import torch

from gstrain import metrics
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


class _FakeLPIPS(torch.nn.Module):
    """Stands in for lpips.LPIPS: mean absolute difference of the [-1, 1] inputs."""

    constructed = 0

    def __init__(self, net="alex", verbose=True):
        super().__init__()
        type(self).constructed += 1
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, a, b, normalize=False):
        assert a.dim() == 4 and a.shape[1] == 3
        if normalize:
            a, b = 2 * a - 1, 2 * b - 1
        return (a - b).abs().mean(dim=(1, 2, 3), keepdim=True) * self.w


@pytest.fixture
def fake_lpips(monkeypatch):
    module = types.ModuleType("lpips")
    module.LPIPS = _FakeLPIPS
    _FakeLPIPS.constructed = 0
    monkeypatch.setitem(sys.modules, "lpips", module)
    return module


def _pairs():
    gt = torch.zeros(6, 7, 3)
    return [(torch.full((6, 7, 3), 0.1), gt), (torch.full((6, 7, 3), 0.01), gt)]


def test_lpips_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "lpips", None)  # import raises ImportError(name="lpips")
    fn, reason = load_lpips("cpu")
    assert fn is None and reason == "lpips package not installed"


def test_lpips_installed_but_weights_not_cached(fake_lpips, hub_dir):
    fn, reason = load_lpips("cpu")
    assert fn is None
    assert reason.startswith("LPIPS backbone weights not cached offline") and "\n" not in reason
    assert "alexnet-owt-7be5be79.pth" in reason
    assert _FakeLPIPS.constructed == 0  # nothing that could download was built


def test_lpips_with_cached_weights(fake_lpips, hub_dir):
    (hub_dir / "checkpoints").mkdir()
    (hub_dir / "checkpoints" / "alexnet-owt-7be5be79.pth").write_bytes(b"")
    result = score_images(_pairs(), "cpu")
    assert result["lpips_note"] is None
    assert math.isclose(result["lpips"], (0.2 + 0.02) / 2, rel_tol=1e-5)
    assert math.isclose(result["per_image"][0]["lpips"], 0.2, rel_tol=1e-5)
    score_images(_pairs(), "cpu")
    assert _FakeLPIPS.constructed == 1  # cached per device


def test_lpips_setup_failure_is_a_reason(fake_lpips, hub_dir, monkeypatch):
    (hub_dir / "checkpoints").mkdir()
    (hub_dir / "checkpoints" / "alexnet-owt-7be5be79.pth").write_bytes(b"")

    def broken(*args, **kwargs):
        raise RuntimeError("corrupt checkpoint")

    monkeypatch.setattr(fake_lpips, "LPIPS", broken)
    fn, reason = load_lpips("cpu")
    assert fn is None and "corrupt checkpoint" in reason


def test_score_images_here():
    result = score_images(_pairs(), "cpu")
    assert result["count"] == 2
    assert [round(r["psnr"], 3) for r in result["per_image"]] == [20.0, 40.0]
    assert math.isclose(result["psnr"], 30.0, rel_tol=1e-5)
    assert 0.0 < result["ssim"] < 1.0
    import importlib.util

    from gstrain.metrics import lpips_backbone_path

    # LPIPS has a value exactly when the package and its cached backbone are both on this machine
    can_lpips = importlib.util.find_spec("lpips") is not None and lpips_backbone_path().is_file()
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
