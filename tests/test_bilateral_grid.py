"""train.appearance=bilateral: the grid's slicing against brute-force trilinear interpolation, its
gradients, the total-variation regulariser, the eager and graph-protocol steps, two ranks, bad
values, and a resume that continues exactly. The known-answer training run:
tests/test_bilateral_known_answer.py; the graph engine's host side: tests/test_appearance_graph.py."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli

from gstrain.config import build_config
from gstrain.errors import UserError
from gstrain.train.appearance import apply_affine, build_corrections
from gstrain.train.bilateral_grid import (
    BilateralAppearance,
    apply_grid,
    identity_grids,
    slice_grid,
    total_variation,
    total_variation_grad,
)
from gstrain.train.step import StepView

REC601 = (0.299, 0.587, 0.114)


def _trilinear_reference(grid: np.ndarray, image: np.ndarray) -> np.ndarray:
    """Each pixel's [3, 4] transform by the definition, in float64: the pixel at column px of W sits
    at grid x (px + 0.5) / W * (X - 1), y likewise, and luminance clamp(Rec. 601 luma) * (L - 1);
    the 8 surrounding cells weighted by the products of the 1-D distances."""
    _, levels, gy, gx = grid.shape
    height, width = image.shape[:2]
    out = np.zeros((height, width, 12))
    for py in range(height):
        for px in range(width):
            luma = min(max(float(np.dot(image[py, px], REC601)), 0.0), 1.0)
            pos = ((px + 0.5) / width * (gx - 1), (py + 0.5) / height * (gy - 1), luma * (levels - 1))
            sizes = (gx, gy, levels)
            lo = [min(int(np.floor(p)), max(s - 2, 0)) for p, s in zip(pos, sizes, strict=True)]
            frac = [p - low for p, low in zip(pos, lo, strict=True)]
            for cx in (0, 1):
                for cy in (0, 1):
                    for cz in (0, 1):
                        w = ((frac[0] if cx else 1 - frac[0]) * (frac[1] if cy else 1 - frac[1])
                             * (frac[2] if cz else 1 - frac[2]))  # fmt: skip
                        if w == 0.0:
                            continue
                        out[py, px] += w * grid[:, lo[2] + cz, lo[1] + cy, lo[0] + cx]
    return out.reshape(height, width, 3, 4)


# ----------------------------------------------------------------- slicing
def test_a_grid_of_one_affine_everywhere_is_that_affine():
    gen = torch.Generator().manual_seed(0)
    affine = torch.tensor([[1.3, 0.1, -0.2, 0.05], [0.0, 0.8, 0.3, -0.1], [0.2, 0.0, 1.1, 0.02]])
    grid = affine.reshape(12, 1, 1, 1).expand(12, 4, 5, 6).contiguous()
    image = torch.rand(9, 11, 3, generator=gen) * 1.4 - 0.2  # also luminances past [0, 1]: border cells
    expected = image @ affine[:, :3].T + affine[:, 3]
    torch.testing.assert_close(apply_grid(image, grid), expected, rtol=0, atol=2e-6)
    identity = identity_grids(1, (4, 5, 6))[0]
    torch.testing.assert_close(apply_grid(image, identity), image, rtol=0, atol=1e-6)


def test_a_grid_varying_along_luminance_applies_the_interpolated_gain():
    """Cells at luminance level l hold gain g_l (times the identity) and bias c_l: a pixel of
    luminance y gets the piecewise-linear interpolation of g and c at y * (L - 1)."""
    levels = 5
    gains = np.array([0.5, 1.5, 0.9, 1.2, 2.0])
    bias = np.array([0.0, 0.1, -0.05, 0.2, 0.0])
    grid = np.zeros((12, levels, 3, 4))
    for entry in (0, 5, 10):
        grid[entry] = gains[:, None, None]
    for entry in (3, 7, 11):
        grid[entry] = bias[:, None, None]
    grey = np.array([0.0, 0.1, 0.2, 0.25, 0.33, 0.5, 0.71, 0.875, 0.99, 1.0])  # known luminances
    image = np.repeat(grey[None, :, None], 3, axis=2) * np.ones((2, 1, 1))  # r = g = b: luma = grey
    got = apply_grid(torch.tensor(image, dtype=torch.float64), torch.tensor(grid)).numpy()
    node = np.linspace(0.0, 1.0, levels)
    expected = image * np.interp(grey, node, gains)[None, :, None] + np.interp(grey, node, bias)[None, :, None]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert np.ptp(np.interp(grey, node, gains)) > 1.0  # the gain really varies across these pixels


def test_slicing_is_trilinear_interpolation_brute_force():
    gen = torch.Generator().manual_seed(1)
    grid = torch.randn(12, 3, 4, 5, generator=gen, dtype=torch.float64)
    image = torch.rand(6, 7, 3, generator=gen, dtype=torch.float64)
    expected = _trilinear_reference(grid.numpy(), image.numpy())
    np.testing.assert_allclose(slice_grid(grid, image).numpy(), expected, rtol=0, atol=1e-12)
    out = apply_grid(image, grid).numpy()
    np.testing.assert_allclose(out, np.einsum("hwij,hwj->hwi", expected[..., :3], image.numpy()) + expected[..., 3],
                               rtol=0, atol=1e-12)  # fmt: skip
    # float32 (what training runs) agrees to float32 rounding
    out32 = apply_grid(image.float(), grid.float()).double().numpy()
    np.testing.assert_allclose(out32, out, rtol=0, atol=2e-5)


def test_slicing_gradients_pass_gradcheck():
    gen = torch.Generator().manual_seed(2)
    grid = (identity_grids(1, (3, 3, 3))[0].double() + 0.2 * torch.randn(12, 3, 3, 3, generator=gen,
                                                                           dtype=torch.float64)).requires_grad_()
    image = (0.1 + 0.8 * torch.rand(4, 4, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    # both inputs: the grid's cells and the render (its colours and, through the luminance, where it slices)
    assert torch.autograd.gradcheck(apply_grid, (image, grid), eps=1e-6, atol=1e-7)


def test_on_a_canvas_the_view_part_is_sliced_as_the_view_alone():
    """A CUDA-graph canvas step renders a view into the top-left (width, height) of a larger image
    (StepView.valid): the view's pixels get the transforms they get on an image of their own."""
    gen = torch.Generator().manual_seed(5)
    grid = torch.randn(12, *GRID, generator=gen)
    view = torch.rand(7, 9, 3, generator=gen)
    canvas = torch.rand(12, 16, 3, generator=gen)
    canvas[:7, :9] = view
    valid = torch.tensor([9, 7], dtype=torch.int32)  # (width, height)
    alone = apply_grid(view, grid)
    torch.testing.assert_close(apply_grid(canvas, grid, valid)[:7, :9], alone, rtol=0, atol=1e-5)
    # positions matter: sliced by the canvas's size the view's pixels would get other transforms
    assert (apply_grid(canvas, grid)[:7, :9] - alone).abs().max() > 0.1
    model = _model()
    with torch.no_grad():
        model.table[1] = grid
    slot = StepView(torch.eye(4), torch.eye(3), canvas, valid=valid, slot=torch.tensor([1], dtype=torch.int32))
    torch.testing.assert_close(model.image(canvas, slot)[:7, :9], alone, rtol=0, atol=1e-5)


