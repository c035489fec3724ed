"""bench.dist_memory: its config, table, memory probe and initial model (no processes here; the
dry run is `python -m bench.dist_memory --device cpu --n 3000 --world 1,2 --steps 3`)."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import dist_memory
from gstrain.config import build_config
from gstrain.model import init_gaussians


def test_overrides_fix_the_model_and_scale_the_batch():
    cfg = build_config(None, dist_memory.run_overrides(5000, 4, 2, 7, "random", 3, ["model.sh_degree=1"]))
    assert cfg.model.init == "random" and cfg.model.init_points == 5000 and cfg.model.sh_degree == 1
    assert cfg.strategy.refine_stop == 0  # no densification: the count stays N
    assert cfg.train.batch_size == 8 and cfg.train.steps == 7 and cfg.dist.partition == "random"
    assert cfg.log.eval_steps == [] and cfg.log.save_steps == [] and cfg.log.ckpt_every == 0


def _rank(rank: int, owned: int, peak: int | None) -> dict:
    return {"rank": rank, "owned": owned, "params_bytes": owned * 10, "adam_bytes": owned * 20,
            "resident_after_setup": 100, "setup_peak": 150, "steps_peak": peak, "total_peak": peak,
            "steps_seconds": 1.0, "comm_bytes_per_step": 0.0}  # fmt: skip


def test_table_reports_the_largest_rank_against_one_process():
    one = dist_memory.summarise(1, 1000, [_rank(0, 1000, 8_000_000)])
    two = dist_memory.summarise(2, 1000, [_rank(1, 700, 6_000_000), _rank(0, 300, 2_000_000)])
    other = {**one, "partition": "random", "steps_peak": [12_000_000]}
    four = dist_memory.summarise(4, 1000, [_rank(r, 250, 3_000_000) for r in range(4)], "random")
    assert two["owned"] == [300, 700]  # rank order, whatever order the reports came in
    assert two["state_bytes"] == [9000, 21000]
    lines = dist_memory.table([one, two, other, four]).splitlines()
    assert lines[2].startswith("| 1 | locality | 1000 | 1000 | 1000-1000 | 0.0 |") and lines[2].endswith("| 1.000 |")
    # largest rank: 21000 B state, 6 MB peak of 8 MB at W=1
    assert lines[3].startswith("| 2 | locality | 1000 | 500 | 300-700 | 0.0 |")
    assert lines[3].endswith("| 6.0 | 6.0 | 0.750 |")
    assert lines[5].startswith("| 4 | random | 1000 | 250 | 250-250 |") and lines[5].endswith("| 0.250 |")  # 3 of 12
    unknown = dist_memory.summarise(2, 1000, [_rank(0, 500, None), _rank(1, 500, None)])
    assert dist_memory.table([unknown]).splitlines()[2].endswith("| - | - | - |")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc peak RSS")
def test_cpu_probe_peak_resets_and_sees_a_new_allocation():
    import mmap

    probe = dist_memory.MemoryProbe(torch.device("cpu"))
    assert probe.reset()
    before = probe.peak()
    # 64 MiB of fresh anonymous pages, each touched: a heap allocation could reuse pages an earlier
    # test in this worker freed but the allocator kept resident, and then the peak would not move
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = probe.peak()
    block.close()
    assert after - before >= 60 * 2**20
    assert probe.reset() and probe.peak() < after  # the mark came back down to the current RSS


def test_subsample_scales_match_the_exact_knn(demo_scene):
    over = dist_memory.run_overrides(4000, 1, 1, 1, "locality", 0, ["model.sh_degree=1"])
    exact, note = dist_memory.initial_model(demo_scene, over, knn_max=4000)
    approx, note2 = dist_memory.initial_model(demo_scene, over, knn_max=500)
    assert note != note2
    assert torch.equal(exact["means"], approx["means"])  # the same points, only the scales differ
    for k in ("quats", "opacities", "shN"):
        assert approx[k].shape == exact[k].shape
    # the exact path is init_gaussians itself; the subsample path lands on its typical scale
    ref = init_gaussians(exact["means"].numpy(), torch.zeros(4000, 3).numpy(), sh_degree=1)["scales"].detach()
    assert torch.equal(exact["scales"], ref)
    ratio = float(approx["scales"].exp().median() / ref.exp().median())
    assert 0.85 < ratio < 1.15, ratio


def test_dist_overhead_pairs_both_trainers_on_the_same_work(demo_scene, tmp_path):
    # a subprocess: the bench sets torchrun's variables and a process group for itself
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bench.dist_overhead", str(demo_scene), "--steps", "20", "--block", "10",
           "--set", "train.device=cpu", "--set", "strategy.refine_start=5", "--set", "strategy.refine_every=5",
           "--set", "strategy.grow_grad2d=0.00005"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    init = int(proc.stdout.split("Gaussians per rank [")[1].split("]")[0])
    result = json.loads((tmp_path / "dist_overhead.json").read_text())
    assert result["process_group"] == "gloo" and len(result["blocks_s"]) == 2
    assert result["plain_ms_per_step"] > 0 and result["w1_ms_per_step"] > 0
    # the same steps from the same start (the whole model in another row order), densifying: the
    # same count, and not the start's
    counts = result["gaussians_end"]
    assert counts["plain"] == counts["w1"] != init
