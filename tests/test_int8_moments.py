"""optim.moments=int8 (gstrain/train/int8_moments.py) on the CPU: the row codes against known
answers (scales, nearest codes, a plain-Python reference of the stochastic rounding, its bias
over many roundings), the Adam step against torch's Adam in float64 within bounds derived from
the code steps, a constant gradient's v against its closed form, the denominator guard, the
bytes of the layout, gsplat's strategy operations, checkpoints, conversions and training on the
demo scene. The CUDA kernel's bit-for-bit equality with this path is tests/test_int8_moments_cuda.py."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli
from gsplat.strategy.ops import duplicate, remove
from moments_util import moments_trainer

from gstrain.config import OptimConfig, build_config
from gstrain.data.colmap import load_scene
from gstrain.train import bf16_moments as bm
from gstrain.train import int8_moments as im
from gstrain.train import moment_modes
from gstrain.train.memory_budget import budget_gate, per_gaussian_breakdown
from gstrain.train.optim import build_optimizers

B1, B2 = 0.9, 0.999
BF16_MAX = 3.3895313892515355e38


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _next_bf16_up(x: float) -> float:
    """The smallest bfloat16 >= float32 x > 0, from its bits: truncate to the upper 16 bits and
    step one bfloat16 up if anything was cut."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    lo = bits & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", lo if lo == bits else lo + 0x10000))[0]


def test_scale_rounds_up_to_the_next_bfloat16():
    f32_max = float(np.finfo(np.float32).max)
    x = torch.tensor([0.0, 1.0, 1.0 + 2**-20, 1.5, 3.0e38, 1e-40, f32_max, math.inf, math.nan])
    got = im.scale_up_bf16(x)
    assert got.dtype == torch.bfloat16
    v = got.double().tolist()
    assert v[:4] == [0.0, 1.0, 1.0 + 2**-7, 1.5]
    assert v[4] == _next_bf16_up(_f32(3.0e38)) >= 3.0e38
    assert v[5] == math.ceil(_f32(1e-40) / 2**-133) * 2**-133  # bfloat16 subnormals are 2^-133 apart
    assert v[6:8] == [BF16_MAX, BF16_MAX]  # saturates: finite scales only
    assert math.isnan(v[8])


def test_nearest_codes_known_answers():
    x = torch.tensor([[127.0, -63.5, 0.0, 2.25], [0.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.0, -0.125]])
    codes, scale = im.quantise_rows(x, 127, None)
    assert scale.double().tolist() == [1.0, 0.0, _next_bf16_up(_f32(0.5 / 127))]
    assert codes[0].tolist() == [127, -63, 0, 2]  # floor(y + 1/2): -63.5 goes up
    assert codes[1].tolist() == [0, 0, 0, 0]
    s = scale[2].double().item()
    assert codes[2].tolist() == [math.floor(v / s + 0.5) for v in (0.5, 0.25, 0.0, -0.125)]
    # sqrt(v) rows (unsigned, 255 codes) to nearest in the squares: 2.5^2 lies below the midpoint
    # of 2^2 and 3^2 (6.5), so 2.5 -> 2; 2.6^2 = 6.76 -> 3
    codes, scale = im.quantise_rows(torch.tensor([[255.0, 2.5, 2.6, 0.0]]), 255, None, squares=True)
    assert scale.tolist() == [1.0] and codes.tolist() == [[255, 2, 3, 0]]


def _reference_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x1B873593) % 2**32
    return x ^ (x >> 16)


