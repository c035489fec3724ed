"""train.pose_refine under the CUDA-graph engine, its host side on the CPU: the closed-form rotation
against torch's matrix exponential, the per-view Adam driven as a graph replay drives it against
the eager update written out here (warm-up, skipped replays, redos), the captured step's path run
eagerly against the eager step, resume across the two paths, the graph engine's keys and loads;
and the camera gradients our kernels now give (render/camera_grad.py) against autograd through
float64 torch references. The captured graphs themselves: tests/test_pose_graph_cuda.py."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.graph_cases import captured_step_eagerly
from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train import corrections
from gstrain.train.pose_gauge import gauge_basis, without_gauge
from gstrain.train.pose_refine import PoseRefiner, correction_matrices, rotation_exp
from gstrain.train.trainer import Trainer

V = 7
LR, LR_FINAL, START, STEPS = 0.01, 0.001, 6, 60


def _skew(omega: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(omega), 3, 3, dtype=omega.dtype)
    out[:, 0, 1], out[:, 0, 2], out[:, 1, 2] = -omega[:, 2], omega[:, 1], -omega[:, 0]
    return out - out.transpose(1, 2)


# ----------------------------------------------------------------- the rotation
def test_the_closed_form_rotation_is_the_matrix_exponential_with_its_gradient():
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([2.0, 0.5, 0.011, 0.0099, 1e-3, 1e-6, 0.0])  # both sides of the series' switch
    omega = torch.randn(len(scales), 3, generator=gen, dtype=torch.float64) * scales[:, None].double()
    want = torch.linalg.matrix_exp(_skew(omega))
    torch.testing.assert_close(rotation_exp(omega), want, atol=1e-14, rtol=0)
    assert torch.equal(rotation_exp(omega)[-1], torch.eye(3, dtype=torch.float64))  # zero: exactly the identity
    weights = torch.randn(len(scales), 3, 3, generator=gen, dtype=torch.float64)
    grads = []
    for fn in (rotation_exp, lambda w: torch.linalg.matrix_exp(_skew(w))):
        x = omega.clone().requires_grad_(True)
        (fn(x) * weights).sum().backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=0)


# ----------------------------------------------------------------- the per-view Adam
def _cfg(start: int = START) -> SimpleNamespace:
    return SimpleNamespace(optim=SimpleNamespace(pose_lr=LR, pose_lr_final=LR_FINAL),
                           train=SimpleNamespace(pose_refine_start=start, steps=STEPS))  # fmt: skip


def _rig() -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    mats = []
    for _ in range(V):
        m = torch.eye(4, dtype=torch.float64)
        m[:3, :3] = torch.linalg.matrix_exp(_skew(torch.randn(1, 3, generator=gen, dtype=torch.float64)))[0]
        m[:3, 3] = torch.randn(3, generator=gen, dtype=torch.float64) * 3
        mats.append(m)
    return mats, torch.rand(V, generator=gen) * 4 + 1


def _refiner() -> PoseRefiner:
    mats, pivots = _rig()
    return PoseRefiner(mats, pivots, 2.0, _cfg(), torch.device("cpu"))


def _rendered(step: int) -> list[int]:
    """The views a step renders (a batch of two; now and then the same view twice)."""
    gen = torch.Generator().manual_seed(100 + step)
    return [int(i) for i in torch.randint(V, (2,), generator=gen)]


def _grad(step: int) -> torch.Tensor:
    return torch.randn(V, 6, generator=torch.Generator().manual_seed(step))


class _Reference:
    """The eager update written out: the rendered rows' Adam (own step counts, eps 1e-15, betas
    0.9 / 0.999) at the exponentially decaying rate, then the gauge removed; nothing before START."""

    def __init__(self) -> None:
        mats, pivots = _rig()
        self.gauge = gauge_basis(mats, pivots, 2.0)
        self.delta = torch.zeros(V, 6, dtype=torch.float64)
        self.m, self.v = torch.zeros(V, 6, dtype=torch.float64), torch.zeros(V, 6, dtype=torch.float64)
        self.t = [0] * V

    def step(self, step: int, rows: list[int], grad: torch.Tensor) -> None:
        if step < START:
            return
        frac = (step - START) / (STEPS - START)
        rate = LR * (LR_FINAL / LR) ** frac
        for r in sorted(set(rows)):
            g = grad[r].double()
            self.t[r] += 1
            self.m[r] = 0.9 * self.m[r] + 0.1 * g
            self.v[r] = 0.999 * self.v[r] + 0.001 * g * g
            m_hat, v_hat = self.m[r] / (1 - 0.9 ** self.t[r]), self.v[r] / (1 - 0.999 ** self.t[r])
            self.delta[r] -= rate * m_hat / (v_hat.sqrt() + 1e-15)
        self.delta = without_gauge(self.delta, self.gauge)


def _replay(model: PoseRefiner, step: int, rows: list[int], grad: torch.Tensor, flag: torch.Tensor) -> None:
    """One step as a graph replay drives the correction: the host's advance, then the captured
    step (the views' rows only on the device, the skip flag set), the gradient as the backward left it."""
    model.advance(step)
    model.set_skip_flag(flag)
    for r in rows:
        model.camera(torch.eye(4), SimpleNamespace(index=None, slot=torch.tensor([r], dtype=torch.int32)), step)
    if step >= START:
        model.delta.grad = grad.clone()
    model.after_step(step)
    model.set_skip_flag(None)


def _eager(model: PoseRefiner, step: int, rows: list[int], grad: torch.Tensor) -> None:
    for r in rows:
        model.camera(torch.eye(4), SimpleNamespace(index=r), step)
    if step >= START:
        model.delta.grad = grad.clone()
    model.after_step(step)


def _state(model: PoseRefiner) -> tuple[torch.Tensor, ...]:
    return (model.delta.detach().clone(), model.exp_avg.clone(), model.exp_avg_sq.clone(), model.updates.clone())


def test_graph_replays_step_the_poses_as_the_eager_update_with_warm_up_skips_and_redos():
    model, ref = _refiner(), _Reference()
    flag = torch.zeros(1, dtype=torch.int32)
    skipped = (list(range(4, 9)), list(range(30, 34)))  # one window across the warm-up's end, one after
    for step in range(STEPS):
        window = next((w for w in skipped if w[0] == step), None)
        if window is not None:  # an overflow from this step on: every update a no-op, then the redo
            before = _state(model)
            flag.fill_(step + 1)
            for s in window:
                _replay(model, s, _rendered(s), _grad(s), flag)
            assert all(torch.equal(x, y) for x, y in zip(before, _state(model), strict=True)), step
            model.rewind(window)
            flag.zero_()
        _replay(model, step, _rendered(step), _grad(step), flag)
        ref.step(step, _rendered(step), _grad(step))
        assert model.delta.grad is None
        if step < START:
            assert not model.delta.detach().any(), step
    assert model.updates.tolist() == ref.t and sum(ref.t) > 0
    torch.testing.assert_close(model.delta.detach().double(), ref.delta, atol=1e-6, rtol=0)
    assert float(ref.delta.abs().max()) > 50 * 1e-6  # it learned: the comparison means something
    torch.testing.assert_close(model.exp_avg.double(), ref.m, atol=1e-6, rtol=1e-5)


def test_a_replay_before_the_start_changes_nothing_and_the_key_says_when_it_learns():
    model = _refiner()
    assert model.graph_key(START - 1) != model.graph_key(START)
    assert model.graph_key(START) == model.graph_key(START + 20)
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(START):
        _replay(model, step, _rendered(step), _grad(step), flag)
    assert not model.delta.detach().any() and not model.updates.any()
    assert float(model.rate_feed.value) == 0.0  # advance fills the rate from the start on only
    model.advance(START)
    assert float(model.rate_feed.value) == pytest.approx(LR, rel=1e-7)


def test_resume_after_graph_steps_continues_exactly_on_either_path_in_the_same_storage():
    trained = _refiner()
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(20):
        _replay(trained, step, _rendered(step), _grad(step), flag)
    saved = copy.deepcopy(trained.state_dict())
    assert saved["updates"].device.type == "cpu" and saved["updates"].dtype == torch.int64
    eager, graphed = _refiner(), _refiner()
    key = graphed.graph_key(30)
    storage = [t.data_ptr() for t in (graphed.delta, graphed.exp_avg, graphed.exp_avg_sq, graphed.updates,
                                      graphed.gauge, graphed.rate_feed.value)]  # fmt: skip
    for model in (eager, graphed):
        model.load_state_dict(copy.deepcopy(saved))
    assert graphed.graph_key(30) == key  # the graphs captured before the load read the loaded values
    assert storage == [t.data_ptr() for t in (graphed.delta, graphed.exp_avg, graphed.exp_avg_sq, graphed.updates,
                                              graphed.gauge, graphed.rate_feed.value)]  # fmt: skip
    for step in range(20, 40):
        rows, grad = _rendered(step), _grad(step)
        _replay(trained, step, rows, grad, flag)
        _replay(graphed, step, rows, grad, flag)
        _eager(eager, step, rows, grad)
    for model in (eager, graphed):
        assert all(torch.equal(x, y) for x, y in zip(_state(model), _state(trained), strict=True))


# ----------------------------------------------------------------- the trainer's step, both paths
def _cpu_trainer(demo_scene: Path, tmp_path: Path) -> Trainer:
    cfg = build_config(overrides=[{
        "train": {"steps": 100, "device": "cpu", "pose_refine": True, "pose_refine_start": 5},
        "optim": {"pose_lr": 0.01}, "model": {"sh_degree": 1}, "strategy": {"refine_start": 1000},
    }])  # fmt: skip
    return Trainer(cfg, load_scene(demo_scene), tmp_path, torch.device("cpu"), log=lambda m: None)


def test_the_captured_steps_path_trains_as_the_eager_step_on_the_cpu(demo_scene, tmp_path):
    """Sixteen steps across pose_refine_start train the very poses and scene on both paths, bit
    for bit (one update in one form for both, train/pose_adam.py)."""
    runs = [_cpu_trainer(demo_scene, tmp_path / name) for name in ("eager", "captured")]
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(16):
        runs[0].train_step(step)
        captured_step_eagerly(runs[1], step, flag)
    a, b = runs[0].pose_refiner, runs[1].pose_refiner
    assert float(a.delta.detach().abs().max()) > 1e-4  # the poses moved
    assert int(a.updates.sum()) == 16 - 5 and torch.equal(a.updates, b.updates)
    for x, y in zip(_state(a), _state(b), strict=True):
        assert torch.equal(x, y)
    for key in runs[0].params:
        assert torch.equal(runs[1].params[key], runs[0].params[key]), key


def test_graph_engine_keys_loads_and_redoes_pose_refinement(demo_scene, tmp_path, monkeypatch):
    """The graph engine's host side with pose refinement on the CPU: graphs are possible, the
    epoch key changes when the poses start learning and not after, each load puts the view's index
    on the device and the step's rate in the refiner's scalar; a redo reloads the replays it repeats."""
    from gstrain.train import graph_step

    monkeypatch.setattr(graph_step.fused_adam, "advance", lambda optimizers: [0.0] * (2 * len(optimizers)))
    monkeypatch.setattr(graph_step.fused_adam, "step_counts", lambda optimizers: [0.0] * len(optimizers))
    monkeypatch.setattr(graph_step.fused_adam, "rewind", lambda optimizers, steps: None)
    trainer = _cpu_trainer(demo_scene, tmp_path)
    refiner = trainer.pose_refiner
    assert not corrections.graph_refusers(trainer.ctx.corrections)
    engine = graph_step.GraphEngine(trainer.ctx)
    assert engine._epoch_key(4) != engine._epoch_key(5)
    assert engine._epoch_key(5) == engine._epoch_key(6) == engine._epoch_key(90)
    views = [3, 1, 4, 1, 5, 0, 2, 6, 3]
    for step, idx in enumerate(views, start=1):
        engine._budget(0, engine.groups.group(idx), 1 << 16)
        engine._load(step, (idx,))
        assert int(engine.view_ints[0, 2]) == idx
        if step >= 5:
            assert float(refiner.rate_feed.value) == pytest.approx(refiner.rate(step), rel=1e-6)
        engine.unsettled.append((step, (idx,)))
    reloads = []

    def replay(step: int, idxs: tuple[int, ...]):
        reloads.append((step, *idxs))
        engine._load(step, idxs)

    monkeypatch.setattr(engine, "_graph_step", replay)
    engine.budget.flag.fill_(7 + 1)
    engine.settle()
    assert reloads == [(7, 2), (8, 6), (9, 3)]
    assert float(refiner.rate_feed.value) == pytest.approx(refiner.rate(9), rel=1e-6)


# ----------------------------------------------------------------- camera gradients of our kernels
def _hat(xi: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(4, 4, dtype=xi.dtype)
    out[:3, :3] = _skew(xi[None, :3])[0]
    out[:3, 3] = xi[3:]
    return out


def test_the_projections_camera_gradient_is_autograds_along_every_rigid_motion():
    """rigid_viewmat_grad from the means' and quaternions' gradients of the float64 reference
    projection, against autograd's viewmat gradient, along the six rigid motions of the camera."""
    from gstrain.render.camera_grad import rigid_viewmat_grad
    from gstrain.render.projection import project_gaussians

    gen = torch.Generator().manual_seed(2)
    n = 200
    means = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    quats = torch.randn(n, 4, generator=gen, dtype=torch.float64) * 2  # not unit: the kernel normalises
    scales = torch.rand(n, 3, generator=gen, dtype=torch.float64) * 0.3
    viewmat = correction_matrices(torch.randn(1, 6, generator=gen, dtype=torch.float64) * 0.3, 1.0,
                                  torch.tensor([2.0]))[0]  # fmt: skip
    viewmat[:3, 3] += torch.tensor([0.2, -0.1, 5.0], dtype=torch.float64)
    K = torch.tensor([[60.0, 0, 32], [0, 60, 30], [0, 0, 1]], dtype=torch.float64)
    m, q, v = (t.clone().requires_grad_(True) for t in (means, quats, viewmat))
    out = project_gaussians(m, q, scales, v, K, 64, 60, antialiased=True)
    outputs = (out.means2d, out.conics, out.depths, out.compensations)
    assert (out.radii > 0).all(-1).sum() > n // 2
    sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in outputs).backward()
    grad = rigid_viewmat_grad(viewmat, means, quats, m.grad, q.grad)
    for k in range(6):
        xi = torch.zeros(6, dtype=torch.float64)
        xi[k] = 1.0
        motion = _hat(xi) @ viewmat
        want = float((v.grad * motion).sum())
        assert float((grad * motion).sum()) == pytest.approx(want, rel=1e-9, abs=1e-9), k


class _TorchShKernel:
    """The fused SH kernel's two entry points in float64 torch (render/sh.py), for the CPU: what
    the autograd Function around them does is under test, not the kernel."""

    @staticmethod
    def _colours(means, sh0, shN, viewmat, radii, degree):
        from gstrain.render.projection import camera_centre
        from gstrain.render.sh import sh_to_color

        sh = torch.cat([sh0, shN], 1).double()
        colours = sh_to_color(sh, means.double() - camera_centre(viewmat.double()), degree)[None]
        return torch.where((radii > 0).all(-1)[..., None], colours, torch.full_like(colours, 0.5))

    def sh_colors_fwd(self, means, sh0, shN, viewmat, radii, degree):
        return (self._colours(means, sh0, shN, viewmat, radii, degree).float(),)

    def sh_colors_bwd(self, means, sh0, shN, viewmat, radii, degree, v_colors):
        inputs = [t.detach().double().requires_grad_(True) for t in (means, sh0, shN)]
        with torch.enable_grad():  # (autograd runs a Function's backward without grad mode)
            colours = self._colours(*inputs, viewmat, radii, degree)
            grads = torch.autograd.grad(colours, inputs, v_colors.double(), allow_unused=True)
        return tuple((torch.zeros_like(x) if g is None else g).float() for g, x in zip(grads, inputs, strict=True))


def test_the_fused_sh_colours_give_viewmat_its_gradient_through_the_camera_centre(monkeypatch):
    from gstrain.render import sh_colors as sh_module

    monkeypatch.setattr(sh_module.extensions, "raster", lambda: _TorchShKernel())
    gen = torch.Generator().manual_seed(3)
    n, degree = 300, 3
    means = torch.randn(n, 3, generator=gen)
    sh0, shN = torch.randn(n, 1, 3, generator=gen), torch.randn(n, 15, 3, generator=gen) * 0.5
    radii = torch.randint(0, 4, (1, n, 2), generator=gen, dtype=torch.int32)
    viewmat = correction_matrices(torch.randn(1, 6, generator=gen) * 0.3, 1.0, torch.tensor([2.0]))[0]
    viewmat[:3, 3] += torch.tensor([0.1, 0.2, 4.0])
    weights = torch.randn(1, n, 3, generator=gen, dtype=torch.float64)
    got = viewmat.clone().requires_grad_(True)
    (sh_module.sh_colors(means, sh0, shN, got, radii, degree).double() * weights).sum().backward()
    want = viewmat.double().requires_grad_(True)
    (_TorchShKernel._colours(means, sh0, shN, want, radii, degree) * weights).sum().backward()
    assert float(want.grad.abs().max()) > 1e-3
    torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-4)
    # without a camera gradient wanted, the Function gets no centre (the kernel's path as before)
    plain = sh_module.sh_colors(means, sh0, shN, viewmat, radii, degree)
    assert not plain.requires_grad


