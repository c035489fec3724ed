"""How far two pipelines' training steps drift apart from one shared state, on a real scene.

Each speed switch has a unit test against what it replaces, on small inputs. This asks the same
question on the real workload: train one model to `--warmup` steps, then continue two copies of
it in lockstep (same views, same order), one per pipeline of a pair, and measure how far their
parameters and densification statistics drift. Float atomics alone make two runs of the *same*
pipeline drift; so pair each pipeline with itself too, for the floor. A switch that changes the
arithmetic shows a gap far above that floor from the first step on.

    python -m bench.step_divergence SCENE --warmup 7001 --steps 1,10,99 \\
        --pairs gstrain:gstrain,gstrain:baseline,gstrain:gsplat-raster,gstrain:conv-ssim

The comparison window should lie between two densification steps, so both copies keep the same
Gaussians: gsplat refines after step s when s % refine_every == 0 (7000, 7100, ...), so the
default split at 7001 leaves 99 steps. The script stops a pair early, and says so, if their
counts differ. Pipelines are bench_train.py's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.bench_train import PIPELINES


def overrides_from_flags(flags: list[str]) -> list[dict[str, Any]]:
    """bench_train's fit flags (--backend X, --atomic-mode X, --set k=v) as config overrides."""
    from gstrain.config import parse_override

    out: list[dict[str, Any]] = []
    it = iter(flags)
    for flag in it:
        value = next(it)
        if flag in ("--atomic-mode", "--backend"):
            out.append({"render": {flag[2:].replace("-", "_"): value}})
        elif flag == "--set":
            out.append(parse_override(value))
        else:
            raise ValueError(f"unsupported pipeline flag {flag}")
    return out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30))


def divergence(a, b) -> dict[str, float]:
    """Largest relative difference over the parameter tensors, and over the strategy's statistics."""
    params = max(rel_diff(a.params[k].detach(), b.params[k].detach()) for k in a.params)
    stats = [rel_diff(a.strategy.state[k], b.strategy.state[k]) for k in ("grad2d", "count")
             if torch.is_tensor(a.strategy.state.get(k)) and torch.is_tensor(b.strategy.state.get(k))]
    return {"params": params, "stats": max(stats) if stats else float("nan")}


def make_trainer(scene, cfg_overrides: list[dict[str, Any]], base: list[dict[str, Any]], device, run_dir: Path):
    from gstrain.config import build_config
    from gstrain.train.trainer import Trainer

    cfg = build_config(overrides=[*base, *cfg_overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, scene, run_dir, device, log=lambda m: None)
    trainer.timer.enabled = False  # nothing reads phase times here; events would pile up unread
    return trainer


def step(trainer) -> float:
    """One training step (each trainer's StepRunner carries its own loss)."""
    loss, _, _, _ = trainer.train_step(trainer.step)
    trainer.step += 1
    return float(loss)


def compare_pair(scene, snapshot: dict, names: tuple[str, str], checkpoints: list[int], base, device,
                 workdir: Path) -> dict[str, Any]:  # fmt: skip
    """Continue two copies of `snapshot` under the two pipelines; their drift at each checkpoint step."""
    from gstrain.train.checkpoint import to_host

    pair = []
    for i, name in enumerate(names):
        trainer = make_trainer(scene, overrides_from_flags(PIPELINES[name]), base, device, workdir / f"{name}_{i}")
        trainer.load_state_dict(to_host(snapshot))  # a copy each: the two must not share tensors
        pair.append(trainer)
    a, b = pair
    rows, first_loss = {}, None
    for k in range(1, max(checkpoints) + 1):
        la, lb = step(a), step(b)
        if first_loss is None:
            first_loss = abs(la - lb) / max(abs(la), 1e-30)
        if len(a.params["means"]) != len(b.params["means"]):
            return {"loss": first_loss, "at": rows, "stopped": f"step {k}: {len(a.params['means'])} vs "
                    f"{len(b.params['means'])} Gaussians"}  # fmt: skip
        if k in checkpoints:
            rows[k] = divergence(a, b)
    return {"loss": first_loss, "at": rows, "stopped": None}


def warm_state(scene, pipeline: str, warmup: int, base, device, workdir: Path) -> tuple[dict, int]:
    """Train `pipeline` for `warmup` steps from the seeded start; its state and Gaussian count."""
    from gstrain.train.trainer import seed_everything

    seed_everything(0)
    trainer = make_trainer(scene, overrides_from_flags(PIPELINES[pipeline]), base, device, workdir / "warmup")
    for _ in range(warmup):
        step(trainer)
    return trainer.state_dict(), len(trainer.params["means"])


def main(argv: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path)
    ap.add_argument("--warmup", type=int, default=7001, help="steps trained before the copies part")
    ap.add_argument("--warmup-pipeline", default="gstrain")
    ap.add_argument("--steps", default="1,10,99", help="steps after the split at which to measure")
    ap.add_argument("--pairs", default="gstrain:gstrain,gstrain:baseline",
                    help="A:B,... of " + ", ".join(PIPELINES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--factor", type=int, default=1)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override for every trainer (section.key=value), repeatable")
    args = ap.parse_args(argv)

    from gstrain.config import parse_override
    from gstrain.data.inputs import load_scene

    checkpoints = sorted({int(s) for s in args.steps.split(",")})
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    unknown = ({n for p in pairs for n in p} | {args.warmup_pipeline}) - PIPELINES.keys()
    if unknown or any(len(p) != 2 for p in pairs):
        ap.error(f"pipelines are {', '.join(PIPELINES)}; pairs are A:B; got {args.pairs}, {args.warmup_pipeline}")
    device = torch.device(args.device)
    base = [{"data": {"factor": args.factor}, "train": {"device": args.device}},
            *(parse_override(s) for s in args.sets)]  # fmt: skip
    scene = load_scene(args.scene, factor=args.factor)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        snapshot, count = warm_state(scene, args.warmup_pipeline, args.warmup, base, device, workdir)
        print(f"split after {args.warmup} steps of {args.warmup_pipeline}: {count:,} Gaussians; "
              f"relative difference of A and B (largest over the parameter tensors; strategy statistics)")
        print("| pair | loss, step 1 | " + " | ".join(f"params, step {k}" for k in checkpoints)
              + f" | statistics, step {checkpoints[-1]} | note |")
        print("|---" * (len(checkpoints) + 4) + "|")
        for names in pairs:
            r = compare_pair(scene, snapshot, names, checkpoints, base, device, workdir)
            cells = [f"{r['at'][k]['params']:.2e}" if k in r["at"] else "–" for k in checkpoints]
            last = r["at"].get(checkpoints[-1])
            print(f"| {names[0]} : {names[1]} | {r['loss']:.2e} | " + " | ".join(cells)
                  + f" | {'–' if last is None else format(last['stats'], '.2e')} | {r['stopped'] or ''} |",
                  flush=True)
            results.append((f"{names[0]}:{names[1]}", r))
    return results


if __name__ == "__main__":
    main()