def test_stochastic_codes_follow_a_plain_python_reference():
    """The codes from float32 arithmetic on numpy scalars and the hash on Python integers: the
    definition the CUDA kernel implements."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=gen) * torch.tensor([[1e-6], [1.0], [1e4]])
    seed = bm.step_seed(17, bm.moment_salt("shN", "exp_avg_sq"))
    for squares, levels in ((False, 127), (True, 255)):
        rows = x.abs() if squares else x
        codes, scale = im.quantise_rows(rows, levels, seed, squares=squares)
        for i in range(3):
            s = np.float32(scale[i].float().item())
            for j in range(40):
                e = i * 40 + j
                u = np.float32((_reference_mix32(e ^ seed) >> 16) / 65536.0)
                y = np.float32(rows[i, j].item()) / s
                if squares:
                    lo = np.floor(y)
                    f = (y * y - lo * lo) / (np.float32(2) * lo + np.float32(1))
                    want = lo + (np.float32(1) if u < f else np.float32(0))
                else:
                    want = np.floor(y + u)
                want = min(max(int(want), -levels), levels)
                assert codes[i, j].item() == want, (squares, i, j)


def test_codes_are_neighbours_within_a_step_and_unbiased():
    gen = torch.Generator().manual_seed(1)
    decades = 10.0 ** torch.arange(-12, 4, dtype=torch.float32)[:, None]  # a row per decade
    x = torch.randn(16, 48, generator=gen) * decades
    x[:, 0] = decades[:, 0] * 3.0  # each row's largest, known
    draws = 1500
    for squares, levels in ((False, 127), (True, 255)):
        rows = x.abs() if squares else x
        largest = rows.abs().amax(1).double()
        got = []
        for t in range(1, draws + 1):
            codes, scale = im.quantise_rows(rows, levels, bm.step_seed(t, 5), squares=squares)
            got.append(codes.double())
        s = scale.double()[:, None]  # the scale depends on the row only, not the noise
        # the scale: the largest over the code range, rounded up to a bfloat16 (at most 2^-7 above)
        assert (s[:, 0] >= largest / levels).all() and (s[:, 0] <= largest / levels * (1 + 2**-7)).all()
        codes = torch.stack(got)
        y = rows.double() / s
        lo = torch.floor(y)
        # every code one of the two neighbours of x / scale: off by less than one scale
        assert ((codes == lo) | (codes == lo + 1)).all()
        assert ((codes * s - rows.double()).abs() < s).all()
        assert codes.abs().max() <= levels
        # unbiased: in x (linear codes), in x^2 (sqrt(v) codes); p = the chance of lo + 1, and
        # the mean of `draws` independent roundings lies within 5 standard errors
        p = (y * y - lo * lo) / (2 * lo + 1) if squares else y - lo
        target = y * y if squares else y
        sample = codes * codes if squares else codes
        step = 2 * lo + 1 if squares else torch.ones_like(lo)
        se = (p * (1 - p)).sqrt() * step / math.sqrt(draws)
        assert ((sample.mean(0) - target).abs() <= 5 * se + 1e-9).all(), squares


def _shn_model(rows: int, seed: int, scale: torch.Tensor | None = None) -> torch.nn.ParameterDict:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"means": (rows, 3), "opacities": (rows,), "shN": (rows, 15, 3)}
    return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()})


def _decoded(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """m and sqrt(v) of an 8-bit state, float64 rows."""
    m = im.dequantise_rows(state["exp_avg"], state["exp_avg_scale"]).double()
    r = im.dequantise_rows(state["exp_avg_sq"], state["exp_avg_sq_scale"]).double()
    return m, r


def test_int8_step_against_torch_adam_in_float64_within_the_code_steps():
    """Six steps of gradients |g| in [0.8, 1.2] x a factor per row (rows over five decades, random
    signs). Bounds from the code steps: the stored m is off by e_t <= b1 e_(t-1) + one code step
    (1.01 x the row's largest |m| / 127), sqrt(v) by e_t <= e_(t-1) + one step (/255: the map
    r_t = sqrt(b2 r^2 + c) contracts); a parameter step by step_size (|dm| + |d sqrt(v_hat)|) /
    sqrt(v_hat), sqrt(v_hat) >= 0.8 x the row factor (an average of g^2). The 16-bit tensors are
    bf16 mode's, bit for bit."""
    ours, same_bf16 = _shn_model(200, 2), _shn_model(200, 2)
    ref = torch.nn.ParameterDict({k: torch.nn.Parameter(v.detach().double()) for k, v in ours.items()})
    lr = 1e-3
    opts = build_optimizers(ours, OptimConfig(moments="int8", shN_lr=lr), 1.0)
    bf16_opts = build_optimizers(same_bf16, OptimConfig(moments="bf16", shN_lr=lr), 1.0)
    ref_opt = torch.optim.Adam([ref["shN"]], lr=lr, betas=(B1, B2), eps=1e-15)
    start = ours["shN"].detach().double().clone()
    gen = torch.Generator().manual_seed(3)
    factor = 10.0 ** torch.randint(-4, 2, (200, 1, 1), generator=gen).double()
    f = factor.view(200, 1)
    err_m = err_r = err_p = torch.zeros(200, 1, dtype=torch.float64)
    steps = 6
    for t in range(1, steps + 1):
        for k in ours:
            g = torch.randn(ours[k].shape, generator=gen)
            if k == "shN":
                g = (torch.sign(g) * (0.8 + 0.4 * torch.rand(g.shape, generator=gen)) * factor).float()
            ours[k].grad, same_bf16[k].grad = g.clone(), g.clone()
        ref["shN"].grad = ours["shN"].grad.double()
        moment_modes.adam_step(opts)
        moment_modes.adam_step(bf16_opts)
        ref_opt.step()
        step_size, inv_bc2 = lr / (1 - B1**t), 1 / math.sqrt(1 - B2**t)
        dm, dr = B1 * err_m, err_r  # the new moments' errors before this step's rounding
        err_p = err_p + step_size * (dm + inv_bc2 * dr) / (0.8 * f - inv_bc2 * dr)
        state = ref_opt.state[ref["shN"]]
        m_max = state["exp_avg"].view(200, -1).abs().amax(1, keepdim=True)
        r_max = state["exp_avg_sq"].view(200, -1).sqrt().amax(1, keepdim=True)
        err_m = dm + 1.01 * (m_max + dm) / 127
        err_r = dr + 1.01 * (r_max + dr) / 255
    state = opts["shN"].state[ours["shN"]]
    assert state["exp_avg"].dtype == torch.int8 and state["exp_avg_sq"].dtype == torch.uint8
    assert float(state["step"]) == steps and ours["shN"].grad is None
    m, r = _decoded(state)
    ref_state = ref_opt.state[ref["shN"]]
    m_ref, r_ref = ref_state["exp_avg"].view(200, -1), ref_state["exp_avg_sq"].view(200, -1).sqrt()
    assert ((m - m_ref).abs() <= err_m).all() and ((r - r_ref).abs() <= err_r).all()
    assert not torch.equal(m, m_ref)  # (the codes did round)
    p, p_ref = ours["shN"].detach().double().view(200, -1), ref["shN"].detach().view(200, -1)
    assert ((p - p_ref).abs() <= err_p + 1e-6).all()
    # the bound is tighter than the movement it checks
    moved = (p_ref - start.view(200, -1)).abs().mean().item()
    assert moved > 2 * lr and err_p.max().item() < 0.2 * moved, (moved, err_p.max().item())
    for k in ("means", "opacities"):
        for key in bm.MOMENT_KEYS:
            a, b = opts[k].state[ours[k]][key], bf16_opts[k].state[same_bf16[k]][key]
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), (k, key)
        assert torch.equal(ours[k], same_bf16[k]), k


