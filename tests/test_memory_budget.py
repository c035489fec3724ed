"""train.max_memory_gib's arithmetic: bytes per Gaussian, the largest count, the growth gate.

Known answers are worked out by hand in the comments; the layout count is also checked against the
bytes a real parameter set, its gradients, Adam's moments and DefaultStrategy's statistics hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gstrain.errors import UserError
from gstrain.model import init_gaussians
from gstrain.train.memory_budget import (
    GrowthGate,
    bytes_per_gaussian,
    param_floats,
    per_gaussian_breakdown,
    plan_budget,
    resident_bytes_per_gaussian,
)

GIB = 2**30


def test_param_floats_by_sh_degree() -> None:
    # means 3 + scales 3 + quats 4 + opacities 1 + sh0 3 = 14, plus shN 3 * ((d + 1)^2 - 1)
    assert [param_floats(d) for d in range(4)] == [14, 14 + 9, 14 + 24, 14 + 45]


def test_bytes_per_gaussian_known_answer() -> None:
    # SH 3: 59 floats x 4 copies x 4 B = 944, + grad2d and count 8, + the step's buffers: saved
    # projection outputs 15 x 4 = 60, their gradients 9 x 4 = 36, backward intermediates 7 x 4 = 28,
    # + 4 pairs x 24 B = 96 -> 1172
    assert bytes_per_gaussian(3) == 1172
    assert bytes_per_gaussian(3, absgrad=True) == 1172 + 8
    assert bytes_per_gaussian(3, strategy="mcmc") == 1172 - 8
    # SH 0: 14 x 16 = 224 + 8 + 124 + 96
    assert bytes_per_gaussian(0) == 452
    # the CUDA-graph engine's pool holds a second step's gradients (236) and buffers (124) with
    # pair buffers of 1.5 x 4 pairs x 24 B = 144: 1172 + 504
    assert bytes_per_gaussian(3, graph_pair_margin=1.5) == 1676
    with pytest.raises(ValueError):
        bytes_per_gaussian(3, strategy="nope")


def test_breakdown_rows() -> None:
    rows = per_gaussian_breakdown(3, graph_pair_margin=1.5)
    assert rows == {
        "parameter means": 12, "parameter scales": 12, "parameter quats": 16, "parameter opacities": 4,
        "parameter sh0": 12, "parameter shN": 180, "gradients": 236, "Adam moments": 472,
        "strategy statistics": 8, "step: projection outputs": 60, "step: their gradients": 36,
        "step: backward intermediates": 28, "step: tile pairs": 96,
        "graph pool: a step's gradients and buffers": 504,
    }  # fmt: skip
    assert "graph pool: a step's gradients and buffers" not in per_gaussian_breakdown(3)
    # measured figures replace the estimates: 2.5 pairs -> 60 B, one step row
    assert per_gaussian_breakdown(0, step_bytes={"all": 100}, pairs_per_gaussian=2.5)["step: tile pairs"] == 60
    assert bytes_per_gaussian(0, step_bytes={"all": 100}, pairs_per_gaussian=2.5) == 224 + 8 + 100 + 60


def test_graph_engine_plans_its_pool_where_masked_views_keep_it() -> None:
    from types import SimpleNamespace

    from gstrain.config import build_config
    from gstrain.train.graph_step import CAPACITY_MARGIN, graphs_planned, held_pool_margin
    from gstrain.train.memory_budget import budget_gate

    cfg = build_config(overrides=[{"train": {"max_memory_gib": 1.0}}])
    ours = SimpleNamespace(backend="cuda", options=SimpleNamespace(ellipse_cull=True))
    assert graphs_planned(cfg, ours, torch.device("cuda"))
    assert not graphs_planned(cfg, ours, torch.device("cpu"))
    assert not graphs_planned(cfg, SimpleNamespace(backend="gsplat", options=ours.options), torch.device("cuda"))
    no_graphs = build_config(overrides=[{"dev": {"cuda_graphs": False}}])
    assert not graphs_planned(no_graphs, ours, torch.device("cuda"))
    # the graphs' pool is kept beside eager steps only for masked views (the engine drops it for
    # refinements, timed steps and ARC rounds)
    assert held_pool_margin(cfg, ours, torch.device("cuda"), [None, None]) == 0.0
    assert held_pool_margin(cfg, ours, torch.device("cuda"), [None, object()]) == CAPACITY_MARGIN == 1.5
    assert held_pool_margin(cfg, ours, torch.device("cpu"), [None, object()]) == 0.0
    gate = budget_gate(cfg, 0, [(10, 10, 3)], lambda _m: None, graph_pair_margin=CAPACITY_MARGIN)
    assert gate.budget.per_gaussian == 1676  # the known answer above


def test_layout_count_matches_real_tensors() -> None:
    n = 40
    rng = np.random.default_rng(0)
    params = init_gaussians(rng.normal(size=(n, 3)).astype(np.float32),
                            rng.integers(0, 255, (n, 3)).astype(np.uint8), sh_degree=3)
    optimizer = torch.optim.Adam(list(params.values()), lr=1e-3)
    sum(p.square().sum() for p in params.values()).backward()
    optimizer.step()
    stats = [torch.zeros(n), torch.zeros(n)]  # DefaultStrategy's grad2d and count
    tensors = [*params.values(), *(p.grad for p in params.values())]
    tensors += [t for s in optimizer.state.values() for t in s.values()] + stats
    measured = resident_bytes_per_gaussian(tensors, n)
    assert measured == bytes_per_gaussian(3, step_bytes={}, pairs_per_gaussian=0) == (59 * 4 + 2) * 4


def test_largest_count_known_answers() -> None:
    assert plan_budget(0, 1000, 0, 0) is None  # no budget
    # 1 GiB counted at 90%: int(0.9 * 2^30) = 966367641 B; nothing fixed -> 966367 Gaussians of 1000 B
    assert plan_budget(1, 1000, 0, 0).max_gaussians == 966_367
    # 100 MiB of images on the GPU and one 1000 x 1000 view at 64 B a pixel:
    # 966367641 - 104857600 - 64000000 = 797510041 -> 797510
    budget = plan_budget(1, 1000, 100 * 2**20, 1_000_000)
    assert budget.fixed_bytes == 104_857_600 + 64_000_000 and budget.max_gaussians == 797_510
    # a batch of 4 views: 256 MB of pixel buffers -> 966367641 - 256000000 = 710367641 -> 710367
    assert plan_budget(1, 1000, 0, 1_000_000, views_per_step=4).max_gaussians == 710_367
    # 24 GiB at SH 3 with nothing fixed: 0.9 * 24 * 2^30 = 23192823398 B; // 1172 = 19789098
    # (1172 x 19789098 = 23192822856, 542 B short of the next)
    assert plan_budget(24, 1172, 0, 0).max_gaussians == 19_789_098


def test_budget_too_small_for_the_fixed_costs() -> None:
    with pytest.raises(UserError, match="leaves no room for Gaussians.*images_on=host"):
        plan_budget(1, 1000, GIB, 0)


def test_gate_says_once() -> None:
    said: list[str] = []
    gate = GrowthGate(plan_budget(1, 1000, 0, 0), log=said.append)
    assert gate.limit == 966_367
    assert gate.may_grow_to(966_367) and said == []
    assert not gate.may_grow_to(966_368)
    assert not gate.may_grow_to(2_000_000)
    assert len(said) == 1 and "stops growing at 966,367 Gaussians" in said[0]
    gate.check_start(900_000)
    with pytest.raises(UserError, match="1,000,000 initial Gaussians do not fit"):
        gate.check_start(1_000_000)


def test_gate_lowers_a_cap_once() -> None:
    said: list[str] = []
    gate = GrowthGate(plan_budget(1, 1000, 0, 0), log=said.append)
    assert gate.cap_for(500_000) == 500_000 and said == []
    assert gate.cap_for(3_000_000) == 966_367
    assert gate.cap_for(3_000_000) == 966_367
    assert len(said) == 1 and "strategy.cap_max 3,000,000 lowered to 966,367" in said[0]


def test_no_budget_allows_everything() -> None:
    said: list[str] = []
    gate = GrowthGate(None, log=said.append)
    assert gate.may_grow_to(10**12) and gate.cap_for(10**9) == 10**9 and gate.limit is None
    gate.check_start(10**9)
    assert said == []


def test_gate_refuses_growth_the_measured_peak_has_no_room_for() -> None:
    """On a GPU the gate also weighs the allocator's measured peak: peak + the new Gaussians'
    bytes must stay within the counted budget (1 GiB x 0.9 here), even below the arithmetic count."""
    said: list[str] = []
    gate = GrowthGate(plan_budget(1, 1000, 0, 0), log=said.append)
    usable = int(0.9 * 2**30)
    assert gate.may_grow_to(1_000, adding=100, peak_bytes=usable - 100 * 1000)  # exactly full: fits
    assert not gate.may_grow_to(1_000, adding=100, peak_bytes=usable - 100 * 1000 + 1)
    assert not gate.may_grow_to(1_000, adding=100, peak_bytes=usable)
    assert len(said) == 1 and "stops growing at 900 Gaussians (the measured peak" in said[0]


@pytest.mark.cuda
def test_measured_numbers_on_cuda() -> None:
    from gstrain.config import build_config
    from gstrain.train.memory_budget import budget_free, measured_peak

    device = torch.device("cuda")
    block = torch.empty(2**20, dtype=torch.uint8, device=device)
    assert measured_peak(device) >= block.numel()
    assert measured_peak(torch.device("cpu")) is None
    cfg = build_config(overrides=[{"train": {"max_memory_gib": 0.5}}])
    assert budget_free(cfg, device) == min(torch.cuda.mem_get_info(device)[0], 2**29)
    assert budget_free(build_config(), device) is None and budget_free(cfg, torch.device("cpu")) is None


def test_shn_stepped_in_the_backward_leaves_its_gradient_out_of_the_peak() -> None:
    from gstrain.config import build_config
    from gstrain.train.memory_budget import per_gaussian_breakdown, shn_stepped_in_backward

    plain = per_gaussian_breakdown(3)
    inside = per_gaussian_breakdown(3, shn_in_backward=True)
    assert plain["gradients"] == 59 * 4 and inside["gradients"] == 14 * 4  # 45 shN floats of 59 at degree 3
    assert {k: v for k, v in plain.items() if k != "gradients"} == {k: v for k, v in inside.items() if k != "gradients"}
    cfg = build_config()
    assert shn_stepped_in_backward(cfg, gpu=True) and not shn_stepped_in_backward(cfg, gpu=False)
    for override in ({"dev": {"adam_in_backward": False}}, {"dev": {"fused_sh": False}}, {"train": {"batch_size": 2}},
                     {"dev": {"fused_adam": False}}, {"render": {"backend": "gsplat"}}):
        assert not shn_stepped_in_backward(build_config(overrides=[override]), gpu=True), override
