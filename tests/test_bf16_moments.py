"""optim.moments=bf16 (gstrain/train/bf16_moments.py) on the CPU: stochastic rounding against
known answers (unbiased, neighbouring values, special values, the hash against plain Python
integers), why it is needed (a constant gradient's exp_avg_sq against its float64 closed form,
round-to-nearest stalling), the Adam step against torch's Adam in float64, training, strategy
operations, checkpoints and the memory accounting. The CUDA kernel's bit-for-bit equality with
this path is tests/test_bf16_moments_cuda.py."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli
from gsplat.strategy.ops import duplicate
from moments_util import moments_trainer

from gstrain.config import OptimConfig, build_config
from gstrain.data.colmap import load_scene
from gstrain.train import bf16_moments as bm
from gstrain.train import moment_modes
from gstrain.train.memory_budget import (
    PIXEL_BYTES,
    USABLE_SHARE,
    budget_gate,
    bytes_per_gaussian,
    per_gaussian_breakdown,
)
from gstrain.train.optim import build_optimizers

B1, B2 = 0.9, 0.999


def _bf16_neighbours(x: float) -> tuple[float, float]:
    """The bfloat16 values at or below and above |x| (sign kept), from x's float32 bits: the
    upper 16 bits truncated, and one bfloat16 step further from zero."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    lo_bits = bits & 0xFFFF0000
    lo = struct.unpack("<f", struct.pack("<I", lo_bits))[0]
    hi = struct.unpack("<f", struct.pack("<I", lo_bits + 0x10000))[0]
    return lo, hi


def test_hash_of_tensors_is_the_hash_of_python_integers():
    # the int64 tensor form against the same arithmetic on Python's unbounded integers, masked
    # to 32 bits after each multiply as a uint32 multiply in CUDA wraps
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) % 2**32
        x ^= x >> 15
        x = (x * 0x1B873593) % 2**32
        return x ^ (x >> 16)

    seed = bm.step_seed(12345, bm.moment_salt("shN", "exp_avg_sq"))
    assert seed == reference(bm.moment_salt("shN", "exp_avg_sq") ^ reference(12345))
    noise = bm.rounding_noise(3000, seed)
    assert noise.tolist() == [reference(i ^ seed) >> 16 for i in range(3000)]
    big = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    assert bm.mix32(big).tolist() == [reference(v) for v in big.tolist()]
    # different salts per tensor and moment, different steps: different noise
    assert len({bm.moment_salt(n, k) for n in ("means", "shN") for k in bm.MOMENT_KEYS}) == 4
    assert not torch.equal(bm.rounding_noise(100, bm.step_seed(1, 7)), bm.rounding_noise(100, bm.step_seed(2, 7)))


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, generator=gen) * torch.logspace(-20, 20, 64)).float()
    x[:4] = torch.tensor([1.0, -2.5, 1.0 + 2**-9, -(1.0 + 3 * 2**-9)])  # exact, exact, 1/4 and 3/4 up (a step is 2^-7)
    steps = 2000
    rounded = torch.stack([bm.stochastic_round_bf16(x, bm.step_seed(t, 99)).double() for t in range(1, steps + 1)])
    for j, value in enumerate(x.tolist()):
        lo, hi = _bf16_neighbours(value)
        got = set(rounded[:, j].tolist())
        assert got <= {lo, hi}, (value, got, lo, hi)
        if lo == value:  # representable: never moved
            assert got == {value}
            continue
        # each rounding is hi with probability p = (x - lo) / (hi - lo): mean x, variance
        # (hi - x)(x - lo); the mean of `steps` independent ones lies within 5 standard errors
        sd = math.sqrt(abs((hi - value) * (value - lo)) / steps)
        assert abs(rounded[:, j].mean().item() - value) <= 5 * sd, (value, rounded[:, j].mean().item(), sd)
    p = [(rounded[:, j] != _bf16_neighbours(x[j].item())[0]).double().mean().item() for j in (2, 3)]
    assert p[0] == pytest.approx(0.25, abs=0.05) and p[1] == pytest.approx(0.75, abs=0.05)