def _constant_gradient(g: torch.Tensor, steps: int, lr: float = 0.0) -> tuple[dict, torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.zeros_like(g))
    opts = {"shN": torch.optim.Adam([{"params": p, "lr": lr, "name": "shN"}], betas=(B1, B2), eps=1e-15)}
    moment_modes.init_optimizer_state(opts, "int8")
    for _ in range(steps):
        p.grad = g.clone()
        moment_modes.adam_step(opts)
    return opts["shN"].state[p], p


def test_constant_gradient_v_follows_the_closed_form():
    """v_t = (1 - b2^t) g^2 from v_0 = 0. The sqrt(v) codes round unbiased in v, so the mean over
    elements is within 1%; each element carries the EMA of its rounding noise (about 22 x one
    rounding, see the module docstring): a row's largest within 30% (3 sd)."""
    gen = torch.Generator().manual_seed(4)
    rows = 80
    g = (0.3 + 0.7 * torch.rand(rows, 15, 3, generator=gen)) * 10.0 ** torch.randint(-8, 2, (rows, 1, 1), generator=gen)
    g[:, 0, 0] = g.view(rows, -1).amax(1)  # (a row's largest twice: known largest)
    steps = 1000
    state, _ = _constant_gradient(g, steps)
    _, r = _decoded(state)
    exact = (1.0 - B2**steps) * g.double().view(rows, -1) ** 2
    rel = r * r / exact - 1.0
    assert abs(rel.mean().item()) < 0.01, rel.mean().item()
    top = g.view(rows, -1) >= 0.9 * g.view(rows, -1).amax(1, keepdim=True)
    assert rel[top].abs().max().item() < 0.3, rel[top].abs().max().item()
    # m_t = (1 - b1^t) g = g, plus the EMA of its rounding noise: at most half a code step of sd a
    # rounding, times sqrt(1 / (1 - b1^2)) = 2.3; within 5 code steps (4 sd)
    m, _ = _decoded(state)
    code_step = 1.01 * g.double().view(rows, -1).amax(1, keepdim=True) / 127
    assert ((m - g.double().view(rows, -1)).abs() <= 5 * code_step).all()


