"""train.batch_size=B on one process against the single-view step, per view, paired in one process.

Two trainers are built on the same scene and config, one with train.batch_size=1 and one with B,
and train alternately, BLOCK steps of the single-view trainer against BLOCK/B steps of the batch
trainer (the same number of views), each block timed with the device synchronized at both ends:
fit's hot loop (the engine's step, and the host sync every log.progress_every steps). Logging,
evaluation and checkpoints are left out. Alternating blocks puts both under the same clock.

    python -m bench.batch_overhead SCENE [--batch 2] [--views 3000] [--block 100] [--set KEY=VALUE ...]

Each trainer runs the engine `gstrain fit` would choose for it (train/engine.py): on a GPU with
dev.cuda_graphs both are CUDA-graph steps (the batch's graph holds its B views), so the ratio is
batch graph against single-view graph. Prints ms per view for each, the ratio (total and median of
the block ratios) and each trainer's engine, with a warning when they differ. Writes
`$OUT/batch_overhead.json` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from bench.dist_overhead import _block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scene", type=Path)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--views", type=int, default=3000, help="views each trainer trains on")
    ap.add_argument("--block", type=int, default=100, help="views per block")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override KEY=VALUE")
    args = ap.parse_args()
    if args.block % args.batch or args.views % args.block:
        ap.error("--block must be a multiple of --batch, and --views of --block")

    from gstrain.config import build_config, parse_override
    from gstrain.fit_run import _load_scene
    from gstrain.render import resolve_device
    from gstrain.threads import apply_threads
    from gstrain.train.run_record import RunRecord
    from gstrain.train.trainer import Trainer, _rng_state, _set_rng_state, seed_everything

    def config(batch: int):
        sets = [f"train.steps={args.views // batch}", f"train.batch_size={batch}", *args.sets]
        return build_config([], [parse_override(s) for s in sets])

    one, many = config(1), config(args.batch)
    device = resolve_device(one.train.device)
    apply_threads(one.train.threads, device)
    scene = _load_scene(args.scene, one, print)
    with tempfile.TemporaryDirectory(prefix="batch_overhead-") as tmp:
        trainers, states = [], []
        for name, cfg in (("single", one), ("batch", many)):
            seed_everything(cfg.train.seed)
            t = Trainer(cfg, scene, Path(tmp) / name, device, log=print)
            t.record = RunRecord(first_step=0, max_gaussians=0)
            trainers.append(t)
            states.append(_rng_state())
        blocks: list[tuple[float, float]] = []
        pe, te = one.log.progress_every, one.dev.time_every
        for _ in range(args.views // args.block):
            seconds = []
            for i, (t, steps) in enumerate(zip(trainers, (args.block, args.block // args.batch), strict=True)):
                _set_rng_state(states[i])
                seconds.append(_block(t, steps, pe, te, False))
                states[i] = _rng_state()
            blocks.append((seconds[0], seconds[1]))
        engines = [t.engine.name for t in trainers]
        for t in trainers:
            t.engine.settle()  # (the summary counts settled graph steps)
        graphs = [t.graphs.summary() if t.graphs is not None else None for t in trainers]
        counts = [len(t.params["means"]) for t in trainers]
    single, batch = sum(b[0] for b in blocks), sum(b[1] for b in blocks)
    result = {
        "scene": str(args.scene), "views": args.views, "batch": args.batch, "block": args.block, "sets": args.sets,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "engines": {"single": engines[0], "batch": engines[1]},
        "cuda_graphs": {"single": graphs[0], "batch": graphs[1]},
        "single_ms_per_view": 1e3 * single / args.views, "batch_ms_per_view": 1e3 * batch / args.views,
        "ratio_total": batch / single, "ratio_median_block": statistics.median(b / s for s, b in blocks),
        "gaussians_end": {"single": counts[0], "batch": counts[1]}, "blocks_s": blocks,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "blocks_s"}, indent=1))
    print(f"engines: single={engines[0]} batch={engines[1]}")
    if engines[0] != "graph" or engines[1] != "graph":
        print("warning: not graph against graph (dev.cuda_graphs off, not on a GPU, or a feature that runs eagerly)")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "batch_overhead.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