# ----------------------------------------------------------------- the regulariser
def _tv_by_definition(table: torch.Tensor) -> torch.Tensor:
    """Sum over the luminance, y and x axes of the mean squared difference of neighbours."""
    luma = ((table[:, :, 1:] - table[:, :, :-1]) ** 2).mean()
    y = ((table[:, :, :, 1:] - table[:, :, :, :-1]) ** 2).mean()
    return luma + y + ((table[..., 1:] - table[..., :-1]) ** 2).mean()


def test_total_variation_and_its_closed_form_gradient():
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(2, 12, 3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    reference = _tv_by_definition(table)
    (expected,) = torch.autograd.grad(7.5 * reference, table)
    torch.testing.assert_close(total_variation(table.detach()), reference.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(total_variation_grad(table.detach(), 7.5), expected, rtol=1e-12, atol=1e-15)
    assert float(total_variation(identity_grids(3, (2, 3, 4)))) == 0.0
    flat_axis = torch.randn(1, 12, 1, 3, 3, generator=gen)  # one luminance level: that axis adds nothing
    assert torch.isfinite(total_variation(flat_axis)) and torch.isfinite(total_variation_grad(flat_axis, 1.0)).all()


# ----------------------------------------------------------------- the correction on the step
V, GRID, LR, DECAY, START, TV = 4, (2, 3, 3), 0.02, 0.3, 3, 10.0


def _model(**kw) -> BilateralAppearance:
    args = {"lr": LR, "decay": DECAY, "start": START, "tv": TV} | kw
    return BilateralAppearance(V, GRID, torch.device("cpu"), **args)


def _view_grad(step: int) -> torch.Tensor:
    """A one-view step's table gradient: the view's grid only."""
    gen = torch.Generator().manual_seed(step)
    grad = torch.zeros(V, 12, *GRID)
    grad[int(torch.randint(V, (1,), generator=gen))] = torch.randn(12, *GRID, generator=gen)
    return grad


def test_the_device_index_and_the_host_index_pick_the_same_grid_and_gradient():
    model = _model()
    with torch.no_grad():
        model.table[2, 0] = 2.0  # view 2 doubles red everywhere
    image = torch.rand(5, 6, 3, generator=torch.Generator().manual_seed(4))
    expected = image.clone()
    expected[..., 0] *= 2.0
    grads = []
    for view in (StepView(torch.eye(4), torch.eye(3), image, index=2),
                 StepView(torch.eye(4), torch.eye(3), image, slot=torch.tensor([2], dtype=torch.int32))):  # fmt: skip
        out = model.image(image, view)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        (out * torch.arange(3.0)).sum().backward()
        grads.append(model.table.grad)
        model.table.grad = None
    assert torch.equal(grads[0], grads[1]) and grads[0][[0, 1, 3]].abs().sum() == 0  # only view 2's grid
    assert torch.equal(model.image(image, StepView(torch.eye(4), torch.eye(3), image)), image)  # a test view


def _reference_step(table: torch.nn.Parameter, adam: torch.optim.Adam, step: int, grad: torch.Tensor) -> None:
    """The eager definition: nothing before START; the loss's gradient plus TV times the table's
    total variation's (by autograd), torch's Adam, then the pull toward identity."""
    if step < START:
        return
    probe = table.detach().clone().requires_grad_()
    (tv_grad,) = torch.autograd.grad(TV * _tv_by_definition(probe), probe)
    table.grad = grad + tv_grad
    adam.step()
    with torch.no_grad():
        table.sub_((table - identity_grids(1, GRID)) * (LR * DECAY))


def _graph_protocol_step(model: BilateralAppearance, step: int, grad: torch.Tensor, flag: torch.Tensor) -> None:
    model.advance(step)
    model.set_skip_flag(flag)
    model.table.grad = grad.clone()
    model.after_step(step)
    model.set_skip_flag(None)


def test_eager_and_graph_protocol_steps_are_adam_with_tv_and_decay_and_resume_exactly():
    eager, graphed = _model(), _model()
    table = torch.nn.Parameter(identity_grids(V, GRID))
    adam = torch.optim.Adam([table], lr=LR, eps=1e-15)
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(30):
        grad = _view_grad(step)
        eager.table.grad = grad.clone()
        eager.after_step(step)
        _graph_protocol_step(graphed, step, grad, flag)
        _reference_step(table, adam, step, grad)
        if step < START:
            assert torch.equal(eager.table.detach(), identity_grids(V, GRID))
    # the two paths of the code run the same float32 operations; the definition differs in rounding only
    assert torch.equal(eager.table.detach(), graphed.table.detach())
    torch.testing.assert_close(eager.table.detach(), table.detach(), rtol=1e-5, atol=1e-6)
    untouched_by_loss = [i for i in range(V) if all(_view_grad(s)[i].abs().sum() == 0 for s in range(30))]
    moved = (eager.table.detach() - identity_grids(V, GRID)).abs().amax(dim=(1, 2, 3, 4))
    assert (moved > 1e-3).all() or untouched_by_loss, moved  # it learned

    # a checkpoint in the middle, loaded into fresh models of either path, continues exactly
    saved = copy.deepcopy(eager.state_dict())
    resumed, uninterrupted = _model(), eager
    resumed.load_state_dict(copy.deepcopy(saved))
    for step in range(30, 40):
        grad = _view_grad(step)
        for m in (resumed, uninterrupted):
            m.table.grad = grad.clone()
            m.after_step(step)
    assert torch.equal(resumed.table.detach(), uninterrupted.table.detach())
    with pytest.raises(ValueError, match="appearance table of shape"):
        BilateralAppearance(V, (2, 3, 4), torch.device("cpu"), lr=LR).load_state_dict(saved)


def test_tv_pulls_an_unseen_grid_smooth_and_no_tv_leaves_it():
    """A view with no gradient of its own: TV alone smooths its grid; with tv 0 nothing moves."""
    for tv in (TV, 0.0):
        model = _model(tv=tv, decay=0.0, start=0)
        with torch.no_grad():
            model.table[1, 0, 1, 1, 1] += 1.0  # one bump in view 1's grid
        before = total_variation(model.table.detach()[1:2])
        for step in range(20):
            grad = torch.zeros(V, 12, *GRID)
            grad[0] = 1e-3  # a view-0 gradient only
            model.table.grad = grad
            model.after_step(step)
        after = total_variation(model.table.detach()[1:2])
        assert (after < 0.5 * before) if tv else (after == before), (tv, before, after)


# ----------------------------------------------------------------- config
def test_bad_grid_and_tv_values_are_one_line(demo_scene, tmp_path):
    cases = (("bilateral_grid_x", 0, "train.bilateral_grid_x must be in [1, 64] (cells); got 0"),
             ("bilateral_grid_luma", 65, "train.bilateral_grid_luma must be in [1, 64]"),
             ("bilateral_tv", -1.0, "train.bilateral_tv must be >= 0 and finite; got -1.0"))  # fmt: skip
    for key, value, needle in cases:
        with pytest.raises(UserError) as err:
            build_config(None, [{"train": {"appearance": "bilateral", key: value}}])
        assert needle in str(err.value)
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "2", "--device", "cpu",
                         "--set", "train.appearance=bilateral", "--set", "train.bilateral_grid_y=100")  # fmt: skip
    assert_one_error(code, err, "train.bilateral_grid_y must be in [1, 64] (cells); got 100")
    assert not (tmp_path / "run").exists()


def test_build_corrections_makes_the_configured_grid():
    cfg = build_config(None, [{"train": {"appearance": "bilateral", "bilateral_grid_x": 5, "bilateral_grid_y": 4,
                                         "bilateral_grid_luma": 3, "bilateral_tv": 2.5}}])  # fmt: skip
    (model,) = build_corrections(cfg, 7, torch.device("cpu"))
    assert isinstance(model, BilateralAppearance) and model.tv == 2.5
    assert tuple(model.table.shape) == (7, 12, 3, 4, 5)
    assert torch.equal(model.table.detach(), identity_grids(7, (3, 4, 5)))
    affine = torch.tensor([[2.0, 0, 0, 0.1], [0, 1, 0, 0], [0, 0, 0.5, 0]])
    image = torch.rand(3, 4, 3)
    torch.testing.assert_close(apply_grid(image, affine.reshape(12, 1, 1, 1).expand(12, 3, 4, 5)),
                               apply_affine(image, affine), rtol=0, atol=1e-6)  # fmt: skip


# ----------------------------------------------------------------- resume and eval through the CLI
SMALL_RUN = """
train: {steps: 16, seed: 3, device: cpu, appearance: bilateral, appearance_lr: 0.02, appearance_start: 4,
        appearance_decay: 0.1, bilateral_grid_x: 4, bilateral_grid_y: 4, bilateral_grid_luma: 3, bilateral_tv: 5}
model: {init: random, init_points: 300}
strategy: {refine_start: 6, refine_every: 6, reset_every: 100000}
log: {progress_every: 4, tb_every: 100000, eval_steps: [16], save_steps: [], ckpt_every: 0}
"""


@pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1",
                    reason="bit-identical CPU sums need one thread (run with OMP_NUM_THREADS=1)")
