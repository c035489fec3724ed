"""What an optional feature costs per training step: each variant (a config override) against the
defaults, paired in one process.

One trainer with the defaults and one per variant are built on the same scene, then train in
turn, BLOCK steps each, round after round to STEPS, the order turning by one every round: fit's
hot loop (the engine's step and the host sync every log.progress_every steps), each block timed
with the device synchronized at both ends.
Taking turns puts every trainer under the same clock, heat and neighbours. Logging, evaluation and
checkpoints are left out. Each trainer keeps its own random state, so it follows the trajectory a
run of its own would (its densification too: the Gaussian counts at the end are printed beside
the ratios).

    python -m bench.feature_cost SCENE --variant NAME=KEY=VALUE[,KEY=VALUE] [--variant ...]
                                 [--pipeline NAME ...] [--steps 2000] [--block 100] [--set KEY=VALUE ...]

--pipeline NAME: bench/bench_train.py's pipeline of that name as a variant (its --set,
--atomic-mode and --backend flags as overrides), e.g. `--pipeline appearance --pipeline bilateral`
times the per-image affine and the bilateral grid against the defaults in one call; add
`--variant bilateral_grid_sample=train.appearance=bilateral,dev.fused_bilateral=false` to time the
bilateral grid's F.grid_sample path beside its fused kernels in the same call.
`--set strategy.refine_start=100000` keeps every trainer at the scene's SfM points: with
densification on, identical trainers part (float atomics, then their densification and graph
redos) and their totals move by several percent, which hides a cost of 1-2% (the image path's).

Prints ms per step and the ratio to the defaults (total and median of the block ratios) for each
variant, and the engine each ran. Writes `$OUT/feature_cost.json` when OUT is set.
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


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition("=")
    if not name or not sets:
        raise argparse.ArgumentTypeError(f"--variant wants NAME=KEY=VALUE[,KEY=VALUE]; got {text!r}")
    return name, sets.split(",")


def pipeline_variant(name: str) -> tuple[str, list[str]]:
    """bench_train's pipeline `name` as (name, overrides): its flags, which name config keys, as KEY=VALUE."""
    from bench.bench_train import PIPELINES

    if name not in PIPELINES:
        raise argparse.ArgumentTypeError(f"unknown pipeline {name!r}; choose from {', '.join(PIPELINES)}")
    keys = {"--set": None, "--atomic-mode": "render.atomic_mode", "--backend": "render.backend"}
    flags, sets = PIPELINES[name], []
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        if flag not in keys:
            raise argparse.ArgumentTypeError(f"pipeline {name!r} has {flag}, which is no config key")
        sets.append(value if keys[flag] is None else f"{keys[flag]}={value}")
    return name, sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scene", type=Path)
    ap.add_argument("--variant", dest="variants", action="append", type=_variant, default=[])
    ap.add_argument("--pipeline", dest="pipelines", action="append", type=pipeline_variant, default=[],
                    help="a bench_train pipeline as a variant (e.g. appearance, bilateral)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override for every trainer")
    args = ap.parse_args()
    if not args.variants and not args.pipelines:
        ap.error("name at least one --variant or --pipeline")

    from gstrain.config import build_config, parse_override
    from gstrain.fit_run import _load_scene
    from gstrain.render import resolve_device
    from gstrain.threads import apply_threads
    from gstrain.train.run_record import RunRecord
    from gstrain.train.trainer import Trainer, _rng_state, _set_rng_state, seed_everything

    runs = [("defaults", [])] + list(args.variants) + list(args.pipelines)
    cfgs = [build_config([], [parse_override(s) for s in [f"train.steps={args.steps}", *args.sets, *sets]])
            for _, sets in runs]  # fmt: skip
    device = resolve_device(cfgs[0].train.device)
    apply_threads(cfgs[0].train.threads, device)
    with tempfile.TemporaryDirectory(prefix="feature_cost-") as tmp:
        trainers, states = [], []
        for (name, _), cfg in zip(runs, cfgs, strict=True):
            seed_everything(cfg.train.seed)
            # each its own load: data.images_on=disk keeps lazy views, decoded while it trains
            t = Trainer(cfg, _load_scene(args.scene, cfg, print), Path(tmp) / name, device, log=print)
            t.record = RunRecord(first_step=0, max_gaussians=0)
            trainers.append(t)
            states.append(_rng_state())
        seconds: list[list[float]] = [[] for _ in runs]
        pe, te = cfgs[0].log.progress_every, cfgs[0].dev.time_every
        for r in range(args.steps // args.block):
            # the order turns every round, so that each trainer runs in every position alike (on
            # the H200 the last of four identical trainers ran 10% faster than the first)
            for i in [(r + k) % len(trainers) for k in range(len(trainers))]:
                t = trainers[i]
                _set_rng_state(states[i])
                seconds[i].append(_block(t, args.block, pe, te, False))
                states[i] = _rng_state()
        rows = {}
        for (name, sets), t, secs in zip(runs, trainers, seconds, strict=True):
            rows[name] = {
                "sets": sets, "engine": t.engine.name, "gaussians_end": len(t.params["means"]),
                "ms_per_step": 1e3 * sum(secs) / args.steps,
                "ratio_total": sum(secs) / sum(seconds[0]),
                "ratio_median_block": statistics.median(s / b for s, b in zip(secs, seconds[0], strict=True)),
                "block_ms_per_step": [round(1e3 * s / args.block, 4) for s in secs],
                "images_note": t.image_store.note(),  # data.images_on=disk: whether steps waited for decodes
                "image_waits_at": getattr(t.image_store, "wait_at", []),  # (get number, seconds) of the first
            }  # fmt: skip
    result = {
        "scene": str(args.scene), "steps": args.steps, "block": args.block, "sets": args.sets,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "runs": rows,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "feature_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
