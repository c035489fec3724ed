"""optim.moments=int8 on the GPU: the fused Adam's 8-bit kernel (csrc/step_ops.cu,
adam_rows8_kernel) stores the same codes and scales as the CPU path
(gstrain/train/int8_moments.step_tensor), bit for bit, with its parameters within float
tolerance, and the bfloat16 tensors beside it those of bf16_moments; in a CUDA graph the rounding
hash's step count and the step sizes come from the device scalars; and the graph engine trains
with int8 moments as the eager steps do. Run by bench/gpu_tests.sh."""

from __future__ import annotations

import copy

import pytest
import torch
from test_graph_cuda import assert_rows_follow, row_spread

from bench.graph_cases import graph_trainer
from gstrain.config import OptimConfig
from gstrain.data.colmap import load_scene
from gstrain.train import int8_moments as im
from gstrain.train import moment_modes
from gstrain.train.optim import build_optimizers
from gstrain.train.trainer import Trainer

pytestmark = pytest.mark.cuda


def _model(n: int) -> torch.nn.ParameterDict:
    # 1001 rows: the 16-bit tensors leave a tail of a block's four-element groups, and shN's 1001
    # rows of 45 need the last block's warps only partly
    gen = torch.Generator().manual_seed(12)
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3),
              "shN": (n, 15, 3)}  # fmt: skip
    return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()})


def _grads(params: torch.nn.ParameterDict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + seed)
    out = {}
    for k, p in params.items():
        g = torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-6, 3, p.shape, generator=gen)
        # zeros, a subnormal, huge squares (an infinite v: a saturated scale), and a row of zeros
        g.view(-1)[:5] = torch.tensor([0.0, -0.0, 1e-40, 3e38, -3e38])
        g[7] = 0.0
        out[k] = g
    return out


def _states(opts: dict, params: torch.nn.ParameterDict) -> dict[tuple[str, str], torch.Tensor]:
    return {(k, key): v.cpu() for k, p in params.items() for key, v in opts[k].state[p].items() if key != "step"}


def _same_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for where, x in a.items():
        y = b[where]
        assert x.dtype == y.dtype and x.shape == y.shape, where
        if x.dtype == torch.bfloat16:  # bit for bit (as int16: NaN bits compare too)
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), where
        else:
            assert torch.equal(x, y), where
    assert a[("shN", "exp_avg")].dtype == torch.int8 and a[("shN", "exp_avg_sq")].dtype == torch.uint8


def _close_params(ours: torch.nn.ParameterDict, ref: torch.nn.ParameterDict) -> None:
    for k in ours:
        x, y = ours[k].detach().cpu(), ref[k].detach().cpu()
        assert torch.equal(torch.isfinite(x), torch.isfinite(y)), k
        finite = torch.isfinite(y)
        assert torch.allclose(x[finite], y[finite], rtol=1e-5, atol=1e-6), k


def test_kernel_codes_equal_the_cpu_path_bit_for_bit():
    from gstrain.train.fused_adam import FusedAdam

    cpu = _model(1001)
    gpu = torch.nn.ParameterDict({k: torch.nn.Parameter(p.detach().cuda()) for k, p in cpu.items()})
    cfg = OptimConfig(moments="int8")
    cpu_opts, gpu_opts = build_optimizers(cpu, cfg, 2.0), build_optimizers(gpu, cfg, 2.0)
    fused = FusedAdam()
    for step in range(6):
        for opts in (cpu_opts, gpu_opts):  # a schedule: the rate changes between steps
            opts["shN"].param_groups[0]["lr"] *= 0.9
        grads = _grads(cpu, step)
        for k in cpu:
            cpu[k].grad, gpu[k].grad = grads[k].clone(), grads[k].cuda()
        moment_modes.adam_step(cpu_opts)
        fused.step(gpu_opts)
    for k in gpu:
        assert gpu[k].grad is None and float(gpu_opts[k].state[gpu[k]]["step"]) == 6
    assert im.has_codes(gpu_opts["shN"].state[gpu["shN"]])
    _same_states(_states(gpu_opts, gpu), _states(cpu_opts, cpu))
    _close_params(gpu, cpu)