def test_special_values():
    big = float(np.float32(3.4028234663852886e38))  # float32's largest: above bfloat16's largest
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, big, -big, 1e-40, -1e-40])
    bf16_max = 3.3895313892515355e38
    for t in range(1, 50):
        r = bm.stochastic_round_bf16(x, bm.step_seed(t, 3))
        assert r.dtype == torch.bfloat16 and r.shape == x.shape
        v = r.double().tolist()
        assert v[:4] == [0.0, 0.0, math.inf, -math.inf] and math.copysign(1, v[1]) == -1
        assert math.isnan(v[4])
        assert v[5:7] == [bf16_max, -bf16_max]  # finite stays finite
        assert v[7] in _bf16_neighbours(1e-40) and v[8] in _bf16_neighbours(-1e-40)  # subnormals


def _constant_gradient_moments(g: torch.Tensor, steps: int) -> torch.Tensor:
    """exp_avg_sq after `steps` bf16 Adam steps with gradient g every step (rate 0)."""
    p = torch.nn.Parameter(torch.zeros_like(g))
    opts = {"p": torch.optim.Adam([{"params": p, "lr": 0.0, "name": "p"}], betas=(B1, B2), eps=1e-15)}
    bm.init_optimizer_state(opts, torch.bfloat16)
    for _ in range(steps):
        p.grad = g.clone()
        bm.adam_step(opts)
    return opts["p"].state[p]["exp_avg_sq"]


def test_constant_gradient_exp_avg_sq_follows_the_closed_form_and_nearest_stalls():
    gen = torch.Generator().manual_seed(1)
    g = torch.exp(torch.randn(2000, generator=gen)).float()  # magnitudes over a few octaves
    steps = 2000
    v = _constant_gradient_moments(g, steps).double()
    exact = (1.0 - B2**steps) * g.double() ** 2  # v_t = (1 - b2^t) g^2 from v_0 = 0
    rel = v / exact - 1.0
    assert v.dtype == torch.float64 and abs(rel.mean().item()) < 0.01, rel.mean().item()
    assert rel.abs().max().item() < 0.15, rel.abs().max().item()
    # bfloat16 storage rounded to nearest, computed here: the update (1 - b2)(g^2 - v) falls below
    # half a bfloat16 step long before v reaches its value, and v stops there
    nearest = torch.zeros_like(g, dtype=torch.bfloat16)
    for _ in range(steps):
        nearest = (nearest.float() * B2 + (g * g) * (1 - B2)).to(torch.bfloat16)
    stalled = nearest.double() / exact - 1.0
    assert stalled.mean().item() < -0.3, stalled.mean().item()


def _random_model(seed: int) -> torch.nn.ParameterDict:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"means": (300, 3), "opacities": (300,), "shN": (300, 15, 3)}
    return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()})


