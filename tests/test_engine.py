"""The step engines (gstrain/train/engine.py): which one a set-up runs, and that the one loop
drives any engine registered in ENGINES through its context alone."""

from __future__ import annotations

import torch

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train import engine as engines
from gstrain.train.context import ShardInfo
from gstrain.train.trainer import Trainer

QUICK = {"train": {"steps": 6, "device": "cpu"}, "model": {"init": "random", "init_points": 200},
         "log": {"progress_every": 3, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0}}


def _trainer(scene, run, batch_size: int = 1) -> Trainer:
    cfg = build_config(None, [QUICK, {"train": {"batch_size": batch_size}}])
    return Trainer(cfg, load_scene(scene), run, torch.device("cpu"), log=lambda m: None)


def test_the_set_up_picks_the_engine(demo_scene, tmp_path, monkeypatch):
    single = _trainer(demo_scene, tmp_path / "a")
    assert single.engine.name == "eager" and single.graphs is None
    assert _trainer(demo_scene, tmp_path / "b", batch_size=2).engine.name == "batch"
    ctx = single.ctx
    monkeypatch.setattr(engines, "graphs_possible", lambda *a: True)  # as on a GPU with our kernels
    assert engines.choose_engine(ctx) == "graph"
    ctx.shard = ShardInfo(0, 1, lambda idx: [0] * len(idx))
    assert engines.choose_engine(ctx) == "graph"  # one rank owns everything: the plain step
    ctx.shard = ShardInfo(0, 2, lambda idx: [0] * len(idx))
    assert engines.choose_engine(ctx) == "sharded"


class CountingEngine:
    """A new engine: the eager one, counting its steps and the context's views it drew."""

    name = "counting"

    def __init__(self, ctx) -> None:
        self.inner = engines.EagerEngine(ctx)
        self.steps: list[int] = []

    def step(self, step: int):
        self.steps.append(step)
        return self.inner.step(step)

    def settle(self):
        return None

    def state_replaced(self) -> None:
        pass

    def summary(self):
        return {"counted": len(self.steps)}

    def pair_totals(self):
        return None


def test_a_registered_engine_runs_under_the_one_loop(demo_scene, tmp_path, monkeypatch):
    monkeypatch.setitem(engines.ENGINES, "counting", f"{__name__}:CountingEngine")
    trainer = _trainer(demo_scene, tmp_path / "run")
    reference = _trainer(demo_scene, tmp_path / "ref")
    trainer.engine = engines.build_engine("counting", trainer.ctx)
    assert trainer.fit().status == "done" and reference.fit().status == "done"
    assert trainer.engine.steps == list(range(6))  # each step once, in order, from the loop
    assert trainer.record.graphs == {"counted": 6}  # the engine's summary reaches the run record
    for k, v in reference.params.items():  # the same steps as the eager engine the set-up chose
        assert torch.equal(trainer.params[k], v), k