def test_graph_replays_read_the_step_count_and_sizes_from_the_device():
    from gstrain.train import fused_adam

    base = _model(1001)
    cfg = OptimConfig(moments="int8")
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
    skip.fill_(1)  # a skipped replay changes nothing
    kept = {k: p.detach().clone() for k, p in graphed.items()}
    kept_states = _states(g_opts, graphed)
    graph.replay()
    torch.cuda.synchronize()
    for k in graphed:
        assert torch.equal(graphed[k], kept[k]), k
        assert float(g_opts[k].state[graphed[k]]["step"]) == float(e_opts[k].state[eager[k]]["step"]) == 5
    _same_states(_states(g_opts, graphed), kept_states)
    _same_states(_states(g_opts, graphed), _states(e_opts, eager))
    _close_params(graphed, eager)


def _trainer(scene, root, graphs: bool, name: str | None = None) -> Trainer:
    # the engine tests' trainer (atomic mode warp: ARC's tuning rounds run eagerly); the SH degree
    # rises every 5 steps so that shN has gradients, and 8-bit moments to step, within 30 steps
    return graph_trainer(scene, root, name or ("g" if graphs else "e"), graphs=graphs, optim={"moments": "int8"},
                         train={"sh_degree_interval": 5})  # fmt: skip


def test_graph_engine_trains_with_int8_moments_as_eager_steps(demo_scene, tmp_path):
    """Thirty steps with refinements and a reset between replays, graphs on and off, from the same
    start, the int8 layout throughout. Float atomics in the backward part two runs a little, and an
    8-bit code that rounds the other way moves a row by up to 1/127 of its scale: so the graph run
    is held to what a second eager run from the same start differs by (3x, with the float32
    engine test's tolerance as the floor), not to a fixed bound, with a few rows allowed one first
    Adam step's sign more (test_graph_cuda.assert_rows_follow)."""
    from gstrain.train.trainer import seed_everything

    scene = load_scene(demo_scene)
    runs = {}
    for name, graphs in (("graph", True), ("eager", False), ("again", False)):
        seed_everything(0)
        runs[name] = _trainer(scene, tmp_path, graphs, name)
    graphed, eager, again = runs["graph"], runs["eager"], runs["again"]
    assert graphed.graphs is not None and eager.graphs is None and again.graphs is None
    for step in range(30):
        for run in runs.values():
            torch.cuda.manual_seed(1000 + step)
            run.step = step
            run.train_step(step)
    graphed.graphs.settle()
    assert graphed.graphs.captures >= 3 and graphed.graphs.views >= 15, graphed.graphs.summary()
    for run in runs.values():
        for k, p in run.params.items():
            assert torch.isfinite(p).all(), k
            state = run.optimizers[k].state[p]
            assert {key: v.dtype for key, v in state.items() if key != "step"} == im.layout_dtypes(k, p), k
            for key, value in state.items():
                if key != "step":
                    assert value.shape[0] == p.shape[0], (k, key)
        assert run.optimizers["shN"].state[run.params["shN"]]["exp_avg_scale"].any()  # shN was stepped
    assert len(graphed.params["means"]) == len(eager.params["means"]) == len(again.params["means"])
    for k in graphed.params:
        assert_rows_follow(k, graphed.params[k].detach(), eager.params[k].detach(), again.params[k].detach(),
                           float(eager.optimizers[k].param_groups[0]["lr"]))  # fmt: skip
        rows = row_spread(graphed.params[k].detach(), eager.params[k].detach())
        noise = row_spread(again.params[k].detach(), eager.params[k].detach())
        assert int((rows >= 1e-4).sum()) <= max(0.01 * len(rows), 3 * int((noise >= 1e-4).sum())), k
        q = eager.optimizers[k].param_groups[0]["params"][0]
        p = graphed.optimizers[k].param_groups[0]["params"][0]
        assert float(graphed.optimizers[k].state[p]["step"]) == float(eager.optimizers[k].state[q]["step"])
