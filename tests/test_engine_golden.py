"""Behaviour unchanged: CPU demo runs give bit-identical parameters at step 200, against stored
tensors (no git history needed).

Three runs of configs/demo.yaml on the generated demo scene (16 views, 64x64, seed 0), shortened
and with their schedules squeezed so that 200 steps cover random initialisation (1500 points),
densification (refines at steps 100 and 150), one opacity reset (step 150) and a raised SH degree
(step 100):
- `single`: one process, one view a step (the plain step);
- `batch2`: one process, train.batch_size=2 (the batch step);
- `dist2`:  two gloo ranks (gstrain/distributed/local.py), train.batch_size=2 (the sharded step); the
            ranks' shards concatenated in rank order.
Any change to the numbers of these training paths on the CPU shows up here.

The stored tensors were made at commit 321a0ea, before the one-engine refactor (issue 34). PyTorch's
CPU kernels sum in an order that depends on the vector instructions they dispatch to (AVX2
against AVX512 diverged at refinement, and two AVX512 machines of other CPU models did too), so
there is one file per capability, tests/data/engine_golden_<capability>.pt, and it names the CPU
model it was made on; a machine without a file for its capability, or of another CPU model, skips
(regenerate there at the reference commit). Regenerate only on purpose, from the code whose
behaviour is the reference:

    OMP_NUM_THREADS=1 python tests/test_engine_golden.py --regenerate
    OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2 python tests/test_engine_golden.py --regenerate

(ATEN_CPU_CAPABILITY makes an AVX512 machine dispatch as an AVX2-only one would.)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data"
RUNS = ("single", "batch2", "dist2")
OVERRIDES = {
    "train": {"steps": 200, "sh_degree_interval": 100, "device": "cpu"},
    "model": {"init": "random", "init_points": 1500},  # a small population keeps the stored file small
    "strategy": {"refine_start": 50, "refine_every": 50, "reset_every": 150, "grow_grad2d": 1.0e-4},
    "log": {"progress_every": 25, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0},
}


def golden_file(capability: str | None = None) -> Path:
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return DATA / f"engine_golden_{capability.lower()}.pt"


def cpu_model() -> str:
    """The CPU's model name (Linux), which the stored sums hold for; "unknown" elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _config(batch_size: int):
    from gstrain.config import build_config

    over = {k: dict(v) for k, v in OVERRIDES.items()}
    over["train"]["batch_size"] = batch_size
    return build_config([Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"], [over])


def _scene(root: Path) -> Path:
    from gstrain.data.demo import write_demo_scene

    scene = root / "scene"
    if not scene.exists():
        write_demo_scene(scene, n_views=16, width=64, height=64, seed=0)
    return scene


def plain_run(root: Path, batch_size: int) -> dict[str, torch.Tensor]:
    """One process trains the demo config for 200 CPU steps; its final parameters."""
    from gstrain.data.colmap import load_scene
    from gstrain.train.trainer import Trainer

    cfg = _config(batch_size)
    scene = load_scene(_scene(root), factor=cfg.data.factor, test_every=cfg.data.test_every)
    run_dir = root / f"run_b{batch_size}"
    run_dir.mkdir()
    trainer = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None)
    result = trainer.fit()
    assert result.status == "done" and result.step == 200
    return {k: v.detach().cpu().clone() for k, v in trainer.params.items()}


def _rank_run(rank: int, world: int, scene: str, run: str) -> dict[str, torch.Tensor]:
    from gstrain.data.colmap import load_scene
    from gstrain.distributed.trainer import DistTrainer

    cfg = _config(2)
    data = load_scene(Path(scene), factor=cfg.data.factor, test_every=cfg.data.test_every)
    trainer = DistTrainer(cfg, data, Path(run), torch.device("cpu"), log=lambda m: None)
    result = trainer.fit()
    assert result.status == "done" and result.step == 200
    return {k: v.detach().cpu().clone() for k, v in trainer.params.items()}


def dist_run(root: Path) -> dict[str, torch.Tensor]:
    """Two gloo ranks, batch 2, 200 steps; the shards concatenated in rank order."""
    from gstrain.distributed.local import run_local

    scene = _scene(root)
    (root / "run_dist").mkdir()
    shards = run_local(_rank_run, 2, str(scene), str(root / "run_dist"), timeout=300)
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def make_run(name: str, root: Path) -> dict[str, torch.Tensor]:
    if name == "single":
        return plain_run(root, 1)
    if name == "batch2":
        return plain_run(root, 2)
    return dist_run(root)


def _expected(name: str) -> dict[str, torch.Tensor]:
    path = golden_file()
    if not path.exists():
        pytest.skip(f"no stored run for CPU capability {torch.backends.cpu.get_cpu_capability()} ({path.name})")
    stored = torch.load(path, map_location="cpu")
    if stored["cpu"] != cpu_model():
        pytest.skip(f"{path.name} was made on {stored['cpu']!r}, this CPU is {cpu_model()!r}: CPU sums may differ")
    return stored[name]


@pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1",
                    reason="bit-identical CPU sums need one thread (run with OMP_NUM_THREADS=1)")
@pytest.mark.parametrize("name", RUNS)
@pytest.mark.slow
def test_demo_run_is_bit_identical_to_the_stored_one(name, tmp_path):
    expected = _expected(name)
    got = make_run(name, tmp_path)
    assert sorted(got) == sorted(expected)
    assert len(expected["means"]) != 1500  # densification ran: the comparison covers it
    for key, value in expected.items():
        assert got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regenerate", action="store_true", help="run the three runs and overwrite the stored file")
    args = ap.parse_args()
    if not args.regenerate:
        ap.error("pass --regenerate to overwrite the stored runs")
    torch.set_num_threads(1)
    runs: dict = {"cpu": cpu_model()}
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            root = Path(tmp) / name
            root.mkdir()
            runs[name] = make_run(name, root)
    out = golden_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(runs, out)
    print({n: len(runs[n]["means"]) for n in RUNS}, "Gaussians;", out, out.stat().st_size, "bytes")
