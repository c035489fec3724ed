"""dev.fused_bilateral's kernels (gstrain/train/csrc/bilateral.cu) against the F.grid_sample path:
the output and both gradients on odd image sizes and several grids (ones whose blocks take the
shared-memory tile, with and without the warp's shuffle sum, and ones that fall back to global
atomics) for every backward variant (fused_bilateral.BACKWARD_VARIANTS), with and without a canvas
`valid`, pixels whose luminance is exactly 0, below 0 and above 1, smooth ramps (runs of one cell
of many lengths within a warp); inside a captured CUDA graph (valid read on the device); and eager
training runs with the switch on and off. The reference is the grid_sample path in float64, so it
is independent of float32 summation order. Run by bench/gpu_tests.sh."""

from __future__ import annotations

import pytest
import torch
from test_appearance_graph_cuda import MODELS, REPEATS, _exposed, _same_losses, _same_table

from bench.graph_cases import graph_trainer
from gstrain.data.colmap import load_scene
from gstrain.train.bilateral_grid import LUMA_B, LUMA_G, LUMA_R, apply_grid, identity_grids
from gstrain.train.fused_bilateral import BACKWARD_VARIANTS, DEFAULT_BACKWARD, fusable, fused_apply_grid

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
# (height, width, (L, Y, X)) and what the backward's blocks do with them
CASES = {
    "default grid, odd size": (37, 65, (8, 16, 16)),
    "large image: tiles, warp sums": (203, 333, (8, 16, 16)),
    "fewer pixels than cells: global": (7, 9, (8, 16, 16)),
    "tiny image, largest x/y: global": (9, 11, (4, 64, 64)),
    "64 levels: the whole shared budget": (50, 71, (64, 4, 4)),
    "uneven small grid": (120, 250, (3, 5, 7)),
    "one cell on every axis": (33, 47, (1, 1, 1)),
    "one level": (41, 66, (1, 6, 9)),
}
SMOOTH = (0.3, 0.5, 0.2)  # a flat patch's colour: luminance 0.412, at no level of these grids


