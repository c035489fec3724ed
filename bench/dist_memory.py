"""Memory per rank against N/W: W gloo processes (one device, shared) train the same fixed model.

For every W in --world, W local processes (gstrain.distributed.local.run_local) each build a DistTrainer
on the scene with N Gaussians from random points (model.init=random, no densification:
strategy.refine_stop=0), partition it (dist.partition) and train --steps steps of W·b views.
Per rank it reports the Gaussians it owns, the exact bytes of its parameters and Adam moments
after the steps (from the tensors), and the process's memory:

  cuda  torch.cuda.max_memory_allocated (tensors only: no CUDA context, no allocator cache);
  cpu   the resident set's high-water mark (VmHWM in /proc/self/status), whole process.

"set-up" is the peak up to the first step (every rank holds the whole model while it is
partitioned); "steps" is the peak over the steps alone (reset after set-up: the allocator's
counter on CUDA, /proc/self/clear_refs on the CPU); "total" is the larger of the two.

The initial model is built once, here, as Trainer would (random_points, kNN scales), and loaded
by every rank: kNN on millions of points takes minutes on one core, so above --knn-max points
the scales (and colours) are a uniform subsample's, cycled, its kNN scales times (knn_max/N)^(1/3)
(random_points is uniform in a ball: neighbour distances scale with density^(-1/3)).

    python -m bench.dist_memory [--scene .benchdata/beer] [--n 1000000] [--world 1,2,4] [--steps 20]
        [--device cuda|cpu] [--partitions locality,random] [--set section.key=value ...]

Prints a markdown table; writes $OUT/dist_memory.json (else bench/results/dist_memory/<commit>/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.dist_comm import DATA, ROOT, log
from gstrain.config import build_config, parse_override
from gstrain.errors import UserError

MB = 1e6


# ---------------------------------------------------------------------------------------------
# memory of this process


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryProbe:
    """Bytes in use and the peak since the last reset: the CUDA allocator on a GPU, the resident
    set (VmRSS / VmHWM) on the CPU. reset() returns False where the peak cannot be reset."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = ("cuda max_memory_allocated" if device.type == "cuda"
                     else "cpu peak RSS (VmHWM)")  # fmt: skip

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def current(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        kib = _proc_status_kib("VmRSS")
        return None if kib is None else kib * 1024

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        kib = _proc_status_kib("VmHWM")
        return None if kib is None else kib * 1024

    def reset(self) -> bool:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return True
        try:  # "5" resets the high-water mark to the current RSS (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
            return True
        except OSError:
            return False


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ---------------------------------------------------------------------------------------------
# one rank


def _worker(rank: int, world: int, scene_dir: str, run_dir: str, model_file: str, overrides: list[dict],
            device_name: str, steps: int) -> dict:  # fmt: skip
    from gstrain.data.colmap import load_scene
    from gstrain.distributed.trainer import DistTrainer
    from gstrain.train.trainer import seed_everything

    class PresetTrainer(DistTrainer):
        """A DistTrainer whose initial model is the one built once by the parent."""

        def _initial_params(self) -> torch.nn.ParameterDict:
            tensors = torch.load(model_file, map_location="cpu", weights_only=True)
            return torch.nn.ParameterDict({k: torch.nn.Parameter(v.to(self.device)) for k, v in tensors.items()})

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", 0)  # the ranks share one GPU (gloo stages the exchange on the host)
        torch.cuda.set_device(device)
    probe = MemoryProbe(device)
    cfg = build_config(None, overrides)
    scene = load_scene(Path(scene_dir), factor=cfg.data.factor, test_every=cfg.data.test_every)
    trainer = PresetTrainer(cfg, scene, Path(run_dir), device, log=lambda m: None)
    seed_everything(cfg.train.seed)
    trainer._distribute()  # what fit() does first; fit's end (eval, PLY, checkpoint) is not measured
    probe.sync()
    setup_peak, resident = probe.peak(), probe.current()
    was_reset = probe.reset()
    t0 = time.perf_counter()
    for step in range(steps):
        trainer.train_step(step)
        trainer.step += 1
    probe.sync()
    seconds = time.perf_counter() - t0
    steps_peak = probe.peak() if was_reset else None
    params = list(trainer.params.values())
    adam = [v for opt in trainer.optimizers.values() for st in opt.state.values() for v in st.values()]
    return {"rank": rank, "owned": len(trainer.params["means"]), "params_bytes": tensor_bytes(params),
            "adam_bytes": tensor_bytes(adam),
            "resident_after_setup": resident, "setup_peak": setup_peak, "steps_peak": steps_peak,
            "total_peak": max(setup_peak or 0, steps_peak or 0) or None, "steps_seconds": round(seconds, 3),
            "comm_bytes_per_step": (trainer.record.comm_sent + trainer.record.comm_received) / max(steps, 1),
            }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the initial model, once


def initial_model(scene_dir: Path, overrides: list[dict], knn_max: int) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors Trainer._initial_params builds for model.init=random (exact kNN scales up to
    knn_max points; above, from a subsample's kNN rescaled to the full density)."""
    from gstrain.data.colmap import load_scene
    from gstrain.model import init_gaussians, random_points

    cfg = build_config(None, overrides)
    scene = load_scene(scene_dir, factor=cfg.data.factor, test_every=cfg.data.test_every)
    n = cfg.model.init_points
    centers = np.stack([v.camera_center.numpy() for v in scene.train])
    points, colors = random_points(n, centers.mean(axis=0), scene.extent, seed=cfg.train.seed)
    m = cfg.model
    if n <= knn_max:
        g = init_gaussians(points, colors, m.sh_degree, m.init_opacity, m.init_scale)
        return {k: v.detach() for k, v in g.items()}, "kNN (as gstrain fit)"
    # the points are i.i.d. uniform in a ball, so the first knn_max are a uniform subsample; the
    # others take a subsample Gaussian's scales and (random grey) colour, at their own positions
    sub = init_gaussians(points[:knn_max], colors[:knn_max], m.sh_degree, m.init_opacity, m.init_scale)
    idx = torch.arange(n) % knn_max
    out = {k: v.detach()[idx].clone() for k, v in sub.items()}
    out["means"] = torch.from_numpy(points).float()
    out["scales"] += float(np.log((knn_max / n) ** (1.0 / 3.0)))
    return out, f"kNN of a {knn_max}-point subsample x (knn_max/N)^(1/3), cycled (colours too)"


# ---------------------------------------------------------------------------------------------
# the study


def run_overrides(n: int, world: int, views_per_rank: int, steps: int, partition: str, seed: int,
                  sets: list[str]) -> list[dict]:  # fmt: skip
    """Config overrides of one W: a fixed model (random init, no densification), no eval or export.
    The SH degree rises every step (sh_degree_interval=1): from step 3 on, every parameter has
    gradients and Adam moments, as in a long run (with the default 1000, shN would have none)."""
    base = {"train": {"steps": steps, "batch_size": world * views_per_rank, "seed": seed, "sh_degree_interval": 1},
            "model": {"init": "random", "init_points": n},
            "strategy": {"refine_stop": 0},
            "data": {"test_every": 0},
            "dist": {"partition": partition},
            "log": {"eval_steps": [], "save_steps": [], "ckpt_every": 0}}  # fmt: skip
    return [base, *(parse_override(s) for s in sets)]


def summarise(world: int, n: int, ranks: list[dict], partition: str = "locality") -> dict:
    """One W's row from its ranks' reports (lists in rank order)."""
    keys = ("owned", "params_bytes", "adam_bytes", "resident_after_setup", "setup_peak",
            "steps_peak", "total_peak", "steps_seconds", "comm_bytes_per_step")  # fmt: skip
    row: dict[str, Any] = {"world": world, "partition": partition, "n": n, "n_per_rank": n / world}
    row.update({k: [r[k] for r in sorted(ranks, key=lambda r: r["rank"])] for k in keys})
    row["state_bytes"] = [p + a for p, a in zip(row["params_bytes"], row["adam_bytes"], strict=True)]
    return row


def _mb(values: list[int | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{max(known) / MB:.1f}" if known else "-"


def table(rows: list[dict]) -> str:
    """Markdown, one line per W and partition; per-rank figures are the largest rank's (the one
    that must fit); the ratio is against W=1 of the same partition."""
    lines = ["| W | partition | N | N/W | owned Gaussians (min-max) | state MB (params+Adam) | "
             "resident after set-up MB | peak MB, steps | peak MB, total | steps peak / W=1 |",
             "|---:|---" + "|---:" * 8 + "|"]  # fmt: skip

    def top(r: dict) -> int | None:
        return max((v for v in r["steps_peak"] if v is not None), default=None)

    base = {r["partition"]: top(r) for r in rows if r["world"] == 1}
    for r in rows:
        peak, one = top(r), base.get(r["partition"])
        ratio = f"{peak / one:.3f}" if peak is not None and one else "-"
        lines.append(f"| {r['world']} | {r['partition']} | {r['n']} | {r['n_per_rank']:.0f} | "
                     f"{min(r['owned'])}-{max(r['owned'])} | "
                     f"{_mb(r['state_bytes'])} | {_mb(r['resident_after_setup'])} | {_mb(r['steps_peak'])} | "
                     f"{_mb(r['total_peak'])} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def default_scene() -> Path:
    local = ROOT / ".benchdata" / "beer"
    return local if local.is_dir() else DATA / "beer"


def default_json() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "dist_memory.json"
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, cwd=ROOT).stdout.strip() or "unknown"
    return ROOT / "bench" / "results" / "dist_memory" / commit / "dist_memory.json"


def main(argv: list[str] | None = None) -> list[dict]:
    from gstrain.distributed.local import run_local

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scene", type=Path, default=None, help="COLMAP scene (default: .benchdata/beer or "
                    "../shared/data/beer)")  # fmt: skip
    ap.add_argument("--n", type=int, default=1_000_000, help="Gaussians (fixed: random init, no densification)")
    ap.add_argument("--world", default="1,2,4", help="process counts, comma-separated")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--views-per-rank", type=int, default=1, help="b: the global batch is W·b")
    ap.add_argument("--partitions", default="locality", help="dist.partition values, comma-separated")
    ap.add_argument("--device", default="cuda", help="cuda (all ranks share GPU 0) or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--knn-max", type=int, default=200_000, help="exact kNN scales up to this many points")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="section.key=value (repeatable)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/dist_memory.json, else bench/results/")
    args = ap.parse_args(argv)
    scene = args.scene or default_scene()
    worlds = [int(w) for w in args.world.split(",")]
    t0 = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dist-memory-") as tmp:
        parts = args.partitions.split(",")
        first = run_overrides(args.n, 1, args.views_per_rank, args.steps, parts[0], args.seed, args.sets)
        try:  # bad --set values fail here, before any process starts
            build_config(None, first)
        except UserError as exc:
            print(f"dist_memory: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        model, init_note = initial_model(scene, first, args.knn_max)
        model_file = str(Path(tmp) / "model.pt")
        torch.save(model, model_file)
        del model
        log(f"dist_memory: initial model of {args.n} Gaussians ({init_note}) in {time.perf_counter() - t0:.0f} s")
        for part in parts:
            for world in worlds:
                if world == 1 and part != parts[0]:  # one rank: the partition changes nothing
                    rows.append({**next(r for r in rows if r["world"] == 1), "partition": part})
                    continue
                over = run_overrides(args.n, world, args.views_per_rank, args.steps, part, args.seed, args.sets)
                run_dir = Path(tmp) / f"w{world}_{part}"
                run_dir.mkdir()
                t = time.perf_counter()
                ranks = run_local(_worker, world, str(scene), str(run_dir), str(model_file), over, args.device,
                                  args.steps, timeout=args.timeout)  # fmt: skip
                rows.append(summarise(world, args.n, ranks, part))
                log(f"dist_memory: W={world} {part} in {time.perf_counter() - t:.0f} s")
    probe = MemoryProbe(torch.device(args.device))
    doc = {"command": " ".join([Path(sys.executable).name, "-m", "bench.dist_memory", *sys.argv[1:]]),
           "scene": str(scene), "device": args.device, "memory": probe.kind, "init_scales": init_note,
           "steps": args.steps, "views_per_rank": args.views_per_rank,
           "sets": args.sets, "rows": rows}  # fmt: skip
    out = args.json or default_json()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nmemory: {probe.kind}; {args.steps} steps of W·{args.views_per_rank} views; "
          f"initial scales: {init_note}\n\n{table(rows)}\n", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