def test_a_denominator_rounded_to_zero_cannot_blow_up_the_step():
    """Rows of one gradient of 1 and 44 of about 1e-6: their m and sqrt(v) codes are mostly 0
    and now and then 1 (stochastic rounding), and an m that rounded up over a sqrt(v) that
    rounded to 0 would step thousands of rates. Guarded, no step exceeds step_size = lr / (1 -
    beta1^t), Adam's scale of a step."""
    gen = torch.Generator().manual_seed(5)
    rows, lr = 100, 1e-3
    p = torch.nn.Parameter(torch.zeros(rows, 15, 3))
    opts = {"shN": torch.optim.Adam([{"params": p, "lr": lr, "name": "shN"}], betas=(B1, B2), eps=1e-15)}
    moment_modes.init_optimizer_state(opts, "int8")
    worst = 0.0
    for t in range(1, 61):
        g = torch.sign(torch.randn(p.shape, generator=gen)) * (0.5 + torch.rand(p.shape, generator=gen)) * 1e-6
        g[:, 0, 0] = 1.0
        before = p.detach().clone()
        p.grad = g
        moment_modes.adam_step(opts)
        moved = (p.detach() - before).abs().max().item()
        worst = max(worst, moved / (lr / (1 - B1**t)))
    assert worst <= 1.0 + 1e-5, worst


def test_layout_bytes_per_gaussian_and_the_budget():
    """The state tensors of a whole model at SH degree 3 (59 floats) against the layout counted by
    hand: shN 2 x (45 codes + 2 scale bytes), the other 14 floats 2 x 2 bytes each."""
    n = 50
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3),
              "shN": (n, 15, 3)}  # fmt: skip
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros(s)) for k, s in shapes.items()})
    opts = build_optimizers(params, OptimConfig(moments="int8"), 1.0)
    nbytes = sum(v.numel() * v.element_size() for o in opts.values() for s in o.state.values()
                 for k, v in s.items() if k != "step")  # fmt: skip
    assert nbytes == n * (2 * (45 + 2) + 2 * 2 * 14) == n * 150
    shn = opts["shN"].state[params["shN"]]
    assert {k: (v.dtype, tuple(v.shape)) for k, v in shn.items() if k != "step"} == {
        "exp_avg": (torch.int8, (n, 15, 3)), "exp_avg_sq": (torch.uint8, (n, 15, 3)),
        "exp_avg_scale": (torch.bfloat16, (n,)), "exp_avg_sq_scale": (torch.bfloat16, (n,))}  # fmt: skip
    moments = {mode: per_gaussian_breakdown(3, moments=mode)["Adam moments"] for mode in ("fp32", "bf16", "int8")}
    assert moments == {"fp32": 472, "bf16": 236, "int8": 150}
    # degree 1: shN 9 wide (2 x 11); degree 0: no shN, every moment bfloat16
    assert per_gaussian_breakdown(1, moments="int8")["Adam moments"] == 2 * 11 + 4 * 14
    assert per_gaussian_breakdown(0, moments="int8")["Adam moments"] == 4 * 14
    per = {}
    for mode in ("bf16", "int8"):
        cfg = build_config(overrides=[{"train": {"max_memory_gib": 2.0}, "optim": {"moments": mode}}])
        per[mode] = budget_gate(cfg, 0, [(64, 64, 3)], lambda _m: None).budget.per_gaussian
    assert per["bf16"] - per["int8"] == 86
    # bench_train's int8-moments pipeline sets the mode, and bench/memory_per_gaussian counts it
    from bench import memory_per_gaussian as mpg

    assert mpg.moments_mode("int8-moments") == "int8" and mpg.analytic("int8-moments", 3, None)["Adam moments"] == 150


