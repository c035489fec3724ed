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
    plan_budget,
    resident_bytes_per_gaussian,
)

GIB = 2**30


def test_param_floats_by_sh_degree() -> None:
    # means 3 + scales 3 + quats 4 + opacities 1 + sh0 3 = 14, plus shN 3 * ((d + 1)^2 - 1)
    assert [param_floats(d) for d in range(4)] == [14, 14 + 9, 14 + 24, 14 + 45]


def test_bytes_per_gaussian_known_answer() -> None:
    # SH 3: 59 floats x 4 copies = 236, + grad2d and count 2, + 19 step floats = 257 floats = 1028 B,
    # + 4 pairs x 24 B = 96 B -> 1124
    assert bytes_per_gaussian(3) == 1124
    assert bytes_per_gaussian(3, absgrad=True) == 1124 + 8
    assert bytes_per_gaussian(3, strategy="mcmc") == 1124 - 8
    # SH 0: 14 x 4 + 2 + 19 = 77 floats = 308 B, + 96
    assert bytes_per_gaussian(0) == 404
    with pytest.raises(ValueError):
        bytes_per_gaussian(3, strategy="nope")


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
    assert measured == bytes_per_gaussian(3, step_floats=0, pairs_per_gaussian=0) == (59 * 4 + 2) * 4


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
    # 24 GiB at SH 3 with nothing fixed: 0.9 * 24 * 2^30 = 23192823398 B; // 1124 = 20634184
    # (1124 x 20634184 = 23192822816, 582 B short of the next)
    assert plan_budget(24, 1124, 0, 0).max_gaussians == 20_634_184


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
