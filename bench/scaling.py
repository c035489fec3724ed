"""Scaling study (issue 17): the same training at W = 1, 2, 4, 8 processes and each partition.

For every W in --world and every partition in --partitions it runs

    torchrun --nproc-per-node=W -m gstrain fit SCENE --steps N --set train.batch_size=W·b
             --set dist.partition=P [--set dev.always_distributed=true at W=1] EXTRA

and, as the one-GPU reference, the plain trainer with the same global batch (`gstrain fit ...
--set train.batch_size=W·b`, no torchrun). Each run's train_summary.json gives the wall time, the
views per second (steps · batch / seconds), the test PSNR / SSIM, the Gaussian count, the peak
memory of rank 0 and rank 0's exchange bytes per step; the table puts them side by side with
the time ratio against the one-process run of the same batch. Seeds repeat the whole grid.

    python -m bench.scaling SCENE --world 1,2,4,8 --partitions locality,views,random,round_robin \
        --steps 7000 --views-per-rank 1 --seeds 0 [--extra "--set dist.compress=fp16"] [--device cpu]

--device cpu (gloo) is the dry run this machine can make; on one GPU, `--extra "--set
dist.backend=gloo"` lets W ranks share it (correctness, not speed). The study itself needs a
machine with W GPUs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

FIELDS = ("seconds", "final_test_psnr", "final_test_ssim", "num_gaussians", "peak_gpu_memory_gib")


def fit_command(scene: Path, out: Path, world: int, partition: str | None, batch: int, steps: int, seed: int,
                device: str, extra: list[str]) -> list[str]:
    """The command of one run: torchrun for a partition, the plain trainer for partition None."""
    args = ["-m", "gstrain", "fit", str(scene), "--out", str(out), "--steps", str(steps), "--seed", str(seed),
            "--device", device, "--set", f"train.batch_size={batch}", *extra]
    if partition is None:
        return [sys.executable, *args]
    args += ["--set", f"dist.partition={partition}"]
    if world == 1:
        args += ["--set", "dev.always_distributed=true"]
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun) if torchrun.exists() else "torchrun", f"--nproc-per-node={world}", *args]


def run_one(cmd: list[str], out: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not (out / "train_summary.json").is_file():
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"failed": True, "command": shlex.join(cmd), "error": " | ".join(tail), "process_wall_s": wall}
    summary = json.loads((out / "train_summary.json").read_text())
    row = {k: summary.get(k) for k in FIELDS}
    row.update(command=shlex.join(cmd), process_wall_s=round(wall, 2), steps=summary.get("steps"),
               comm_bytes_per_step=summary.get("comm_bytes_per_step"))
    return row


def table(rows: list[dict]) -> str:
    """Markdown: one line per run, with the time against the one-process run of the same batch."""
    plain = {(r["batch"], r["seed"]): r for r in rows if r["partition"] is None and not r.get("failed")}
    lines = ["| W | partition | batch | seed | seconds | views/s | vs 1 process | test PSNR | Gaussians | "
             "peak GiB (rank 0) | exchange MB/step (rank 0 sent+recv) |", "|---" * 11 + "|"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['world']} | {r['partition'] or 'one process'} | {r['batch']} | {r['seed']} | "
                         f"failed: {r['error']} |" + " |" * 6)
            continue
        views = r["steps"] * r["batch"] / r["seconds"] if r["seconds"] else float("nan")
        base = plain.get((r["batch"], r["seed"]))
        ratio = f"{base['seconds'] / r['seconds']:.2f}x" if base and r["seconds"] else "-"
        comm = r.get("comm_bytes_per_step") or {}
        mb = (comm.get("sent", 0) + comm.get("received", 0)) / 1e6
        psnr = f"{r['final_test_psnr']:.2f}" if r["final_test_psnr"] is not None else "-"
        peak = r["peak_gpu_memory_gib"] if r["peak_gpu_memory_gib"] is not None else "-"
        lines.append(f"| {r['world']} | {r['partition'] or 'one process'} | {r['batch']} | {r['seed']} | "
                     f"{r['seconds']:.1f} | {views:.1f} | {ratio} | {psnr} | {r['num_gaussians']} | {peak} | "
                     f"{mb:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scene", type=Path)
    ap.add_argument("--world", default="1,2,4,8", help="process counts, comma-separated")
    ap.add_argument("--partitions", default="locality,views,random,round_robin")
    ap.add_argument("--steps", type=int, default=7000)
    ap.add_argument("--views-per-rank", type=int, default=1, help="b: the global batch is W·b")
    ap.add_argument("--seeds", default="0", help="comma-separated")
    ap.add_argument("--device", default="cuda", help="the runs' --device (cpu: a gloo dry run)")
    ap.add_argument("--extra", default="", help="more fit flags for every run, as one string")
    ap.add_argument("--out", type=Path, default=Path("bench/results/scaling"))
    args = ap.parse_args(argv)
    extra = shlex.split(args.extra)
    rows: list[dict] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for world in (int(w) for w in args.world.split(",")):
            batch = world * args.views_per_rank
            for partition in [None, *args.partitions.split(",")]:
                name = f"w{world}_{partition or 'plain'}_b{batch}_seed{seed}"
                if partition is None and any(r["batch"] == batch and r["seed"] == seed and r["partition"] is None
                                             for r in rows):
                    continue  # one plain run per batch and seed
                out = args.out / name
                if out.exists():
                    raise SystemExit(f"{out} exists: choose another --out (runs are never overwritten)")
                cmd = fit_command(args.scene, out, world, partition, batch, args.steps, seed, args.device, extra)
                row = {"world": world if partition else 1, "partition": partition, "batch": batch, "seed": seed,
                       **run_one(cmd, out)}
                rows.append(row)
                print(f"scaling: {name}: " + ("failed: " + row["error"] if row.get("failed")
                                              else f"{row['seconds']} s"), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
