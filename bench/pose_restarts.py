"""Pose refinement restarted from the SfM points: does a scene refitted from scratch to the refined
poses pull them further? (issue 36's 5x pose known answer; bench/NOTES.md).

The known answer's set-up (tests/test_pose_refine.py: the demo scene, 16 views, 1 degree and 1% of
the extent on perturbation --seed, sh_degree 0, no densification, the ten-direction gauge). Each of
--rounds rounds builds a fresh Trainer from the scene's SfM points whose training poses are the
previous round's refined ones, and trains scene and poses jointly for --steps (pose rate --pose-lr
decayed tenfold), so the gauge holds the previous round's poses. Prints the aligned errors against
the true poses, the common rotation and mean |pitch, yaw, roll| (the true cameras' frames) and the
test PSNR after each round.

    PYTHONPATH=. python -m bench.pose_restarts --seed 1 --rounds 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.pose_schedule import Schedule, axis_errors, perturbed
from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.data.demo import write_demo_scene
from gstrain.train.pose_align import pose_errors
from gstrain.train.run_record import RunRecord
from gstrain.train.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="perturbation seed")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500, help="joint steps a round")
    parser.add_argument("--pose-lr", type=float, default=5e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    arrays = lambda views: [v.viewmat.double().numpy() for v in views]  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_demo_scene(Path(tmp) / "scene", n_views=16, width=args.size, height=args.size, seed=0)
        truth = list(load_scene(folder).train)
        extent = load_scene(folder).extent
        current = perturbed(truth, extent, args.seed)
        rot, centre = pose_errors(arrays(current), arrays(truth), extent, align=True)
        print(f"seed {args.seed} given: aligned {rot:.3f} deg / {centre:.4f}")
        for index in range(args.rounds):
            scene = load_scene(folder)
            scene.train = current
            cfg = build_config(overrides=[{
                "train": {"steps": args.steps, "device": "cpu", "pose_refine": True},
                "optim": {"pose_lr": args.pose_lr, "pose_lr_final": args.pose_lr / 10},
                "model": {"sh_degree": 0}, "strategy": {"refine_start": 10**6},
                "log": {"progress_every": 10**6, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [],
                        "save_steps": []},
            }])  # fmt: skip
            trainer = Trainer(cfg, scene, Path(tmp) / f"run{index}", torch.device("cpu"), log=lambda m: None)
            trainer._begin(False, None)  # seeded as fit seeds a new run
            trainer.record = RunRecord(first_step=0, max_gaussians=trainer.gaussian_count())
            schedule = Schedule(trainer, args.steps, args.pose_lr, args.pose_lr / 10, True, args.seed)
            schedule.scene_steps(args.steps, poses_learn=True)
            current = trainer.pose_refiner.refined(current)
            rot, centre = pose_errors(arrays(current), arrays(truth), extent, align=True)
            axes = axis_errors(arrays(current), arrays(truth))
            common, mean_abs = np.round(axes.mean(axis=0), 3).tolist(), np.round(np.abs(axes).mean(axis=0), 3).tolist()
            psnr, seconds = trainer.evaluate_test()["psnr"], time.perf_counter() - began
            print(f"round {index}: aligned {rot:.3f} deg / {centre:.4f}; common (pitch, yaw, roll) {common}, "
                  f"mean |.| {mean_abs}; test PSNR {psnr:.2f} dB; {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
