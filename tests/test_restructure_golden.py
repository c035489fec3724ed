"""Behaviour unchanged by the issue-15 restructure: a CPU demo run matches the code before it bit for bit.

The reference is commit 37732cb, before the restructure: its `gstrain/` and `configs/` are taken
from git history and run here, on the same machine, in a subprocess, and the current tree's
run must give the same six parameter tensors after 200 CPU steps of configs/demo.yaml on the
generated demo scene (16 views, 64x64, seed 0). Same machine matters: PyTorch's CPU kernels sum in
an order that depends on the CPU (AVX2 against AVX512 diverged at refinement, 1,791 against 1,747
Gaussians, and two AVX512 machines gave 1,747 and 1,786), so a stored result holds only where it
was made. Without the history (a shallow clone), the test falls back to the stored files,
tests/data/restructure_golden_step200{,_avx2}.pt (made at 37732cb at AVX512 and on an AVX2-only
EPYC), by CPU capability. The run is shortened and its schedules squeezed so that 200 steps cover
random initialisation (1500 points), densification (refines at steps 100 and 150), one opacity
reset (step 150) and a raised SH degree (step 100). Any change to the numbers of the training path
on the CPU shows up here.

Regenerate a stored file only on purpose: OMP_NUM_THREADS=1 python tests/test_restructure_golden.py
(writes the current CPU capability's file); `--tree DIR --out FILE` runs DIR's code instead and
writes its parameters to FILE (what the test does with 37732cb's tree).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
REFERENCE_COMMIT = "37732cb"  # the last commit before the issue-15 restructure
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


def golden_run(tmp: Path, repo: Path = REPO) -> dict[str, torch.Tensor]:
    """Train `repo`'s demo config for 200 steps on the CPU (with whichever gstrain imports); the
    final parameters."""
    from gstrain.config import build_config
    from gstrain.data.colmap import load_scene
    from gstrain.data.demo import write_demo_scene
    from gstrain.train.trainer import Trainer

    write_demo_scene(tmp / "scene", n_views=16, width=64, height=64, seed=0)
    cfg = build_config([repo / "configs" / "demo.yaml"], [OVERRIDES])
    scene = load_scene(tmp / "scene", factor=cfg.data.factor, test_every=cfg.data.test_every)
    run_dir = tmp / "run"
    run_dir.mkdir()
    trainer = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None)
    result = trainer.fit()
    assert result.status == "done" and result.step == 200
    return {k: v.detach().cpu().clone() for k, v in trainer.params.items()}


def reference_run(tmp: Path) -> dict[str, torch.Tensor] | None:
    """REFERENCE_COMMIT's parameters from the same run on this machine, its code taken from git;
    None where the history does not hold it."""
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{REFERENCE_COMMIT}^{{commit}}"],
                           capture_output=True)  # fmt: skip
    if found.returncode != 0:
        return None
    tree, out = tmp / "reference", tmp / "reference.pt"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", REFERENCE_COMMIT, "gstrain", "configs"],
                             capture_output=True, check=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    # the old tree's gstrain first on the path, ahead of the installed (current) one
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, __file__, "--tree", str(tree), "--out", str(out)], env=env, check=True,
                   capture_output=True, cwd=tmp)  # fmt: skip
    return torch.load(out, map_location="cpu")


@pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1",
                    reason="bit-identical CPU sums need one thread (run with OMP_NUM_THREADS=1)")
def test_demo_run_matches_the_code_before_the_restructure(tmp_path):
    golden = reference_run(tmp_path)
    if golden is None:  # no history: the stored run for this CPU capability
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in GOLDENS:
            pytest.skip(f"no git history of {REFERENCE_COMMIT} and no stored run at CPU capability {capability}")
        golden = torch.load(GOLDENS[capability], map_location="cpu")
    params = golden_run(tmp_path)
    assert sorted(params) == sorted(golden)
    for name, expected in golden.items():
        assert params[name].shape == expected.shape, name
        assert torch.equal(params[name], expected), name


if __name__ == "__main__":
    import argparse
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, default=None, help="run this tree's code (it must be first on PYTHONPATH)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        params = golden_run(Path(tmp), args.tree or REPO)
    out = args.out or GOLDENS[torch.backends.cpu.get_cpu_capability()]
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(params, out)
    print({k: tuple(v.shape) for k, v in params.items()}, out.stat().st_size, "bytes")
