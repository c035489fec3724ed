"""Behaviour unchanged by the issue-15 restructure: a CPU demo run matches golden parameters bit for bit.

tests/data/restructure_golden_step200.pt holds the six parameter tensors after 200 CPU steps of
configs/demo.yaml on the generated demo scene (16 views, 64x64, seed 0), written by this file's
`__main__` at commit 37732cb, before the restructure, on a CPU where torch's kernels ran at
AVX512. PyTorch's vectorised CPU kernels sum in a different order at AVX2, and the run diverges
(1,791 Gaussians at the end instead of 1,747), so restructure_golden_step200_avx2.pt holds the
same run made at 37732cb on an AVX2-only CPU (AMD EPYC, 2026-12-02). The test compares against
the file of the CPU capability it runs at and skips where it has none. The run is shortened and its schedules
squeezed so that 200 steps cover random initialisation (1500 points, to keep the file small),
densification (refines at steps 100 and 150), one opacity reset (step 150) and a raised SH
degree (step 100). Any change to the numbers of the training path on the CPU shows up here.

Regenerate only on purpose: OMP_NUM_THREADS=1 python tests/test_restructure_golden.py (writes the
current CPU capability's file)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
GOLDENS = {  # torch.backends.cpu.get_cpu_capability() -> the golden file made at that capability
    "AVX512": REPO / "tests" / "data" / "restructure_golden_step200.pt",
    "AVX2": REPO / "tests" / "data" / "restructure_golden_step200_avx2.pt",
}
OVERRIDES = {
    "train": {"steps": 200, "sh_degree_interval": 100, "device": "cpu"},
    "model": {"init": "random", "init_points": 1500},  # a small population keeps the golden file small
    "strategy": {"refine_start": 50, "refine_every": 50, "reset_every": 150, "grow_grad2d": 1.0e-4},
    "log": {"progress_every": 25, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0},
}


def golden_run(tmp: Path) -> dict[str, torch.Tensor]:
    """Train the demo config for 200 steps on the CPU; the final parameters."""
    from gstrain.config import build_config
    from gstrain.data.colmap import load_scene
    from gstrain.data.demo import write_demo_scene
    from gstrain.train.trainer import Trainer

    write_demo_scene(tmp / "scene", n_views=16, width=64, height=64, seed=0)
    cfg = build_config([REPO / "configs" / "demo.yaml"], [OVERRIDES])
    scene = load_scene(tmp / "scene", factor=cfg.data.factor, test_every=cfg.data.test_every)
    run_dir = tmp / "run"
    run_dir.mkdir()
    trainer = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None)
    result = trainer.fit()
    assert result.status == "done" and result.step == 200
    return {k: v.detach().cpu().clone() for k, v in trainer.params.items()}


@pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1",
                    reason="bit-identical CPU sums need one thread (run with OMP_NUM_THREADS=1)")
def test_demo_run_matches_golden_parameters(tmp_path):
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in GOLDENS:
        pytest.skip(f"no golden parameters recorded at CPU capability {capability}")
    golden = torch.load(GOLDENS[capability], map_location="cpu")
    params = golden_run(tmp_path)
    assert sorted(params) == sorted(golden)
    for name, expected in golden.items():
        assert params[name].shape == expected.shape, name
        assert torch.equal(params[name], expected), name


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        params = golden_run(Path(tmp))
    out = GOLDENS[torch.backends.cpu.get_cpu_capability()]
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(params, out)
    print({k: tuple(v.shape) for k, v in params.items()}, out.stat().st_size, "bytes")
