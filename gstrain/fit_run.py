"""`gstrain fit` from flags to a finished run: check everything, load, write, train, report.

The order is the point: every check that can fail runs before the first write, the run folder
is written only after the scene has loaded, and whatever stops the run after that (an error,
a second Ctrl-C, SIGTERM, a full disk) ends with a line that says what the folder kept.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gstrain.errors import UserError

Log = Callable[[str], None]


@dataclass
class FitRequest:
    scene: Path
    out: Path | None = None
    resume: bool = False
    config_files: list[Path] = field(default_factory=list)
    overrides: list[dict[str, Any]] = field(default_factory=list)  # flag mappings, before --set
    sets: list[str] = field(default_factory=list)  # --set section.key=value, in order
    allow_older: bool = False
    viewer: bool = False  # fit --viewer: the live page (gstrain/viewer/live.py)


def _load_scene(scene: Path, cfg: Any, log: Log) -> Any:
    from gstrain.data.image_store import scene_is_lazy
    from gstrain.data.inputs import load_scene
    from gstrain.render import resolve_device
    messages: list[str] = []  # held back so that bad input still ends with exactly one line
    try:
        loaded = load_scene(scene, factor=cfg.data.factor, test_every=cfg.data.test_every, log=messages.append,
                            background=cfg.data.background, max_side=cfg.data.max_side,
                            lazy=scene_is_lazy(cfg.data.images_on, resolve_device(cfg.train.device)))
    except KeyboardInterrupt:
        log("gstrain: interrupted while loading the scene; nothing was written")
        raise
    if len(loaded.points) == 0 and cfg.model.init != "random" and loaded.points_expected:
        raise UserError(
            f"the sparse model in {scene} has no 3D points; pass --set model.init=random to start from random points"
        )
    for note in [*messages, *loaded.notes]:
        log(note if note.startswith("gstrain:") else f"gstrain: {note}")
    return loaded


def _fit_command() -> str:
    """`gstrain fit`, or its torchrun form when this process is one of several ranks."""
    if "RANK" not in os.environ or os.environ.get("WORLD_SIZE", "1") == "1":
        return "gstrain fit"
    return f"torchrun --nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])} -m gstrain fit"


def kept_line(run_dir: Path, scene: Path) -> str:
    """What a stopped run folder holds, and the command that goes on from it."""
    from gstrain.train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    again = f"{_fit_command()} {scene} --out {run_dir} --resume"
    if found:
        step, path = found[-1]
        return f"gstrain: {run_dir} keeps checkpoint {path} (step {step}); go on with: {again}"
    return f"gstrain: {run_dir} holds no checkpoint yet; {again} starts it at step 0"


def run_fit(req: FitRequest, log: Log) -> int:
    """Train as asked; returns the exit code (0 done or paused, 130 interrupted, 3 NaN)."""
    from gstrain.config import build_config, parse_override
    from gstrain.distributed.launch import finish_process_group, init_from_env, on_rank_zero, torchrun_world
    from gstrain.render import resolve_device
    from gstrain.run_dir import (
        check_new_run_dir,
        check_scene_fits,
        commit_resume,
        create_run_dir,
        default_run_dir,
        plan_resume,
    )
    from gstrain.threads import apply_threads
    from gstrain.train.run_record import seconds_since_process_start

    scene = req.scene
    if not scene.exists():
        raise UserError(f"scene folder not found: {scene}")
    overrides = [*req.overrides, *(parse_override(s) for s in req.sets)]
    plan = None
    if req.resume:
        run_dir = req.out or Path("runs") / scene.resolve().name
        plan = plan_resume(run_dir, scene, req.config_files, overrides, req.allow_older, log)
        cfg = plan.cfg
    else:
        cfg = build_config(req.config_files, overrides)
        run_dir = req.out or default_run_dir(scene)
        reuse = check_new_run_dir(run_dir)
    if req.viewer:  # bad input before the scene loads
        from gstrain.viewer.serve import check_host

        check_host(cfg.viewer.host, "viewer.host")
    dev = resolve_device(cfg.train.device)
    world = torchrun_world(cfg.dev.always_distributed)
    if world:  # under torchrun: one process per GPU, each owning a shard (gstrain/distributed)
        _rank, world, dev = init_from_env(dev, cfg.dist.timeout_s, cfg.dist.backend)
    threads = apply_threads(cfg.train.threads, dev, log)
    # start-up phases before the trainer's own, for train_summary.json's startup_phases
    phases = {"interpreter, imports and config": seconds_since_process_start() or 0.0}
    began = time.perf_counter()
    loaded = _load_scene(scene, cfg, log)
    phases["scene"] = time.perf_counter() - began
    view = loaded.train[0] if loaded.train else loaded.test[0]
    log(
        f"gstrain: {len(loaded.train)} train / {len(loaded.test)} test views at {view.width}x{view.height}, "
        f"{len(loaded.points)} SfM points, device {dev}" + (f", {threads} CPU threads" if dev.type == "cpu" else "")
    )
    from gstrain.run_dir import is_run_dir
    from gstrain.run_lock import RunLock
    from gstrain.train.memory_budget import check_budget_first
    from gstrain.train.trainer import Trainer

    check_budget_first(cfg, loaded)  # train.max_memory_gib too small: said before the run folder is written
    if plan is not None:
        check_scene_fits(plan, loaded, scene)
    elif reuse:
        log(f"gstrain: reusing {run_dir}: an earlier fit there stopped before its first checkpoint")
    live = None
    if req.viewer:  # before the run folder is written: a busy port is bad input like any other
        from gstrain.viewer.live import LiveViewer

        def serve() -> None:  # rank 0 serves the page; its error is every rank's
            nonlocal live
            live = LiveViewer(cfg, loaded, log=log)

        on_rank_zero(serve)
    trainer = None
    lock = RunLock(run_dir)  # one fit writes a run folder at a time (gstrain/run_lock.py)
    try:  # from the first write on, whatever stops the run says what the folder kept
        if plan is not None:  # rank 0 writes (and locks); its error is every rank's
            on_rank_zero(lambda: commit_resume(run_dir, plan, log, lock))
        else:
            on_rank_zero(lambda: create_run_dir(run_dir, scene, cfg, lock))
        if world:
            from gstrain.distributed.trainer import DistTrainer

            trainer = DistTrainer(cfg, loaded, run_dir, dev, log=log)
        else:
            trainer = Trainer(cfg, loaded, run_dir, dev, log=log)
        trainer.setup_seconds = {**phases, **trainer.setup_seconds}
        trainer.watch(live, cfg.viewer.refresh_every if req.viewer else 0)  # rank 0 serves the page
        result = trainer.fit(resume=req.resume, state=plan.state if plan is not None else None)
    except KeyboardInterrupt:
        _finish_checkpoint(trainer)
        if is_run_dir(run_dir) and lock.held:  # no lock: this fit wrote nothing there
            log("gstrain: stopped at once (a second interrupt, or one before training began)")
            log(kept_line(run_dir, scene))
        raise
    except BaseException:
        _finish_checkpoint(trainer)  # the kept line names what is on disk, writes included
        if is_run_dir(run_dir) and lock.held:
            log(kept_line(run_dir, scene))
        raise
    finally:
        if live is not None:
            live.close()
        finish_process_group()
        lock.release()
    return _report(result, cfg, scene, run_dir, log)


def _finish_checkpoint(trainer: Any) -> None:
    """A checkpoint the writer thread is still writing goes on to disk before the process ends:
    the interpreter's exit would otherwise stop that thread inside torch.save (a native abort),
    and the folder would keep one checkpoint less than it says."""
    writer = getattr(trainer, "checkpoints", None)
    if writer is None:
        return
    try:
        writer.wait()
    except Exception:  # noqa: BLE001 - a failed write: the kept line names what is on disk
        pass


def _report(result: Any, cfg: Any, scene: Path, run_dir: Path, log: Log) -> int:
    took = f"{result.status} at step {result.step} in {result.seconds:.1f}s"
    if result.startup_s is not None:  # the command's own start-up, before the first step
        took += f" (after {result.startup_s:.1f}s of start-up)"
    parts = [took, f"{result.num_gaussians} Gaussians"]
    if result.initial_test_psnr is not None:
        parts.append(f"test PSNR {result.initial_test_psnr:.2f} -> {result.final_test_psnr or float('nan'):.2f} dB")
    elif result.final_test_psnr is not None:
        parts.append(f"test PSNR {result.final_test_psnr:.2f} dB")
    log("gstrain: " + ", ".join(parts) + f"; run folder {run_dir}")
    if result.status == "interrupted":
        log(f"gstrain: resume with: {_fit_command()} {scene} --out {run_dir} --resume")
        return 130
    if result.status == "stopped":
        log(f"gstrain: paused at train.stop_at={cfg.train.stop_at} of {cfg.train.steps} steps; go on with: "
            f"{_fit_command()} {scene} --out {run_dir} --resume --set train.stop_at=0")
    if result.status == "nan":
        return 3
    return 0