@pytest.mark.parametrize("then", ["eager", "captured"])
def test_a_checkpoint_of_captured_steps_resumes_exactly_on_either_path(demo_scene, tmp_path, then):
    """Eight steps on the captured step's path, a checkpoint, eight more on either path: the
    uninterrupted eager run's poses and scene, bit for bit (pose_refine_start inside the first half)."""
    flag = torch.zeros(1, dtype=torch.int32)
    whole = _cpu_trainer(demo_scene, tmp_path / "whole")
    for step in range(16):
        whole.train_step(step)
    first = _cpu_trainer(demo_scene, tmp_path / "first")
    for step in range(8):
        captured_step_eagerly(first, step, flag)
    first.step = 8
    saved = copy.deepcopy(first.state_dict())
    second = _cpu_trainer(demo_scene, tmp_path / "second")
    second.load_state_dict(saved)
    for step in range(8, 16):
        if then == "eager":
            second.train_step(step)
        else:
            captured_step_eagerly(second, step, flag)
    assert float(whole.pose_refiner.delta.detach().abs().max()) > 1e-4
    for x, y in zip(_state(whole.pose_refiner), _state(second.pose_refiner), strict=True):
        assert torch.equal(x, y)
    for key in whole.params:
        assert torch.equal(whole.params[key], second.params[key]), key


