"""Where a CUDA-graph training step's time goes: graph steps against eager steps from the same
trained state, the kernels inside a replay, and the pair buffers' size against the pairs.

    python -m bench.graph_study SCENE [--at 16000] [--steps 400] [--set section.key=value ...]

Trains SCENE with `gstrain fit`'s Trainer to step --at (train.stop_at), printing the host time of
its steps by kind (replay, capture, eager by reason, settle, evaluation); then, from that state:
warms the graphs until every image size is captured, times --steps graph steps and --steps eager
steps (the same trainer with its graphs switched off; both keep training), profiles 40 graph
steps with torch.profiler (kernels inside a replay included), and prints the pairs per view
against the pair capacity. Prints JSON lines; a development study, not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gstrain.config import build_config, parse_override
from gstrain.data.inputs import load_scene
from gstrain.train import graph_step
from gstrain.train.trainer import Trainer


def _timed(trainer: Trainer, steps: int) -> dict[str, float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    host = 0.0
    for _ in range(steps):
        h0 = time.perf_counter()
        trainer.train_step(trainer.step)
        host += time.perf_counter() - h0
        trainer.step += 1
    if trainer.graphs is not None:
        trainer.graphs.settle()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / steps
    return {"wall_ms": round(wall, 4), "host_call_ms": round(host * 1e3 / steps, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 4),
            "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 4)}  # fmt: skip


def instrument(trainer: Trainer) -> dict[str, list[float]]:
    """Host seconds of every GraphEngine.run call by what it did (replay, capture, or an eager
    step's reason), and of settle() and evaluation. Host time is the step's time while the host
    is the bottleneck; a replay's includes its wait for a free ring slot (the GPU's pace)."""
    graphs, spent = trainer.graphs, {}
    run, settle, evaluate = graphs.run, graphs.settle, trainer.evaluate_test

    def add(key: str, seconds: float) -> None:
        entry = spent.setdefault(key, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def timed_run(step: int, idxs):
        captures, eager = graphs.captures, dict(graphs.eager_steps)
        t0 = time.perf_counter()
        result = run(step, idxs)
        seconds = time.perf_counter() - t0
        reason = next((k for k, v in graphs.eager_steps.items() if v != eager.get(k, 0)), None)
        add("capture" if graphs.captures != captures else (f"eager:{reason}" if reason else "replay"), seconds)
        return result

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            add(name, time.perf_counter() - t0)
            return out
        return wrapper

    graphs.run, graphs.settle = timed_run, timed("settle", settle)
    trainer.evaluate_test = timed("evaluate_test", evaluate)
    trainer.save, trainer.export_ply = timed("checkpoint", trainer.save), timed("export_ply", trainer.export_ply)
    return spent


def timeline(trainer: Trainer, every: int = 100) -> list[float]:
    """Wall ms per step over each window of `every` steps of the fit (what the user waits for,
    everything included): where in the run the time goes."""
    marks: list[float] = []
    step_fn = trainer.train_step

    def marked(step: int):
        if step % every == 0:
            marks.append(time.perf_counter())
        return step_fn(step)

    trainer.train_step = marked
    return marks


def set_constant(assignment: str) -> None:
    """--const module.NAME=value: a module constant for this run (a study's knob, not a setting)."""
    import importlib

    target, value = assignment.split("=", 1)
    module_name, name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
    old = getattr(module, name)
    setattr(module, name, type(old)(value))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path)
    ap.add_argument("--at", type=int, default=16000)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warm", type=int, default=400, help="graph steps before timing (captures every size)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--out", type=Path, default=Path("/tmp/graph_study"))
    ap.add_argument("--fit-only", action="store_true", help="only the fit (with its host time by kind of step)")
    ap.add_argument("--capture-after", type=int, default=None, help="graph_step.CAPTURE_AFTER for this run")
    ap.add_argument("--const", action="append", default=[], help="module.NAME=value for this run (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(4)
    if args.capture_after is not None:
        graph_step.CAPTURE_AFTER = args.capture_after
    for assignment in args.const:
        set_constant(assignment)
    overrides = [parse_override(s) for s in args.sets]
    cfg = build_config(overrides=[*overrides, {"train": {"steps": 30000, "stop_at": args.at}}])
    scene = load_scene(args.scene)
    trainer = Trainer(cfg, scene, args.out, torch.device("cuda"), log=lambda s: None)
    spent = instrument(trainer)
    marks = timeline(trainer)
    t0 = time.perf_counter()
    trainer.fit()
    rows = {k: {"calls": n, "s": round(sec, 3), "ms_per": round(sec * 1e3 / n, 3)} for k, (n, sec) in spent.items()}
    print(json.dumps({"fit_s": round(time.perf_counter() - t0, 3), "breakdown": rows, "const": args.const,
                      "sets": args.sets, "gaussians": len(trainer.params["means"]),
                      "graphs": trainer.graphs.summary()}), flush=True)  # fmt: skip
    windows = [round((b - a) * 10, 3) for a, b in zip(marks, marks[1:], strict=False)]  # ms per step over 100 steps
    print(json.dumps({"window_ms_per_step": windows}), flush=True)
    if args.fit_only:
        return
    print(json.dumps({"trained_to": trainer.step, "seconds": round(time.perf_counter() - t0, 2),
                      "gaussians": len(trainer.params["means"]), "graphs": trainer.graphs.summary()}),
          flush=True)  # fmt: skip
    trainer.timer.enabled = False
    graphs = trainer.graphs
    _timed(trainer, args.warm)
    captured = len(graphs.graphs)
    graph = _timed(trainer, args.steps)
    print(json.dumps({"graph": graph, "sizes_captured": captured, "summary": graphs.summary()}), flush=True)
    trainer.graphs = None
    eager = _timed(trainer, args.steps)
    trainer.graphs = graphs
    graphs.warm = True
    print(json.dumps({"eager": eager, "graph_over_eager": round(graph["wall_ms"] / eager["wall_ms"], 4)}), flush=True)
    _timed(trainer, 100)  # back to replays (the epoch is unchanged: no refinement after refine_stop)
    n_prof = 40
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _timed(trainer, n_prof)
    table = prof.key_averages()
    kernels = sorted((e for e in table if e.device_type == DeviceType.CUDA), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / 1e3 / n_prof
    rows = [{"kernel": e.key[:90], "ms_per_step": round(e.self_device_time_total / 1e3 / n_prof, 4),
             "calls_per_step": round(e.count / n_prof, 2)} for e in kernels[:30]]  # fmt: skip
    print(json.dumps({"graph_kernels_ms_per_step": round(total, 4), "top": rows}), flush=True)
    # pairs per view against the capacity every replay sorts
    before, after, views = graphs.pair_totals()
    # groups: image sizes, or views on the canvas (graph_step.GraphEngine)
    per_group = {(f"view {g}" if isinstance(g, int) else "x".join(map(str, g[:2]))):
                 {"capacity": graphs.groups.capacities.get(g), "most": most}
                 for g, most in graphs.groups.peak.items()}  # fmt: skip
    sizes = len(set(trainer.ctx.views.shapes()))
    print(json.dumps({"mean_pairs_after_cull": after / max(views, 1), "views": views, "sizes": sizes,
                      "per_group": per_group}),
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
