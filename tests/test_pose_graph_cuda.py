"""train.pose_refine on the CUDA-graph engine: the camera gradients of our fused SH colours and of
the canvas projection against gsplat's (autograd through its directions; its projection's viewmat
gradient along rigid motions), and graph steps with pose refinement against eager steps, on one
image size and on the canvas, with and without overflow redos, across pose_refine_start (a new
epoch, captured again), within what two eager runs differ by.
The host side: tests/test_pose_graph.py. Run by bench/gpu_tests.sh."""

from __future__ import annotations

import pytest
import torch
from test_graph_cuda import _same_model

from bench.graph_cases import eager_steps_on_the_canvas, graph_and_two_eager, mixed_sizes
from gstrain.data.colmap import load_scene
from gstrain.data.scene import Scene
from gstrain.train.pose_refine import correction_matrices

pytestmark = pytest.mark.cuda

POSES = {"pose_refine": True, "pose_refine_start": 3}
POSE_OPTIM = {"pose_lr": 0.01, "pose_lr_final": 0.001}
STEPS = 30
DELTA_TOL = 1e-3  # a tenth of one Adam step of a pose (its rate 0.01): a lost, doubled or stale step moves more


def _camera(seed: int) -> torch.Tensor:
    """A rigid world-to-camera matrix looking at the origin region from about 4 units."""
    g = torch.Generator().manual_seed(seed)
    viewmat = correction_matrices(torch.randn(1, 6, generator=g) * 0.3, 1.0, torch.tensor([4.0]))[0]
    viewmat[:3, 3] += torch.tensor([0.1, -0.2, 4.0])
    return viewmat.cuda()


def _rigid_parts(grad: torch.Tensor, viewmat: torch.Tensor) -> torch.Tensor:
    """<grad, xi^ viewmat> for the six unit rigid motions xi of the camera."""
    parts = []
    for k in range(6):
        hat = torch.zeros(4, 4, dtype=torch.float64, device=grad.device)
        if k < 3:
            i, j = [(1, 2), (2, 0), (0, 1)][k]
            hat[i, j], hat[j, i] = -1.0, 1.0
        else:
            hat[k - 3, 3] = 1.0
        parts.append((grad.double() * (hat @ viewmat.double())).sum())
    return torch.stack(parts)


@pytest.mark.parametrize("degree", [1, 3])
def test_fused_sh_colours_give_gsplats_camera_gradient(degree):
    from gstrain.render.cuda import splat_colors

    g = torch.Generator().manual_seed(degree)
    n = 6000
    params = {"means": torch.randn(n, 3, generator=g) * 2.0, "sh0": torch.randn(n, 1, 3, generator=g),
              "shN": torch.randn(n, 15, 3, generator=g) * 0.6}  # fmt: skip
    params = {k: v.cuda() for k, v in params.items()}
    radii = torch.randint(0, 6, (1, n, 2), generator=g, dtype=torch.int32).cuda()
    weights = torch.randn(1, n, 3, generator=g).cuda()
    grads = {}
    for fused in (True, False):
        viewmat = _camera(7).requires_grad_(True)
        (splat_colors(params, viewmat, degree, radii, fused=fused) * weights).sum().backward()
        grads[fused] = viewmat.grad
    want, got = grads[False], grads[True]
    assert float(want.abs().max()) > 1e-2
    err = float((got - want).norm() / want.norm())
    assert err < 1e-4, err