def _set_codes(opts: dict, params: torch.nn.ParameterDict, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    state = opts["shN"].state[params["shN"]]
    n = len(params["shN"])
    state["exp_avg"] = torch.randint(-127, 128, params["shN"].shape, generator=gen).to(torch.int8)
    state["exp_avg_sq"] = torch.randint(0, 256, params["shN"].shape, generator=gen).to(torch.uint8)
    for key in im.SCALE_KEYS.values():
        state[key] = torch.rand(n, generator=gen).to(torch.bfloat16) + 0.5


def test_gsplat_operations_keep_each_row_with_its_scale():
    params = _shn_model(30, 6)
    opts = build_optimizers(params, OptimConfig(moments="int8"), 1.0)
    _set_codes(opts, params, 7)
    before = _decoded(opts["shN"].state[params["shN"]])
    twice = torch.zeros(30, dtype=torch.bool)
    twice[[0, 7]] = True
    duplicate(params, opts, {}, twice)
    assert moment_modes.keep_layout(opts, "int8") == 4 + 2 * 2  # shN's four tensors, two bfloat16 moments each
    state = opts["shN"].state[params["shN"]]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == im.layout_dtypes("shN", params["shN"])
    m, r = _decoded(state)
    assert torch.equal(m[:30], before[0]) and torch.equal(r[:30], before[1]) and not m[30:].any()
    assert m.shape == (32, 45) and not r[30:].any()
    keep = torch.ones(32, dtype=torch.bool)
    keep[[3, 11, 30]] = False
    remove(params, opts, {}, ~keep)
    assert moment_modes.keep_layout(opts, "int8") == 0  # indexing keeps dtypes
    m, r = _decoded(opts["shN"].state[params["shN"]])
    rows = keep[:30].nonzero().view(-1)
    assert torch.equal(m[:-1], before[0][rows]) and torch.equal(r[:-1], before[1][rows])
    assert len(params["shN"]) == len(opts["shN"].state[params["shN"]]["exp_avg_scale"]) == 29


# -------------------------------------------------------------------- training on the demo scene
@pytest.fixture(scope="module")
def scene(demo_scene):
    return load_scene(demo_scene)


def _trainer(scene, run_dir, moments: str, steps: int = 24, strategy: dict | None = None,
             eval_steps: tuple[int, ...] = (), **train):  # fmt: skip
    """moments_trainer with the SH degree rising every 4 steps, so that shN trains early."""
    return moments_trainer(scene, run_dir, moments, steps, strategy, eval_steps=eval_steps,
                           **{"sh_degree_interval": 4, **train})


def _layout_ok(trainer) -> None:
    for name, opt in trainer.optimizers.items():
        p = opt.param_groups[0]["params"][0]
        assert p is trainer.params[name]
        state = opt.state[p]
        assert {k: v.dtype for k, v in state.items() if k != "step"} == im.layout_dtypes(name, p), name
        for key, value in state.items():
            if key != "step":
                assert value.shape == (p.shape if key in bm.MOMENT_KEYS else p.shape[:1]), (name, key)


@pytest.mark.parametrize("strategy", ["default", "mcmc"])
def test_strategy_operations_keep_the_int8_layout(scene, tmp_path, strategy):
    extra = {"cap_max": 2 * len(scene.points)} if strategy == "mcmc" else {"grow_grad2d": 1e-9}
    trainer = _trainer(scene, tmp_path / strategy, "int8", steps=14, strategy={"name": strategy, **extra})
    start = len(trainer.params["means"])
    assert trainer.fit().status == "done"
    assert len(trainer.params["means"]) != start  # grown (or pruned): the state was rewritten
    _layout_ok(trainer)
    assert im.has_codes(trainer.optimizers["shN"].state[trainer.params["shN"]])
    assert trainer.optimizers["shN"].state[trainer.params["shN"]]["exp_avg_scale"].any()  # shN was stepped


def test_resume_continues_exactly_and_checkpoints_keep_the_codes(scene, tmp_path):
    whole = _trainer(scene, tmp_path / "whole", "int8", steps=16)
    assert whole.fit().status == "done"
    paused = _trainer(scene, tmp_path / "paused", "int8", steps=16, stop_at=8)
    assert paused.fit().status == "stopped"
    saved = torch.load(paused.save(wait=True), weights_only=False)
    assert moment_modes.saved_mode(saved["optimizers"]) == "int8"
    assert saved["optimizers"]["shN"]["state"][0]["exp_avg"].dtype == torch.int8
    resumed = _trainer(scene, tmp_path / "paused", "int8", steps=16)
    assert resumed.fit(resume=True).status == "done" and resumed.step == whole.step == 16
    assert not any("converted" in line for line in resumed.lines)
    _layout_ok(resumed)
    for k in whole.params:
        assert torch.equal(whole.params[k], resumed.params[k]), k
        a, b = whole.optimizers[k].state[whole.params[k]], resumed.optimizers[k].state[resumed.params[k]]
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), k