def _image(height: int, width: int, seed: int) -> torch.Tensor:
    """Random colours in [-0.2, 1.3] with a flat patch (every warp of it in one cell: the shuffle
    sum), a black patch (luminance exactly 0: the border, no guide gradient) and a patch at 1.5
    (luminance past 1: clamped, no guide gradient)."""
    gen = torch.Generator().manual_seed(seed)
    image = torch.rand(height, width, 3, generator=gen) * 1.5 - 0.2
    h, w = max(height // 3, 1), max(width // 3, 1)
    image[:h, :w] = torch.tensor(SMOOTH)
    image[h:2 * h, w:2 * w] = 0.0
    image[-h:, -w:] = 1.5
    return image


def _grid(levels_y_x: tuple[int, int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return identity_grids(1, levels_y_x)[0] + 0.3 * torch.randn(12, *levels_y_x, generator=gen)


def _run(image: torch.Tensor, grid: torch.Tensor, grad_out: torch.Tensor, valid: torch.Tensor | None,
         fused: bool, backward: str = DEFAULT_BACKWARD) -> list[torch.Tensor]:  # fmt: skip
    """[output, d/d image, d/d grid] of sum(output * grad_out); fused: the kernels with that backward
    variant (the default one through apply_grid, as the trainer calls it)."""
    image, grid = image.clone().requires_grad_(), grid.clone().requires_grad_()
    if fused and backward != DEFAULT_BACKWARD:
        out = fused_apply_grid(image, grid, valid, (LUMA_R, LUMA_G, LUMA_B), backward)
    else:
        out = apply_grid(image, grid, valid, fused=fused)
    return [out.detach(), *torch.autograd.grad(out, (image, grid), grad_out)]


def _check(image: torch.Tensor, grid: torch.Tensor, valid: torch.Tensor | None, seed: int,
           backward: str = DEFAULT_BACKWARD) -> None:  # fmt: skip
    image, grid = image.to(CUDA), grid.to(CUDA)
    assert fusable(image, grid)
    grad_out = torch.randn(image.shape, generator=torch.Generator().manual_seed(seed)).to(CUDA)
    got = _run(image, grid, grad_out, valid, fused=True, backward=backward)
    want = _run(image.double(), grid.double(), grad_out.double(), valid, fused=False)  # grid_sample, float64
    for name, a, b in zip(("output", "image gradient", "grid gradient"), got, want, strict=True):
        scale = float(b.abs().max()) + 1e-12
        err = float((a.double() - b).abs().max())
        # float32 positions near cell 63 of a 64-cell axis are off by up to 4e-6 of a cell: 1e-5 of
        # the largest value on a CPU emulation of these kernels; a wrong index or weight is O(1)
        assert err <= 5e-5 * scale + 1e-6, (name, err, scale)


@pytest.mark.parametrize("backward", BACKWARD_VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernels_compute_grid_samples_function_and_gradients(case, backward):
    height, width, cells = CASES[case]
    _check(_image(height, width, 0), _grid(cells, 1), None, 2, backward)


@pytest.mark.parametrize("backward", BACKWARD_VARIANTS)
@pytest.mark.parametrize("case", ["default grid, odd size", "large image: tiles, warp sums", "uneven small grid",
                                  "tiny image, largest x/y: global"])  # fmt: skip
def test_on_a_canvas_the_kernels_slice_by_the_valid_size(case, backward):
    """The view in the top-left (width, height) of a larger canvas; the pixels past it sit at the
    grid's last cells, as grid_sample's border clamping puts them."""
    height, width, cells = CASES[case]
    canvas = _image(height + 13, width + 30, 3)
    valid = torch.tensor([width, height], dtype=torch.int32, device=CUDA)
    _check(canvas, _grid(cells, 4), valid, 5, backward)


@pytest.mark.parametrize("backward", BACKWARD_VARIANTS)
@pytest.mark.parametrize("cells", [(8, 16, 16), (4, 64, 64)])
def test_smooth_ramps_give_runs_of_every_length_within_a_warp(cells, backward):
    """A photo-like image: luminance ramps along x at rates that change the level every few to
    every few hundred pixels, so warps hold runs of one cell of many lengths (the segmented sums'
    boundaries), plus a few isolated outliers that split runs."""
    height, width = 96, 700
    xs = torch.arange(width, dtype=torch.float32)
    rates = torch.logspace(-3.5, -0.5, height)[:, None]  # luminance per pixel, row by row
    ramp = (0.5 + 0.45 * torch.sin(xs[None, :] * rates * 6.0)).unsqueeze(-1)
    image = ramp * torch.tensor([0.9, 1.0, 1.1])
    image[::7, ::37] = torch.tensor([1.0, 0.0, 0.5])
    _check(image, _grid(cells, 12), None, 13, backward)


def test_the_guide_gradient_is_zero_where_the_luminance_is_clamped():
    """Known answer: a grid whose transform is gain(luminance) * I, the gain rising with the level.
    Pixels of luminance <= 0 or >= 1 see no change of the gain when their colour moves, so their
    gradient is the gain alone; inside, it adds the gain's slope times the luminance weights."""
    levels = 5
    gains = torch.tensor([0.5, 1.0, 2.0, 2.5, 4.0])
    grid = torch.zeros(12, levels, 2, 3)
    for entry in (0, 5, 10):
        grid[entry] = gains[:, None, None]
    image = torch.tensor([[[0.0, 0.0, 0.0], [-0.3, -0.1, -0.2], [1.5, 1.2, 1.1], [0.3, 0.5, 0.2]]])  # [1, 4, 3]
    _check(image, grid, None, 6)
    x = image.to(CUDA).requires_grad_()
    out = apply_grid(x, grid.to(CUDA), fused=True)
    (grad,) = torch.autograd.grad(out.sum(), x)
    luma = torch.tensor([0.299, 0.587, 0.114])
    for p in range(3):  # clamped: d out_r / d rgb_c = gain for c == r, so the column sums are the gain
        lum = float(image[0, p] @ luma)
        gain = float(gains[0] if lum <= 0 else gains[-1])
        torch.testing.assert_close(grad[0, p].cpu(), torch.full((3,), gain), rtol=0, atol=1e-6)
    lum = float(image[0, 3] @ luma)  # 0.412 * 4 = 1.65: between levels 1 and 2
    gain = float(gains[1] + (gains[2] - gains[1]) * (lum * (levels - 1) - 1))
    slope = float(gains[2] - gains[1]) * (levels - 1)  # d gain / d luminance
    expected = gain + slope * float(image[0, 3].sum()) * luma
    torch.testing.assert_close(grad[0, 3].cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backward", BACKWARD_VARIANTS)
def test_the_kernels_run_in_a_cuda_graph_and_read_valid_on_the_device(backward):
    """Forward and backward captured once, replayed with other pixels, grid and valid size: the
    replay's results are the eager kernels' on those inputs (nothing was frozen on the host)."""
    height, width, cells = 45, 77, (8, 16, 16)
    image = _image(height, width, 7).to(CUDA).requires_grad_()
    grid = _grid(cells, 8).to(CUDA).requires_grad_()
    grad_out = torch.randn(height, width, 3, device=CUDA)
    valid = torch.tensor([width, height], dtype=torch.int32, device=CUDA)

    def step() -> list[torch.Tensor]:
        out = fused_apply_grid(image, grid, valid, (LUMA_R, LUMA_G, LUMA_B), backward)
        return [out, *torch.autograd.grad(out, (image, grid), grad_out)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        image.copy_(_image(height, width, 9).to(CUDA))
        grid.copy_(_grid(cells, 10).to(CUDA))
        grad_out.normal_()
        valid.copy_(torch.tensor([width - 20, height - 11], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(captured, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    _check(image.detach(), grid.detach(), valid, 11, backward)  # and the new valid size is the one sliced by


def test_eager_training_with_the_kernels_follows_grid_sample(demo_scene, tmp_path):
    """30 eager steps with train.appearance=bilateral (TV on), the switch on against runs with it
    off: losses and the learned grids agree within what grid_sample runs part by (REPEATS of them
    beside the compared one)."""
    from gstrain.train.trainer import seed_everything

    scene = _exposed(load_scene(demo_scene))
    runs = {}
    agains = [f"again{k}" for k in range(REPEATS)]
    for name, fused in (("fused", True), ("plain", False), *((again, False) for again in agains)):
        seed_everything(0)
        runs[name] = graph_trainer(scene, tmp_path, name, graphs=False, train=MODELS["bilateral"],
                                   dev={"fused_bilateral": fused})  # fmt: skip
        assert runs[name].ctx.corrections[0].fused is fused
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(30):
        for name, run in runs.items():
            torch.cuda.manual_seed(1000 + step)
            run.step = step
            losses[name].append(float(run.train_step(step)[0]))
    renamed = {"graph": losses["fused"], "eager": losses["plain"], **{again: losses[again] for again in agains}}
    _same_losses(renamed)
    _same_table(runs["fused"], runs["plain"], [runs[again] for again in agains])
