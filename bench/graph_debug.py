"""Development probe for train.cuda_graphs: which part of the graph key changes between captures,
and how one graph step compares with the same eager step from the same state.

    python -m bench.graph_debug SCENE [--steps 40] [--mode warp]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train import graph_step
from gstrain.train.trainer import Trainer, seed_everything

NAMES = ("params", "moments", "strategy", "sh", "image", "threshold", "capacity")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scene", type=Path)
    ap.add_argument("--steps", type=int, default=43)
    ap.add_argument("--mode", default="warp")
    args = ap.parse_args()
    scene = load_scene(args.scene)
    cfg = build_config(overrides=[{"render": {"atomic_mode": args.mode},
                                   "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 1000}}])
    seed_everything(0)
    t = Trainer(cfg, scene, Path("/tmp/gdbg"), torch.device("cuda"), log=print)
    t.timer.enabled = False
    g = t.graphs
    last: list = [None]
    original = g._key

    def key(step: int, idx: int) -> tuple:
        k = original(step, idx)
        if last[0] is not None and k != last[0]:
            diff = [n for n, a, b in zip(NAMES, k, last[0], strict=True) if a != b]
            print(f"step {step}: key changed in {diff}")
        last[0] = k
        return k

    g._key = key
    for step in range(args.steps):
        t.train_step(step)
    g.settle()
    print("summary", g.summary())
    # one step from the same state, graph vs eager
    seed_everything(0)
    e = Trainer(build_config(overrides=[{"render": {"atomic_mode": args.mode}, "train": {"cuda_graphs": False},
                                          "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 1000}}]),
                scene, Path("/tmp/gdbg_e"), torch.device("cuda"), log=print)
    e.timer.enabled = False
    e.load_state_dict(copy.deepcopy(t.state_dict()))
    t.graphs.warm = True
    step = t.step
    for who in (t, e):
        who.sampler.load_state_dict(copy.deepcopy(t.sampler.state_dict()))
    before = {k: v.detach().clone() for k, v in t.params.items()}
    t.train_step(step)
    t.graphs.settle()
    e.train_step(step)
    torch.cuda.synchronize()
    for k in t.params:
        d_graph = (t.params[k] - before[k]).abs().max().item()
        d_eager = (e.params[k] - before[k]).abs().max().item()
        diff = (t.params[k] - e.params[k]).abs().max().item()
        print(f"{k}: update graph {d_graph:.3e} eager {d_eager:.3e} diff {diff:.3e}")
    for k, v in t.strategy.state.items():
        if torch.is_tensor(v):
            print(f"state {k}: diff {(v - e.strategy.state[k]).abs().max().item():.3e} max {v.abs().max().item():.3e}")
    print("graph summary", t.graphs.summary(), graph_step.CAPACITY_MARGIN)


if __name__ == "__main__":
    main()