def test_resume_in_another_mode_converts_and_says_so(scene, tmp_path):
    paused = _trainer(scene, tmp_path / "run", "int8", stop_at=8)
    assert paused.fit().status == "stopped"
    path = paused.save(wait=True)
    saved = torch.load(path, weights_only=False)["optimizers"]["shN"]["state"][0]
    m = saved["exp_avg"].double() * saved["exp_avg_scale"].double()[:, None, None]
    r = saved["exp_avg_sq"].double() * saved["exp_avg_sq_scale"].double()[:, None, None]
    to_fp32 = _trainer(scene, tmp_path / "run", "fp32", stop_at=8)
    to_fp32.fit(resume=True)
    assert [line for line in to_fp32.lines if "moments" in line] == [
        "gstrain: the checkpoint's Adam moments are int8; converted to optim.moments=fp32"]
    state = to_fp32.optimizers["shN"].state[to_fp32.params["shN"]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # the scales dropped
    assert torch.equal(state["exp_avg"], m.float()) and torch.equal(state["exp_avg_sq"], (r * r).float())
    to_fp32.save(wait=True)
    back = _trainer(scene, tmp_path / "run", "int8", stop_at=8)
    back.fit(resume=True)
    assert "gstrain: the checkpoint's Adam moments are fp32; converted to optim.moments=int8" in back.lines
    _layout_ok(back)
    # to nearest: the decoded moments within half a code step of the float32 ones (in v's squares for sqrt(v))
    m2, r2 = _decoded(back.optimizers["shN"].state[back.params["shN"]])
    s_m = back.optimizers["shN"].state[back.params["shN"]]["exp_avg_scale"].double()[:, None]
    assert ((m2 - m.view(len(m), -1)).abs() <= s_m / 2 * (1 + 1e-6)).all()
    s_r = back.optimizers["shN"].state[back.params["shN"]]["exp_avg_sq_scale"].double()[:, None]
    assert ((r2 - r.view(len(r), -1)).abs() <= s_r * (1 + 1e-6)).all()
    back.save(wait=True)
    to_bf16 = _trainer(scene, tmp_path / "run", "bf16", stop_at=8)
    to_bf16.fit(resume=True)
    assert "gstrain: the checkpoint's Adam moments are int8; converted to optim.moments=bf16" in to_bf16.lines
    assert bm.stored_dtype(to_bf16.optimizers) == torch.bfloat16
    assert not im.has_codes(to_bf16.optimizers["shN"].state[to_bf16.params["shN"]])


def test_int8_moments_train_as_well_as_fp32(scene, tmp_path):
    psnr = {}
    for mode in ("fp32", "int8"):
        # no densification: cheaper, and both runs keep the same Gaussians; shN trains from step 10
        trainer = _trainer(scene, tmp_path / mode, mode, steps=50, strategy={"refine_start": 10**9},
                           sh_degree_interval=10, eval_steps=(0,))  # fmt: skip
        result = trainer.fit()
        assert result.status == "done"
        psnr[mode] = result.final_test_psnr
    _layout_ok(trainer)
    assert psnr["fp32"] > result.initial_test_psnr + 3.0  # it learned something to compare
    print("test PSNR after 50 steps", psnr)
    assert abs(psnr["int8"] - psnr["fp32"]) < 0.3, psnr


def test_sparse_adam_is_refused_in_one_line(demo_scene, tmp_path):
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "b", "--set", "optim.moments=int8",
                         "--set", "optim.sparse_adam=true")  # fmt: skip
    assert_one_error(code, err, "optim.moments=int8 needs optim.sparse_adam=false")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_fused_adam_sends_narrow_moments_off_its_kernel_to_the_torch_op_step(mode):
    """A tensor FusedAdam cannot take (here: on the CPU) with bf16 or 8-bit moments takes
    moment_modes.adam_step (bf16_moments' and int8_moments' torch-op steps), never torch's Adam
    (which cannot step such state)."""
    from gstrain.train.fused_adam import FusedAdam

    fused = FusedAdam.__new__(FusedAdam)  # no extension: nothing here reaches the kernel
    fused.ext = None
    a, b = _shn_model(40, 8), _shn_model(40, 8)
    opts_a = build_optimizers(a, OptimConfig(moments=mode), 1.0)
    opts_b = build_optimizers(b, OptimConfig(moments=mode), 1.0)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for k in a:
            a[k].grad = torch.randn(a[k].shape, generator=gen)
            b[k].grad = a[k].grad.clone()
        fused.step(opts_a)
        moment_modes.adam_step(opts_b)
    for k in a:
        assert torch.equal(a[k], b[k]) and a[k].grad is None, k
        sa, sb = opts_a[k].state[a[k]], opts_b[k].state[b[k]]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa), k
        assert sa["exp_avg"].dtype != torch.float32, k  # the narrow mode, not torch's Adam state