class _TorchProjectionKernel:
    """The canvas projection's two entry points in float64 torch (render/projection.py), for the
    CPU: what the autograd Function around them does is under test, not the kernel."""

    @staticmethod
    def _project(means, quats, scales, viewmat, K, size):
        from gstrain.render.projection import project_gaussians

        width, height = (int(x) for x in size)
        return project_gaussians(means.double(), quats.double(), scales.double(), viewmat.double(), K.double(),
                                 width, height)  # fmt: skip

    def project_fwd(self, means, quats, scales, viewmat, K, size, eps2d, near, far, compensate):
        out = self._project(means, quats, scales, viewmat, K, size)
        return (out.radii[None], out.means2d[None].float(), out.depths[None].float(), out.conics[None].float(),
                torch.zeros(0))  # fmt: skip

    def project_bwd(self, means, quats, scales, viewmat, K, size, eps2d, radii, conics, v_means2d, v_depths,
                    v_conics, compensations, v_compensations):  # fmt: skip
        inputs = [t.detach().double().requires_grad_(True) for t in (means, quats, scales)]
        with torch.enable_grad():
            out = self._project(*inputs, viewmat, K, size)
            outputs = (out.means2d, out.depths, out.conics)
            cotangents = (v_means2d[0].double(), v_depths[0].double(), v_conics[0].double())
            grads = torch.autograd.grad(outputs, inputs, cotangents)
        return tuple(g.float() for g in grads)


