"""Distributed training over gloo processes equals the single-process trainer with the same
global batch: bit for bit at W=1, to float tolerance at W=2 and W=3 (sums run in another order)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.distributed.local import run_local
from gstrain.train.trainer import Trainer

BASE = {"train": {"steps": 12, "device": "cpu", "seed": 5},
        "model": {"init": "random", "init_points": 400, "sh_degree": 1},
        "strategy": {"refine_start": 1000, "refine_stop": 2000},
        "log": {"progress_every": 4, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0}}


def _cfg(over: dict) -> object:
    sections = {k: dict(v) for k, v in BASE.items()}
    for section, values in over.items():
        sections.setdefault(section, {}).update(values)
    return build_config(None, [sections])


def _plain(scene: Path, run: Path, over: dict) -> dict[str, torch.Tensor]:
    cfg = _cfg(over)
    data = load_scene(scene, factor=1, test_every=cfg.data.test_every)
    run.mkdir(parents=True)
    trainer = Trainer(cfg, data, run, torch.device("cpu"), log=lambda m: None)
    start = {k: v.detach().clone() for k, v in trainer.params.items()}
    assert trainer.fit().status == "done"
    moved = [k for k, v in trainer.params.items() if v.shape != start[k].shape or not torch.equal(v, start[k])]
    assert {"means", "quats", "scales", "opacities", "sh0"} <= set(moved)  # the comparison is not vacuous
    return {k: v.detach().clone() for k, v in trainer.params.items()}


def _dist_fit(rank: int, world: int, scene: str, run: str, over: dict, resume: bool = False,
              nan_at: int = 0) -> dict:  # fmt: skip
    from gstrain.distributed.trainer import DistTrainer

    cfg = _cfg(over)
    data = load_scene(Path(scene), factor=1, test_every=cfg.data.test_every)
    trainer = DistTrainer(cfg, data, Path(run), torch.device("cpu"), log=lambda m: None)
    if nan_at and rank == world - 1:  # the last rank's Gaussians go bad after step `nan_at`
        step_once = trainer.train_step

        def train_step(step: int):
            out = step_once(step)
            if step + 1 == nan_at:
                trainer.params["means"].data[0] = float("nan")
            return out

        trainer.train_step = train_step
    result = trainer.fit(resume=resume)
    return {"status": result.status, "step": result.step, "order": trainer.row_order,
            "params": {k: v.detach().clone() for k, v in trainer.params.items()}}


def _whole(results: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r["params"][k] for r in results]) for k in results[0]["params"]}


one_thread = pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1",
                                reason="bit-identical CPU sums need one thread (run with OMP_NUM_THREADS=1)")


@one_thread
def test_one_rank_is_the_plain_trainer_bit_for_bit(demo_scene, tmp_path):
    """W=1 through the distributed path, with densification (refines at 10, 20) and B=1."""
    over = {"train": {"steps": 30}, "strategy": {"refine_start": 5, "refine_every": 10, "grow_grad2d": 1e-5},
            "log": {"progress_every": 10}}
    expected = _plain(demo_scene, tmp_path / "plain", over)
    (tmp_path / "dist").mkdir()
    (res,) = run_local(_dist_fit, 1, str(demo_scene), str(tmp_path / "dist"), over, timeout=120)
    assert res["status"] == "done" and res["step"] == 30
    assert len(expected["means"]) != 400  # densification changed the set
    for k, v in expected.items():
        assert torch.equal(res["params"][k], v), k


# optim.eps: Adam with eps=1e-15 turns rounding noise (a quaternion's gradient along itself,
# ~1e-10) into full-size steps of either sign; a larger eps keeps the comparisons about the
# gradients, which another summation order changes only by rounding
CKPT = {"train": {"batch_size": 2}, "optim": {"eps": 1e-7}, "log": {"progress_every": 3}}
# one refinement (step 4): after it, split children sit at random offsets drawn on each rank,
# so later statistics (and counts) no longer match one process's draws
REFINE = {**CKPT, "strategy": {"refine_start": 3, "refine_every": 4, "refine_stop": 6, "grow_grad2d": 2e-5}}
ROUND_ROBIN_B3 = {**CKPT, "train": {"batch_size": 3}, "dist": {"partition": "round_robin"}}


def _stop_and_resume(rank: int, world: int, scene: str, root: str) -> dict:
    """An uninterrupted W=2 run, and one paused at step 6 (train.stop_at) then resumed at W=2."""
    whole = _dist_fit(rank, world, scene, f"{root}/whole", CKPT)
    paused = _dist_fit(rank, world, scene, f"{root}/paused", {**CKPT, "train": {"batch_size": 2, "stop_at": 6}})
    if rank == 0:  # the step-6 checkpoint, kept for the resumes at other world sizes
        shutil.copytree(f"{root}/paused", f"{root}/at6")
    torch.distributed.barrier()
    resumed = _dist_fit(rank, world, scene, f"{root}/paused", CKPT, resume=True)
    refined = _dist_fit(rank, world, scene, f"{root}/refined", REFINE)
    # partitioned again at steps 4 and 8 (the rows move between ranks), and at every check where
    # one owner's load exceeded the mean (a threshold of 1, cuts that mostly balance counts): the
    # same training
    moved = _dist_fit(rank, world, scene, f"{root}/moved",
                      {**CKPT, "dist": {"reprofile_every": 4, "rebalance_above": 1.0, "rebalance_window": 1,
                                        "count_weight": 0.9}})
    # dist.partition=views, planned on rank 0 at the start and by all ranks at steps 4 and 8 (the
    # guard off: the demo scene's 400 Gaussians need not balance): the same training
    views = _dist_fit(rank, world, scene, f"{root}/views",
                      {**CKPT, "dist": {"partition": "views", "reprofile_every": 4, "max_imbalance": 100.0}})
    # a NaN on the last rank after step 5: every rank stops at the next check (step 6, a checkpoint step)
    nan = _dist_fit(rank, world, scene, f"{root}/nan", {**CKPT, "log": {"progress_every": 3, "ckpt_every": 3}},
                    nan_at=5)
    return {"whole": whole, "paused": paused, "resumed": resumed, "refined": refined, "moved": moved, "nan": nan,
            "views": views}


def _three(rank: int, world: int, scene: str, root: str) -> dict:
    """W=3: a fresh run (round robin, B=3), and the W=2 step-6 checkpoint resumed."""
    return {"fresh": _dist_fit(rank, world, scene, f"{root}/fresh3", ROUND_ROBIN_B3),
            "fp16": _dist_fit(rank, world, scene, f"{root}/fp16", {**ROUND_ROBIN_B3, "dist": {"compress": "fp16"}}),
            "resumed": _dist_fit(rank, world, scene, f"{root}/w3", CKPT, resume=True)}


def _assert_equal_rows(results: list[dict], expected: dict[str, torch.Tensor]) -> None:
    """The ranks' shards, concatenated, equal `expected` taken in the partition's row order."""
    got, order = _whole(results), results[0]["order"]
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v[order], rtol=1e-4, atol=2e-5, msg=k)


@pytest.mark.slow
def test_w_ranks_equal_one_process_and_resume_at_any_world_size(demo_scene, tmp_path):
    """W=2 (locality) and W=3 (round robin) equal one process with the same global batch; a
    sharded checkpoint resumes at W=2 bit for bit, at W=1 (plain trainer) and at W=3."""
    for name in ("whole", "paused", "fresh3", "refined", "moved", "nan", "fp16", "views"):
        (tmp_path / name).mkdir()
    runs = run_local(_stop_and_resume, 2, str(demo_scene), str(tmp_path), timeout=120)
    plain2 = _plain(demo_scene, tmp_path / "plain2", CKPT)
    _assert_equal_rows([r["whole"] for r in runs], plain2)
    _assert_equal_rows([r["moved"] for r in runs], plain2)
    assert not torch.equal(runs[0]["moved"]["order"], runs[0]["whole"]["order"])  # rows did move
    _assert_equal_rows([r["views"] for r in runs], plain2)
    assert not torch.equal(runs[0]["views"]["order"], runs[0]["whole"]["order"])  # not the locality rows
    rebalanced = json.loads((tmp_path / "moved" / "train_summary.json").read_text())["rebalanced_at"]
    assert rebalanced and set(rebalanced) <= {3, 6, 9}  # the agreements (progress_every 3) before the end
    assert [(r["nan"]["status"], r["nan"]["step"]) for r in runs] == [("nan", 6), ("nan", 6)]
    assert sorted(p.name for p in (tmp_path / "nan" / "ckpt").iterdir()) == ["step_3.shards"]  # the last good one
    assert all(len(r["whole"]["params"]["means"]) > 0 for r in runs)  # every rank owns a shard
    # densification per owner, children kept by their parent's owner: the counts of one process
    refined = _plain(demo_scene, tmp_path / "plain_refined", REFINE)
    assert len(refined["means"]) != 400
    assert sum(len(r["refined"]["params"]["means"]) for r in runs) == len(refined["means"])
    assert [r["paused"]["status"] for r in runs] == ["stopped", "stopped"]
    assert all(r["paused"]["step"] == 6 and r["resumed"]["step"] == 12 for r in runs)
    manifest = (tmp_path / "at6" / "ckpt" / "step_6.shards" / "manifest.json").read_text()
    assert '"world": 2' in manifest
    whole = _whole([r["whole"] for r in runs])
    resumed = _whole([r["resumed"] for r in runs])
    for k, v in whole.items():  # same world size: the continuation is the uninterrupted run
        assert torch.equal(resumed[k], v), k

    # W=1: the plain trainer reads the shards gathered into the global row order
    cfg = _cfg(CKPT)
    scene = load_scene(demo_scene, factor=1, test_every=cfg.data.test_every)
    shutil.copytree(tmp_path / "at6", tmp_path / "w1")
    plain = Trainer(cfg, scene, tmp_path / "w1", torch.device("cpu"), log=lambda m: None)
    result = plain.fit(resume=True)
    assert result.status == "done" and result.step == 12
    for k, v in whole.items():
        torch.testing.assert_close(plain.params[k].detach(), v, rtol=1e-4, atol=2e-5, msg=k)

    # W=3: gathered, partitioned again, runs to the end
    shutil.copytree(tmp_path / "at6", tmp_path / "w3")
    three = run_local(_three, 3, str(demo_scene), str(tmp_path), timeout=120)
    assert all(r["resumed"]["status"] == "done" and r["resumed"]["step"] == 12 for r in three)
    _assert_equal_rows([r["resumed"] for r in three], whole)
    plain3 = _plain(demo_scene, tmp_path / "plain3", ROUND_ROBIN_B3)
    _assert_equal_rows([r["fresh"] for r in three], plain3)
    # dist.compress=fp16: records and gradients rounded to float16 on the wire, the same training
    # (measured mean deviations 1e-5..4e-4 after 12 steps; training moves opacities by ~0.1)
    got, order = _whole([r["fp16"] for r in three]), three[0]["fp16"]["order"]
    assert not torch.equal(got["means"], _whole([r["fresh"] for r in three])["means"])  # the wire did round
    for k, v in plain3.items():
        assert float((got[k] - v[order]).abs().mean()) < 2e-3, k
