"""Development probe for dev.cuda_graphs: which part of the epoch key (what every graph of an
epoch bakes in) changes between epochs, and how one graph step compares with the same eager step
from the same state.

    python -m bench.graph_debug SCENE [--steps 43] [--mode warp] [--lockstep N]
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from gstrain.config import build_config
from gstrain.data.inputs import load_scene
from gstrain.train import graph_capacity
from gstrain.train.trainer import Trainer, seed_everything

NAMES = ("params", "moments", "strategy", "sh", "threshold")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scene", type=Path)
    ap.add_argument("--steps", type=int, default=43)
    ap.add_argument("--mode", default="warp")
    ap.add_argument("--lockstep", type=int, default=0, help="steps of a graph run and an eager run side by side")
    args = ap.parse_args()
    scene = load_scene(args.scene)
    if args.lockstep:
        lockstep(scene, args.lockstep, args.mode)
        return
    cfg = build_config(overrides=[{"render": {"atomic_mode": args.mode},
                                   "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 1000}}])
    seed_everything(0)
    t = Trainer(cfg, scene, Path("/tmp/gdbg"), torch.device("cuda"), log=print)
    t.timer.enabled = False
    g = t.graphs
    last: list = [None]
    original = g._epoch_key

    def key(step: int) -> tuple:
        k = original(step)
        if last[0] is not None and k != last[0]:
            diff = [n for n, a, b in zip(NAMES, k, last[0], strict=True) if a != b]
            print(f"step {step}: key changed in {diff}")
        last[0] = k
        return k

    g._epoch_key = key
    for step in range(args.steps):
        t.train_step(step)
    g.settle()
    print("summary", g.summary())
    # one step from the same state, graph vs eager
    seed_everything(0)
    e = Trainer(build_config(overrides=[{"render": {"atomic_mode": args.mode}, "dev": {"cuda_graphs": False},
                                          "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 1000}}]),
                scene, Path("/tmp/gdbg_e"), torch.device("cuda"), log=print)
    e.timer.enabled = False
    e.load_state_dict(copy.deepcopy(t.state_dict()))
    t.graphs.warm = True
    step = args.steps  # the step after the loop's (train_step does not advance t.step)
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
    print("graph summary", t.graphs.summary(), graph_capacity.CAPACITY_MARGIN)


def lockstep(scene, steps: int, mode: str) -> None:
    """The graph test's two runs, with the largest parameter difference after every step."""
    runs = []
    for graphs in (True, False):
        seed_everything(0)
        cfg = build_config(overrides=[{"train": {"steps": 500}, "dev": {"cuda_graphs": graphs},
                                       "render": {"atomic_mode": mode},
                                       "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 15}}])
        t = Trainer(cfg, scene, Path(f"/tmp/lock_{graphs}"), torch.device("cuda"), log=print)
        t.timer.enabled = False
        runs.append(t)
    g, e = runs
    for step in range(steps):
        for run in (g, e):
            torch.cuda.manual_seed(1000 + step)  # a split samples positions: the same draws
            run.train_step(step)
        g.graphs.settle()
        torch.cuda.synchronize()
        n = (len(g.params["means"]), len(e.params["means"]))
        if n[0] != n[1]:
            print(f"step {step}: counts {n}")
            continue
        diffs = {k: (g.params[k] - e.params[k]).abs().max().item() for k in g.params}
        state = {k: v for k, v in g.strategy.state.items() if torch.is_tensor(v)}
        st = {k: (v - e.strategy.state[k]).abs().max().item() for k, v in state.items()}
        print(f"step {step}: n {n[0]} captures {g.graphs.captures} views {g.graphs.views} params {diffs} state {st}")


if __name__ == "__main__":
    main()