def test_the_canvas_projection_gives_viewmat_its_rigid_gradient(monkeypatch):
    from gstrain.render import sized_projection
    from gstrain.render.projection import project_gaussians

    monkeypatch.setattr(sized_projection.extensions, "raster", lambda: _TorchProjectionKernel())
    gen = torch.Generator().manual_seed(4)
    n = 200
    means = torch.randn(n, 3, generator=gen)
    quats, scales = torch.randn(n, 4, generator=gen), torch.rand(n, 3, generator=gen) * 0.3
    viewmat = correction_matrices(torch.randn(1, 6, generator=gen) * 0.3, 1.0, torch.tensor([2.0]))[0]
    viewmat[:3, 3] += torch.tensor([0.2, -0.1, 5.0])
    K = torch.tensor([[60.0, 0, 32], [0, 60, 30], [0, 0, 1]])
    size = torch.tensor([64, 60], dtype=torch.int32)
    weights = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((n, 2), (n,), (n, 3))]
    got = viewmat.clone().requires_grad_(True)
    _, means2d, depths, conics = sized_projection.project_sized(means, quats, scales, got, K, size)
    sum((t[0].double() * w).sum() for t, w in zip((means2d, depths, conics), weights, strict=True)).backward()
    want = viewmat.double().requires_grad_(True)
    ref = project_gaussians(means.double(), quats.double(), scales.double(), want, K.double(), 64, 60)
    sum((t * w).sum() for t, w in zip((ref.means2d, ref.depths, ref.conics), weights, strict=True)).backward()
    assert float(want.grad.abs().max()) > 1e-2
    for k in range(6):
        xi = torch.zeros(6, dtype=torch.float64)
        xi[k] = 1.0
        motion = _hat(xi) @ viewmat.double()
        expected = float((want.grad * motion).sum())
        assert float((got.grad.double() * motion).sum()) == pytest.approx(expected, rel=1e-4, abs=1e-4), k
