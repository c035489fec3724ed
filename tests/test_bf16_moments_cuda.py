"""optim.moments=bf16 on the GPU: the fused Adam kernel (csrc/step_ops.cu) stores the same
bfloat16 moments as the CPU path (gstrain/train/bf16_moments.adam_step), bit for bit, with its
parameters within float tolerance; in a CUDA graph the rounding hash's step count comes from the
device scalars (a frozen count would repeat one step's noise); and the graph engine trains with
bf16 moments as the eager steps do. Run by bench/gpu_tests.sh."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.graph_cases import graph_trainer
from gstrain.config import OptimConfig
from gstrain.data.colmap import load_scene
from gstrain.train import bf16_moments as bm
from gstrain.train.optim import build_optimizers
from gstrain.train.trainer import Trainer

pytestmark = pytest.mark.cuda


def _model(n: int) -> torch.nn.ParameterDict:
    # 1001 rows: every tensor leaves a tail of a block's four-element groups
    gen = torch.Generator().manual_seed(11)
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3),
              "shN": (n, 15, 3)}  # fmt: skip
    return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()})


def _grads(params: torch.nn.ParameterDict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + seed)
    out = {}
    for k, p in params.items():
        g = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-6, 3, p.shape, generator=gen)
        g.view(-1)[:5] = torch.tensor([0.0, -0.0, 1e-40, 3e38, -3e38])  # zeros, a subnormal, huge squares
        out[k] = g
    return out


def _moments(opts: dict, params: torch.nn.ParameterDict) -> dict[tuple[str, str], torch.Tensor]:
    return {(k, key): opts[k].state[p][key].cpu() for k, p in params.items() for key in bm.MOMENT_KEYS}


def _same_moments(a: dict, b: dict) -> None:
    for where, m in a.items():
        assert m.dtype == b[where].dtype == torch.bfloat16, where
        # bit for bit (view as int16: NaN bits compare too)
        assert torch.equal(m.view(torch.int16), b[where].view(torch.int16)), where


def _close_params(ours: torch.nn.ParameterDict, ref: torch.nn.ParameterDict) -> None:
    for k in ours:
        x, y = ours[k].detach().cpu(), ref[k].detach().cpu()
        assert torch.isfinite(x).all() == torch.isfinite(y).all(), k
        finite = torch.isfinite(y)
        assert torch.allclose(x[finite], y[finite], rtol=1e-5, atol=1e-6), k


def test_kernel_moments_equal_the_cpu_path_bit_for_bit():
    from gstrain.train.fused_adam import FusedAdam

    cpu = _model(1001)
    gpu = torch.nn.ParameterDict({k: torch.nn.Parameter(p.detach().cuda()) for k, p in cpu.items()})
    cfg = OptimConfig(moments="bf16")
    cpu_opts, gpu_opts = build_optimizers(cpu, cfg, 2.0), build_optimizers(gpu, cfg, 2.0)
    fused = FusedAdam()
    for step in range(6):
        for opts in (cpu_opts, gpu_opts):  # a schedule: the rate changes between steps
            opts["means"].param_groups[0]["lr"] *= 0.9
        grads = _grads(cpu, step)
        for k in cpu:
            cpu[k].grad, gpu[k].grad = grads[k].clone(), grads[k].cuda()
        bm.adam_step(cpu_opts)
        fused.step(gpu_opts)
    for k in gpu:
        assert gpu[k].grad is None and float(gpu_opts[k].state[gpu[k]]["step"]) == 6
    _same_moments(_moments(gpu_opts, gpu), _moments(cpu_opts, cpu))
    _close_params(gpu, cpu)


def test_graph_replays_read_the_step_count_from_the_device():
    from gstrain.train import fused_adam

    base = _model(1001)
    cfg = OptimConfig(moments="bf16")
    graphed = torch.nn.ParameterDict({k: torch.nn.Parameter(p.detach().cuda()) for k, p in base.items()})
    eager = copy.deepcopy(graphed)
    g_opts, e_opts = build_optimizers(graphed, cfg, 2.0), build_optimizers(eager, cfg, 2.0)
    fused = fused_adam.FusedAdam()
    static = {k: torch.zeros_like(p) for k, p in graphed.items()}  # the graph's gradient inputs
    scalars = torch.zeros(fused_adam.graph_scalars(len(g_opts)) + 1, device="cuda")  # + a tag, as the engine
    skip = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    for k, p in graphed.items():
        p.grad = static[k]
    with torch.cuda.graph(graph):
        fused.step(g_opts, scalars=scalars, skip=skip)
    for step in range(5):
        grads = _grads(base, step)
        for k in graphed:
            static[k].copy_(grads[k])
            eager[k].grad = grads[k].cuda()
        scalars[:-1] = torch.tensor(fused_adam.advance(g_opts) + fused_adam.step_counts(g_opts))
        graph.replay()
        fused.step(e_opts)
    torch.cuda.synchronize()
    for k in graphed:
        assert float(g_opts[k].state[graphed[k]]["step"]) == float(e_opts[k].state[eager[k]]["step"]) == 5
    _same_moments(_moments(g_opts, graphed), _moments(e_opts, eager))
    _close_params(graphed, eager)


def _trainer(scene, root, graphs: bool) -> Trainer:
    # the engine tests' trainer: atomic mode warp, since ARC's tuning rounds (the default mode) run
    # eagerly and would leave a thirty-step run without a capture
    return graph_trainer(scene, root, "g" if graphs else "e", graphs=graphs, optim={"moments": "bf16"})


def test_graph_engine_trains_with_bf16_moments_as_eager_steps(demo_scene, tmp_path):
    """Thirty steps with refinements and a reset between replays, graphs on and off, from the same
    start: the same model within the tolerance of the float32 engine test (test_graph_cuda.py;
    float atomics part the runs a little), moments bfloat16 throughout."""
    from gstrain.train.trainer import seed_everything

    scene = load_scene(demo_scene)
    seed_everything(0)
    graphed = _trainer(scene, tmp_path, True)
    seed_everything(0)
    eager = _trainer(scene, tmp_path, False)
    assert graphed.graphs is not None and eager.graphs is None
    for step in range(30):
        for run in (graphed, eager):
            torch.cuda.manual_seed(1000 + step)
            run.step = step
            run.train_step(step)
    graphed.graphs.settle()
    assert graphed.graphs.captures >= 3 and graphed.graphs.views >= 15, graphed.graphs.summary()
    for run in (graphed, eager):
        assert bm.stored_dtype(run.optimizers) == torch.bfloat16
        for k, p in run.params.items():
            assert torch.isfinite(p).all(), k
            for key in bm.MOMENT_KEYS:
                assert run.optimizers[k].state[p][key].shape == p.shape
    assert len(graphed.params["means"]) == len(eager.params["means"])
    for k in graphed.params:
        x, y = graphed.params[k].detach(), eager.params[k].detach()
        scale = float(y.abs().max().clamp_min(1e-12))
        rows = (x - y).abs().reshape(len(x), -1).amax(1) / scale
        assert int((rows >= 1e-4).sum()) <= 0.01 * len(rows) and float(rows.max()) < 1e-2, k
        q = eager.optimizers[k].param_groups[0]["params"][0]
        p = graphed.optimizers[k].param_groups[0]["params"][0]
        assert float(graphed.optimizers[k].state[p]["step"]) == float(eager.optimizers[k].state[q]["step"])
