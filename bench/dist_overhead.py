"""W=1 through the distributed path against the plain trainer, paired in one process.

Both trainers are built on the same scene and config in one process (a one-rank process group:
NCCL on a GPU, gloo on the CPU) and train alternately, BLOCK steps each, to STEPS: the hot loop of
`gstrain fit` (train_step, and every log.progress_every steps the host sync: float(loss) for the
plain trainer, the ranks' agreement for the distributed one), timed per block with the device
synchronized at both ends. Logging, evaluation and checkpoints are left out: they are per-run
costs, timed separately at the end (the distributed trainer's end-of-run gather and save against
the plain trainer's). Alternating blocks puts both under the same clock, heat and neighbours, so
the ratio is free of the run-to-run spread two separate `gstrain fit` runs show.

    python -m bench.dist_overhead SCENE [--steps 3000] [--block 100] [--set KEY=VALUE ...]

Prints per-trainer ms/step, the ratio (total and median of the block ratios), Gaussian counts at
the end (the two did the same work), and the end-of-run costs. Writes `$OUT/dist_overhead.json`
when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gstrain.train.timing import timed_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _block(trainer, steps: int, progress_every: int, time_every: int, agree: bool) -> float:
    """Seconds for `steps` steps of fit's hot loop (device synchronized at both ends)."""
    _sync(trainer.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.timer.enabled = timed_step(trainer.step, time_every)
        loss = trainer.train_step(trainer.step)[0]
        trainer.step += 1
        if trainer.step % progress_every == 0:
            trainer.engine.settle()  # as fit does before it reads the loss (a graph step's redo, if any)
            if agree:
                trainer._agree(loss, False, False)
            else:
                float(loss)
    _sync(trainer.device)
    seconds = time.perf_counter() - t0
    trainer.timer.summary()  # drain the phase events outside the timed part, as fit's logging does
    return seconds


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scene", type=Path)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override KEY=VALUE")
    args = ap.parse_args()

    from gstrain.config import build_config, parse_override
    from gstrain.distributed.launch import init_from_env
    from gstrain.distributed.local import free_port
    from gstrain.distributed.trainer import DistTrainer
    from gstrain.fit_run import _load_scene
    from gstrain.render import resolve_device
    from gstrain.threads import apply_threads
    from gstrain.train.run_record import RunRecord
    from gstrain.train.trainer import Trainer, _rng_state, _set_rng_state, seed_everything

    cfg = build_config([], [parse_override(s) for s in [f"train.steps={args.steps}", *args.sets]])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))  # fmt: skip
    _, _, device = init_from_env(resolve_device(cfg.train.device), cfg.dist.timeout_s, cfg.dist.backend)
    apply_threads(cfg.train.threads, device)
    scene = _load_scene(args.scene, cfg, print)
    with tempfile.TemporaryDirectory(prefix="dist_overhead-") as tmp:
        # each trainer keeps its own random state (densification draws from it), swapped in
        # around its blocks, so both follow the trajectory a run of their own would
        seed_everything(cfg.train.seed)
        plain = Trainer(cfg, scene, Path(tmp) / "plain", device, log=print)
        seed_everything(cfg.train.seed)
        rng_plain = _rng_state()
        sharded = DistTrainer(cfg, scene, Path(tmp) / "sharded", device, log=print)
        seed_everything(cfg.train.seed)
        sharded._distribute()  # as DistTrainer.fit begins: the (one-rank) partition
        rng_sharded = _rng_state()
        for t in (plain, sharded):
            t.record = RunRecord(first_step=0, max_gaussians=0)
        blocks: list[tuple[float, float]] = []
        pe, te = cfg.log.progress_every, cfg.dev.time_every
        from tqdm import tqdm

        for _ in tqdm(range(0, args.steps, args.block), desc="blocks"):
            n = min(args.block, args.steps - plain.step)
            _set_rng_state(rng_plain)
            seconds_plain = _block(plain, n, pe, te, False)
            rng_plain = _rng_state()
            _set_rng_state(rng_sharded)
            seconds_sharded = _block(sharded, n, pe, te, True)
            rng_sharded = _rng_state()
            blocks.append((seconds_plain, seconds_sharded))
        end_plain = _timed(lambda: (plain.save(wait=True), plain.export_ply()), device)
        end_sharded = _timed(lambda: (sharded.save(), sharded._export()), device)
        counts = (len(plain.params["means"]), len(sharded.params["means"]))
    total_plain, total_sharded = sum(b[0] for b in blocks), sum(b[1] for b in blocks)
    result = {
        "scene": str(args.scene), "steps": args.steps, "block": args.block, "sets": args.sets,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": sharded.renderer.backend, "process_group": dist.get_backend(),
        "plain_ms_per_step": 1e3 * total_plain / args.steps,
        "w1_ms_per_step": 1e3 * total_sharded / args.steps,
        "ratio_total": total_sharded / total_plain,
        "ratio_median_block": statistics.median(s / p for p, s in blocks),
        "gaussians_end": {"plain": counts[0], "w1": counts[1]},
        "end_of_run_s": {"plain save+ply": end_plain, "w1 save+gather+ply": end_sharded},
        "blocks_s": blocks,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "blocks_s"}, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "dist_overhead.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