def test_bf16_step_equals_torch_adam_up_to_the_moment_rounding():
    ours = _random_model(2)
    ref = torch.nn.ParameterDict({k: torch.nn.Parameter(v.detach().double()) for k, v in ours.items()})
    lrs = {"means": 0.01, "opacities": 0.05, "shN": 1e-3}
    opts = {k: torch.optim.Adam([{"params": p, "lr": lrs[k], "name": k}], betas=(B1, B2), eps=1e-15)
            for k, p in ours.items()}  # fmt: skip
    ref_opts = {k: torch.optim.Adam([p], lr=lrs[k], betas=(B1, B2), eps=1e-15) for k, p in ref.items()}
    bm.init_optimizer_state(opts, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    steps = 6
    for _ in range(steps):
        for k in ours:
            g = torch.randn(ours[k].shape, generator=gen)
            ours[k].grad, ref[k].grad = g.clone(), g.double()
        bm.adam_step(opts)
        for opt in ref_opts.values():
            opt.step()
    for k in ours:
        state, ref_state = opts[k].state[ours[k]], ref_opts[k].state[ref[k]]
        assert float(state["step"]) == steps and ours[k].grad is None
        for key in bm.MOMENT_KEYS:
            assert state[key].dtype == torch.bfloat16
            err = (state[key].double() - ref_state[key]).norm() / ref_state[key].norm()
            # one rounding is off by at most a bfloat16 step (2^-8 to 2^-7 of the value), about 0.4 of
            # one in the mean square; the steps' errors add up, v's over its growing sum: under 2^-7
            assert err < 2**-7, (k, key, err.item())
        # each step moves a parameter by about lr (Adam's normalised update): off by the moments'
        # relative rounding at most, summed over the steps
        diff = (ours[k].detach().double() - ref[k].detach()).abs().max().item()
        assert 0 < diff <= steps * lrs[k] * 0.05, (k, diff)


def test_moments_take_half_the_bytes_and_the_budget_counts_them():
    params = _random_model(4)
    nbytes = {}
    for mode in ("fp32", "bf16"):
        opts = build_optimizers(params, OptimConfig(moments=mode), 1.0)
        if mode == "fp32":  # torch makes its state at the first step
            for p in params.values():
                p.grad = torch.zeros_like(p)
            for opt in opts.values():
                opt.step()
        nbytes[mode] = sum(m.numel() * m.element_size() for m in bm.moments_of(opts))
    floats = sum(p.numel() for p in params.values())
    assert nbytes == {"fp32": 2 * 4 * floats, "bf16": 2 * 2 * floats}
    # 59 floats a Gaussian at SH degree 3: two moments of 4 bytes each, or of 2
    assert per_gaussian_breakdown(3)["Adam moments"] == 472
    assert per_gaussian_breakdown(3, moments="bf16")["Adam moments"] == 236
    assert bytes_per_gaussian(3) - bytes_per_gaussian(3, moments="bf16") == 236
    # train.max_memory_gib's cap follows: the same budget holds more Gaussians
    limits = {}
    for mode in ("fp32", "bf16"):
        cfg = build_config(overrides=[{"train": {"max_memory_gib": 2.0}, "optim": {"moments": mode}}])
        gate = budget_gate(cfg, 0, [(64, 64, 3)], lambda _m: None)
        limits[mode] = (gate.limit, gate.budget.per_gaussian)
    assert limits["fp32"][1] - limits["bf16"][1] == 236
    usable = int(2.0 * 2**30 * USABLE_SHARE) - 64 * 64 * PIXEL_BYTES
    assert limits == {m: (usable // per, per) for m, (_, per) in limits.items()}


def test_gsplat_ops_promote_and_keep_dtype_casts_back_exactly():
    params = _random_model(5)
    opts = build_optimizers(params, OptimConfig(moments="bf16"), 1.0)
    for opt in opts.values():
        state = opt.state[opt.param_groups[0]["params"][0]]
        state["exp_avg"] = torch.randn(state["exp_avg"].shape).to(torch.bfloat16)
    before = {k: opts[k].state[p]["exp_avg"].clone() for k, p in params.items()}
    duplicate(params, opts, {}, torch.tensor([0, 7]))
    assert bm.stored_dtype(opts) == torch.float32  # gsplat concatenates float32 zeros
    assert bm.keep_dtype(opts, torch.bfloat16) == 6
    for k, p in params.items():
        m = opts[k].state[p]["exp_avg"]
        assert m.dtype == torch.bfloat16 and m.shape == p.shape
        assert torch.equal(m[:300], before[k]) and not m[300:].any()


# -------------------------------------------------------------------- training on the demo scene
@pytest.fixture(scope="module")
def scene(demo_scene):
    return load_scene(demo_scene)


_trainer = moments_trainer


def _moments_ok(trainer) -> None:
    for name, opt in trainer.optimizers.items():
        p = opt.param_groups[0]["params"][0]
        assert p is trainer.params[name]
        for key in bm.MOMENT_KEYS:
            m = opt.state[p][key]
            assert m.dtype == torch.bfloat16 and m.shape == p.shape, (name, key, m.dtype)


@pytest.mark.parametrize("strategy", ["default", "mcmc"])
def test_strategy_operations_keep_bf16_moments(scene, tmp_path, strategy):
    extra = {"cap_max": 2 * len(scene.points)} if strategy == "mcmc" else {"grow_grad2d": 1e-9}
    trainer = _trainer(scene, tmp_path / strategy, "bf16", steps=14, strategy={"name": strategy, **extra})
    start = len(trainer.params["means"])
    assert trainer.fit().status == "done"
    assert len(trainer.params["means"]) != start  # grown (or pruned): the state was rewritten
    _moments_ok(trainer)


def test_resume_continues_exactly_and_checkpoints_keep_bf16(scene, tmp_path):
    whole = _trainer(scene, tmp_path / "whole", "bf16")
    assert whole.fit().status == "done"
    paused = _trainer(scene, tmp_path / "paused", "bf16", stop_at=12)
    assert paused.fit().status == "stopped"
    saved = torch.load(paused.save(wait=True), weights_only=False)
    assert moment_modes.saved_mode(saved["optimizers"]) == "bf16"
    resumed = _trainer(scene, tmp_path / "paused", "bf16")
    assert resumed.fit(resume=True).status == "done" and resumed.step == whole.step == 24
    assert not any("converted" in line for line in resumed.lines)
    _moments_ok(resumed)
    for k in whole.params:
        assert torch.equal(whole.params[k], resumed.params[k]), k
        for key in bm.MOMENT_KEYS:
            a = whole.optimizers[k].state[whole.params[k]][key]
            assert torch.equal(a, resumed.optimizers[k].state[resumed.params[k]][key]), (k, key)


def test_resume_in_the_other_mode_converts_and_says_so(scene, tmp_path):
    paused = _trainer(scene, tmp_path / "run", "fp32", stop_at=6)
    assert paused.fit().status == "stopped"
    # (torch makes a state at a tensor's first gradient: none yet for shN, whose band starts later)
    fp32 = {k: paused.optimizers[k].state[p]["exp_avg_sq"].clone() for k, p in paused.params.items() if k != "shN"}
    assert all(m.dtype == torch.float32 for m in fp32.values()) and len(fp32) == 5
    to_bf16 = _trainer(scene, tmp_path / "run", "bf16", stop_at=6)
    to_bf16.fit(resume=True)
    assert [line for line in to_bf16.lines if "moments" in line] == [
        "gstrain: the checkpoint's Adam moments are fp32; converted to optim.moments=bf16"]
    _moments_ok(to_bf16)  # shN's state made in bfloat16, as a bf16 run has it from the start
    assert float(to_bf16.optimizers["shN"].state[to_bf16.params["shN"]]["step"]) == 0
    for k, p in to_bf16.params.items():  # rounded to nearest
        if k == "shN":
            continue
        assert torch.equal(to_bf16.optimizers[k].state[p]["exp_avg_sq"], fp32[k].to(torch.bfloat16)), k
    to_bf16.save(wait=True)
    back = _trainer(scene, tmp_path / "run", "fp32", stop_at=6)
    back.fit(resume=True)
    assert "gstrain: the checkpoint's Adam moments are bf16; converted to optim.moments=fp32" in back.lines
    assert bm.stored_dtype(back.optimizers) == torch.float32


def test_bf16_moments_train_as_well_as_fp32(scene, tmp_path):
    psnr = {}
    for mode in ("fp32", "bf16"):
        # no densification: cheaper, and both runs keep the same Gaussians
        trainer = _trainer(scene, tmp_path / mode, mode, steps=100, strategy={"refine_start": 10**9},
                           model={"sh_degree": 0}, eval_steps=(0,))  # fmt: skip
        result = trainer.fit()
        assert result.status == "done"
        psnr[mode] = result.final_test_psnr
    _moments_ok(trainer)
    assert psnr["fp32"] > result.initial_test_psnr + 3.0  # it learned something to compare
    assert abs(psnr["bf16"] - psnr["fp32"]) < 0.3, psnr


def test_bad_values_are_one_line(demo_scene, tmp_path):
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "a", "--set", "optim.moments=fp8")
    assert_one_error(code, err, "optim.moments must be one of fp32, bf16, int8; got 'fp8'")
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "b", "--set", "optim.moments=bf16",
                         "--set", "optim.sparse_adam=true")  # fmt: skip
    assert_one_error(code, err, "optim.moments=bf16 needs optim.sparse_adam=false")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_graph_scalars_hold_the_step_counts_after_the_pairs():
    """A graph step's device scalars: advance()'s pairs, then step_counts() (the counts the
    kernel's rounding hash reads in a replay), here after two counted steps."""
    from gstrain.train import fused_adam

    params = _random_model(7)
    opts = build_optimizers(params, OptimConfig(moments="bf16"), 1.0)
    fused_adam.advance(opts)
    pairs = fused_adam.advance(opts)
    counts = fused_adam.step_counts(opts)
    assert len(pairs) + len(counts) == fused_adam.graph_scalars(len(opts)) == 9
    assert counts == [2.0, 2.0, 2.0]
    # means first: rate means_lr x extent 1, torch's bias corrections at step 2
    assert pairs[:2] == pytest.approx([1.6e-4 / (1 - 0.9**2), 1 / math.sqrt(1 - 0.999**2)], rel=1e-12)