def test_resume_with_bilateral_equals_the_uninterrupted_run_and_eval_names_the_protocols(demo_scene, tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(SMALL_RUN)
    full, part = tmp_path / "full", tmp_path / "part"
    for args in ((full,), (part, "--set", "train.stop_at=9"), (part, "--resume", "--set", "train.stop_at=0")):
        code, err = call_cli("fit", demo_scene, "--config", config, "--out", *args)
        assert code == 0, err
    a = torch.load(full / "ckpt" / "step_16.pt", weights_only=True)
    b = torch.load(part / "ckpt" / "step_16.pt", weights_only=True)
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    grids_a, grids_b = a["corrections"]["appearance"], b["corrections"]["appearance"]
    assert grids_a["table"].shape[1:] == (12, 3, 4, 4)
    assert not torch.equal(grids_a["table"], identity_grids(len(grids_a["table"]), (3, 4, 4)))  # it learned
    assert torch.equal(grids_a["table"], grids_b["table"])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(grids_a["optimizer"]["state"][0][key], grids_b["optimizer"]["state"][0][key]), key

    # a resume that would change the grid is refused in one line, and writes nothing
    before = {p: p.read_bytes() for p in part.rglob("*") if p.is_file()}
    code, err = call_cli("fit", demo_scene, "--config", config, "--out", part, "--resume", "--steps", "20",
                         "--set", "train.bilateral_grid_x=8")  # fmt: skip
    assert_one_error(code, err, "--resume cannot change train.bilateral_grid_x: 4 -> 8")
    assert {p: p.read_bytes() for p in part.rglob("*") if p.is_file()} == before

    code, err = call_cli("eval", part, "--device", "cpu")
    assert code == 0, err
    metrics = json.loads((part / "metrics.json").read_text())
    assert metrics["protocol"].startswith("raw") and metrics["appearance"] == "bilateral"
    assert metrics["fitted_half"]["protocol"].startswith("fitted_half")
    summary = json.loads((part / "train_summary.json").read_text())
    assert abs(metrics["psnr"] - summary["final_test_psnr"]) < 1e-3
    code, err = call_cli("render", part, "--path", "test", "--device", "cpu", "--out", tmp_path / "frames")
    assert code == 0, err
    assert "renders are raw" in err and "train.appearance=bilateral" in err


# ----------------------------------------------------------------- torchrun: the sum over ranks
def test_under_ranks_the_gradient_is_summed_and_tv_added_once_after(monkeypatch):
    """Under torchrun after_step all-reduces the table's gradient (each view's gradient sits on its
    home rank), then adds the TV term once: every rank steps with sum(view gradients) + TV's, as
    one process would. The other rank is stood in for by an all_reduce that adds what it would
    hold at that point: its own view gradient plus whatever the code added before the reduce (so
    a TV term added before the sum counts twice). The real two-process sum of the shared table
    code: tests/test_appearance.py."""
    other = [_view_grad(100 + s) for s in range(6)]
    step_now = {"step": 0}
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    def all_reduce(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        added_before = t - _view_grad(step_now["step"])  # zero unless something came before the sum
        return t.add_(other[step_now["step"]] + added_before)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    ranked = _model(start=0)
    table = torch.nn.Parameter(identity_grids(V, GRID))
    adam = torch.optim.Adam([table], lr=LR, eps=1e-15)
    for step in range(6):
        step_now["step"] = step
        ranked.table.grad = _view_grad(step)
        ranked.after_step(step)
        _reference_step(table, adam, step + START, _view_grad(step) + other[step])  # START: past the warm-up
    torch.testing.assert_close(ranked.table.detach(), table.detach(), rtol=1e-5, atol=1e-6)
