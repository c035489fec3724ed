"""dev.fused_bilateral on the CPU: the CPU keeps F.grid_sample bit for bit (the kernels are never
built), the autograd wrapper hands the kernels their arguments and returns their gradients to the
right inputs (a stand-in extension), and a bad switch value is one line. The kernels themselves
against grid_sample: tests/test_bilateral_fused_cuda.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cli_util import assert_one_error, call_cli

from gstrain import extensions
from gstrain.config import build_config
from gstrain.train import bilateral_grid, fused_bilateral
from gstrain.train.appearance import build_corrections
from gstrain.train.bilateral_grid import apply_grid, identity_grids
from gstrain.train.step import StepView

GRID = (3, 4, 5)


def _no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("the CPU path built or called the bilateral kernels")

    monkeypatch.setattr(extensions, "bilateral", refuse)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grid = identity_grids(1, GRID)[0] + 0.3 * torch.randn(12, *GRID, generator=gen)
    image = torch.rand(6, 9, 3, generator=gen) * 1.4 - 0.2
    return image, grid


def _output_and_grads(image: torch.Tensor, grid: torch.Tensor, fused: bool,
                      valid: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
    image, grid = image.clone().requires_grad_(), grid.clone().requires_grad_()
    out = apply_grid(image, grid, valid, fused=fused)
    weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)
    image_grad, grid_grad = torch.autograd.grad((out * weights).sum(), (image, grid))
    return [out.detach(), image_grad, grid_grad]


def test_on_the_cpu_the_fused_switch_keeps_grid_sample_bit_for_bit(monkeypatch):
    _no_kernels(monkeypatch)
    image, grid = _inputs(0)
    valid = torch.tensor([7, 5], dtype=torch.int32)
    for v in (None, valid):
        for fused, plain in zip(_output_and_grads(image, grid, True, v), _output_and_grads(image, grid, False, v),
                                strict=True):  # fmt: skip
            assert torch.equal(fused, plain)
    # the trainer's model: the switch on (the default) builds nothing on the CPU and slices as before
    cfg = build_config(None, [{"train": {"appearance": "bilateral", "bilateral_grid_x": 5, "bilateral_grid_y": 4,
                                         "bilateral_grid_luma": 3}}])  # fmt: skip
    assert cfg.dev.fused_bilateral is True
    (model,) = build_corrections(cfg, 2, torch.device("cpu"))
    assert model.fused is False
    with torch.no_grad():
        model.table[1] = grid
    view = StepView(torch.eye(4), torch.eye(3), image, index=1)
    assert torch.equal(model.image(image, view), apply_grid(image, grid))


def test_the_wrapper_passes_the_kernels_their_inputs_and_routes_their_gradients(monkeypatch):
    """A stand-in extension (grid_sample's output, and gradients from autograd through it) behind
    the autograd wrapper: the wrapper's output and both gradients are the stand-in's, for the
    inputs and the luminance weights the kernels are documented to take."""
    calls: list[tuple] = []

    def reference(image, grid, valid):
        return bilateral_grid.apply_grid(image, grid, valid, fused=False)

    def fwd(image, grid, valid, r, g, b):
        calls.append(("fwd", valid, (r, g, b), image.is_contiguous() and grid.is_contiguous()))
        with torch.no_grad():
            return reference(image, grid, valid)

    def bwd(image, grid, valid, grad_out, r, g, b, variant):
        calls.append(("bwd", valid, (r, g, b), grad_out.is_contiguous(), variant))
        with torch.enable_grad():
            image, grid = image.detach().requires_grad_(), grid.detach().requires_grad_()
            return list(torch.autograd.grad(reference(image, grid, valid), (image, grid), grad_out))

    monkeypatch.setattr(extensions, "bilateral", lambda: SimpleNamespace(bilateral_fwd=fwd, bilateral_bwd=bwd))
    monkeypatch.setattr(bilateral_grid, "fusable", lambda image, grid: True)
    image, grid = _inputs(1)
    valid = torch.tensor([7, 5], dtype=torch.int32)
    # a non-contiguous image (a transposed view): the kernels get a contiguous copy
    strided = image.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    got = _output_and_grads(strided, grid, True, valid)
    want = _output_and_grads(image, grid, False, valid)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    luma = (0.299, 0.587, 0.114)
    assert [c[0] for c in calls] == ["fwd", "bwd"]
    assert all(c[2] == luma and c[3] for c in calls), calls
    assert all(c[1].dtype == torch.int32 and torch.equal(c[1], valid) for c in calls)
    assert calls[1][4] == 2  # the default backward: csrc/bilateral.h's kBilateralBwdRowRuns

    # a named backward variant reaches the kernel as its index in bilateral.h's enum
    calls.clear()
    x = image.clone().requires_grad_()
    fused_bilateral.fused_apply_grid(x, grid, None, luma, backward="shared").sum().backward()
    assert calls[1][4] == 0
    with pytest.raises(ValueError, match="'fastest'.*shared, warp_runs, row_runs"):
        fused_bilateral.fused_apply_grid(image, grid, None, luma, backward="fastest")


def test_a_bad_fused_bilateral_value_is_one_line(demo_scene, tmp_path):
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "2", "--device", "cpu",
                         "--set", "train.appearance=bilateral", "--set", "dev.fused_bilateral=sometimes")  # fmt: skip
    assert_one_error(code, err, "dev.fused_bilateral", "true/false", "sometimes")
    assert not (tmp_path / "run").exists()


def test_a_bad_bilateral_backward_is_one_line(demo_scene, tmp_path):
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "2", "--device", "cpu",
                         "--set", "dev.bilateral_backward=fastest")  # fmt: skip
    assert_one_error(code, err, "dev.bilateral_backward must be one of shared, warp_runs, row_runs", "fastest")
    assert not (tmp_path / "run").exists()