@pytest.mark.parametrize("antialiased", [False, True])
def test_canvas_projection_gives_gsplats_camera_gradient_along_rigid_motions(antialiased):
    from gsplat import fully_fused_projection

    from gstrain.render.sized_projection import project_sized, project_sized_compensated

    width, height = 64, 48
    K = torch.tensor([[50.0, 0, 30.5], [0, 52.0, 22.0], [0, 0, 1]], device="cuda")
    g = torch.Generator().manual_seed(5)
    n = 4000
    means = ((torch.rand(n, 3, generator=g) - 0.5) * torch.tensor([5.0, 4.0, 3.0])).cuda()
    quats = torch.randn(n, 4, generator=g).cuda()
    scales = torch.exp(torch.randn(n, 3, generator=g) * 0.8 - 2.5).cuda()
    parts = {}
    for name in ("gsplat", "ours"):
        viewmat = _camera(11).requires_grad_(True)
        if name == "gsplat":
            radii, m2d, depths, conics, comp = fully_fused_projection(
                means, None, quats, scales, viewmat[None], K[None], width, height, eps2d=0.3, near_plane=0.01,
                packed=False, calc_compensations=antialiased)  # fmt: skip
        else:
            valid = torch.tensor([width, height], dtype=torch.int32, device="cuda")
            project = project_sized_compensated if antialiased else project_sized
            radii, m2d, depths, conics, *rest = project(means, quats, scales, viewmat, K, valid)
            comp = rest[0] if rest else None
        seen = (radii > 0).all(-1)
        gen = torch.Generator(device="cuda").manual_seed(1)
        outputs = [m2d, conics, depths[..., None]] + ([comp[..., None]] if comp is not None else [])
        loss = sum((t * torch.randn(t.shape, generator=gen, device="cuda")).sum(-1)[seen].sum() for t in outputs)
        loss.backward()
        parts[name] = _rigid_parts(viewmat.grad, viewmat.detach())
    assert float(parts["gsplat"].abs().max()) > 1e-2
    scale = float(parts["gsplat"].abs().max())
    torch.testing.assert_close(parts["ours"], parts["gsplat"], rtol=1e-3, atol=1e-3 * scale)


def _run_pair(scene: Scene, tmp_path, monkeypatch, overflow: bool) -> tuple:
    """bench/graph_cases.graph_and_two_eager with pose refinement, which keeps the fused SH colours."""
    graphed, eager, again, losses = graph_and_two_eager(scene, tmp_path, STEPS, monkeypatch, overflow, train=POSES,
                                                        optim=POSE_OPTIM)  # fmt: skip
    assert graphed.renderer.options.fused_sh
    return graphed, eager, again, losses


def _same_losses(losses: dict[str, list[float]]) -> None:
    for step, (x, y, z) in enumerate(zip(losses["graph"], losses["eager"], losses["again"], strict=True)):
        assert abs(x - y) <= max(1e-5 * abs(y), 3 * abs(z - y)), (step, x, y, z)


def _same_poses(graphed, eager, again) -> None:
    """The graph run's corrections within DELTA_TOL of the eager run's, or 3x what the second eager
    run differs by; the same Adam step count for every view (none lost or doubled)."""
    a, b, c = graphed.pose_refiner, eager.pose_refiner, again.pose_refiner
    moved = float(b.delta.detach().abs().max())
    assert moved > 5 * DELTA_TOL, moved  # (a row's first Adam step is the rate, 10x DELTA_TOL, less the gauge's)
    diff = float((a.delta.detach() - b.delta.detach()).abs().max())
    noise = float((c.delta.detach() - b.delta.detach()).abs().max())
    assert diff < max(DELTA_TOL, 3 * noise), (diff, noise)
    assert torch.equal(a.updates, b.updates) and int(b.updates.sum()) == STEPS - POSES["pose_refine_start"]


def _graph_steps_ran(g, overflow: bool) -> None:
    assert g.views >= 20 and g.captures >= 2, g.summary()  # the poses' start begins an epoch of its own
    assert sum(g.eager_steps.values()) + g.views == STEPS, g.summary()
    assert g.redos >= 1 or not overflow, g.summary()


@pytest.mark.parametrize("overflow", [False, True])
def test_graph_steps_with_pose_refinement_equal_eager_steps(demo_scene, tmp_path, monkeypatch, overflow):
    graphed, eager, again, losses = _run_pair(load_scene(demo_scene), tmp_path, monkeypatch, overflow)
    g = graphed.graphs
    assert g.canvas is None, g.summary()
    _graph_steps_ran(g, overflow)
    _same_losses(losses)
    _same_poses(graphed, eager, again)
    _same_model(graphed, eager, 1e-4)


@pytest.mark.parametrize("overflow", [False, True])
def test_canvas_graph_steps_with_pose_refinement_equal_eager_canvas_steps(demo_scene, tmp_path, monkeypatch,
                                                                           overflow):  # fmt: skip
    scene = mixed_sizes(load_scene(demo_scene))
    eager_steps_on_the_canvas(monkeypatch, (64, 64))
    graphed, eager, again, losses = _run_pair(scene, tmp_path, monkeypatch, overflow)
    g = graphed.graphs
    assert g.canvas is not None and g.canvas[:2] == (64, 64), g.summary()
    _graph_steps_ran(g, overflow)
    _same_losses(losses)
    _same_poses(graphed, eager, again)
    _same_model(graphed, eager, 1e-4)
