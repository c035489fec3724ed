"""Pose refinement by schedule on the demo known answer (issue 36 item 3): joint training against
block-coordinate schedules, on the CPU.

The known answer of tests/test_pose_refine.py: the demo scene (16 views at 64 px, 14 training),
every training pose moved by 1 degree about a random axis and 1% of the extent in a random
direction (perturbation seed 1 by default), sh_degree 0, no densification, pose rate 5e-3 -> 5e-4.
Schedules (--schedule):

  joint       the scene and the poses learn at every step (train.pose_refine as it ships)
  alternate   --rounds rounds of --scene-block scene-only steps (poses held) then --pose-block
              pose-only steps (the scene held, its Adam untouched), optionally --polish joint
              steps at the end
              (--joint-blocks: the scene blocks are joint steps, the poses learning too)
  late        --scene-steps scene-only steps, --pose-steps pose-only steps, then --polish joint

The scene-only steps are the trainer's own step with the pose update dropped (the renders still
go through the current corrections). A pose-only step renders one training view (cycled in a
shuffled order) through the current correction with the scene's tensors held, takes the
trainer's photometric loss and steps the per-view Adam. --pose-gauge off drops the gauge
projection in pose-only steps (a held scene pins the frame); the joint steps keep it. The pose
rate decays exponentially from --pose-lr to --pose-lr-final over all the steps that update poses.

--newton N: N Gauss-Newton sweeps per pose block instead of Adam steps: per view, the 6x6 normal
equations of the squared residual from a central-difference Jacobian of the render (12 renders),
Levenberg damped, then the gauge projected out if --pose-gauge on.

--distances D1,D2,...: the demo scene's cameras at those distances from the sphere, cycled over
the views (data/demo.py; default: all at 4.5); --elevations E1,E2,...: one ring of cameras per
elevation in degrees (default: 18,42). --gauge ten holds the product's ten gauge
directions (a similarity of the world and a common rotation in the cameras' frames,
train/pose_gauge.py); seven holds the similarity alone. --plain also trains the same perturbed
scene without pose refinement (as train.pose_refine=false ships, the same scene steps) and reports
its test PSNR. --set section.key=value (repeatable) overrides a config key after the script's own
settings, for both trainers (e.g. --set strategy.refine_start=100 turns densification on; a
model.sh_degree above 0 needs a train.sh_degree_interval under the steps to take effect).
--views N and --size S: the demo scene's view count (default 16, every 8th held
out) and image side in pixels (default 64). --gauge-free draws the perturbation orthogonal to the
ten held gauge directions, each view still moved by exactly 1 degree and 1% (perturbed()).

Prints (and with --json writes) the aligned (umeyama) and raw mean rotation (degrees) and centre
(fraction of the extent) errors before and after, their ratios, and the test PSNR.

    PYTHONPATH=. python -m bench.pose_schedule --schedule alternate --scene-block 200 --pose-block 100 --rounds 3
    PYTHONPATH=. python -m bench.pose_schedule --distances 3,4.5,6.5 --gauge seven --plain
    PYTHONPATH=. python -m bench.pose_schedule --views 32 --size 128 --plain
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gstrain.config import build_config, parse_override
from gstrain.data.colmap import load_scene
from gstrain.data.demo import write_demo_scene
from gstrain.errors import UserError
from gstrain.train.pose_align import pose_errors, umeyama
from gstrain.train.pose_gauge import gauge_basis, without_gauge
from gstrain.train.pose_refine import correction_matrices
from gstrain.train.run_record import RunRecord
from gstrain.train.trainer import Trainer


def perturbed(views: list[Any], extent: float, seed: int, degrees: float = 1.0, fraction: float = 0.01,
              gauge_free: bool = False) -> list[Any]:
    """Each view's pose moved by `degrees` about a random axis and `fraction` of the extent in a
    random direction, in its camera frame (the same draw as the known-answer test's).

    gauge_free: the draws are then made orthogonal to the ten held gauge directions at the true
    poses (train/pose_gauge.py), by alternating projection and renormalisation of each view's
    rotation and translation, so each view still moves by exactly `degrees` and `fraction`."""
    rng = np.random.default_rng(seed)
    draws = []
    for _ in views:
        axis, direction = (v / np.linalg.norm(v) for v in rng.normal(size=(2, 3)))
        draws.append(np.concatenate([axis * math.radians(degrees), direction * fraction]))
    delta = torch.tensor(np.array(draws))
    zero_pivots = torch.zeros(len(views), dtype=torch.float64)
    if gauge_free:
        basis = gauge_basis([v.viewmat for v in views], zero_pivots, extent)
        for _ in range(200):
            delta = without_gauge(delta, basis)
            delta[:, :3] *= math.radians(degrees) / delta[:, :3].norm(dim=1, keepdim=True)
            delta[:, 3:] *= fraction / delta[:, 3:].norm(dim=1, keepdim=True)
        left = (basis.T @ delta.reshape(-1, 1)).norm() / delta.norm()
        print(f"  gauge-free perturbation: {float(left):.1e} of it left in the gauge")
    fixes = correction_matrices(delta, extent, zero_pivots)
    return [dataclasses.replace(view, viewmat=(fix @ view.viewmat.double()).float())
            for view, fix in zip(views, fixes, strict=True)]


def axis_errors(estimated: list[np.ndarray], truth: list[np.ndarray]) -> np.ndarray:
    """Per view [V,3], the aligned rotation error as an axis-angle in the true camera's frame
    (degrees; x pitch, y yaw, z roll): the rotation that takes the estimated camera, after the
    similarity that best maps the estimated centres onto the true ones, back to the true one. Its
    mean over the views is the common rotation in the cameras' frames."""
    centre = lambda m: -m[:3, :3].T @ m[:3, 3]  # noqa: E731
    _, rot, _ = umeyama(np.array([centre(m) for m in estimated]), np.array([centre(m) for m in truth]))
    out = []
    for est, true in zip(estimated, truth, strict=True):
        err = true[:3, :3] @ rot @ est[:3, :3].T
        angle = math.acos(min(max((np.trace(err) - 1) / 2, -1.0), 1.0))
        axis = np.array([err[2, 1] - err[1, 2], err[0, 2] - err[2, 0], err[1, 0] - err[0, 1]]) / 2
        out.append(np.degrees(axis * angle / math.sin(angle)) if angle > 1e-12 else np.zeros(3))
    return np.array(out)


class Schedule:
    """Drives a Trainer's scene steps and its PoseRefiner by phase."""

    def __init__(self, trainer: Trainer, pose_updates: int, lr: float, lr_final: float, pose_gauge: bool,
                 seed: int) -> None:  # fmt: skip
        self.trainer = trainer
        self.refiner = trainer.pose_refiner
        self.refiner.start = 0  # every render goes through the corrections
        self.gauge = self.refiner.gauge
        self.pose_gauge = pose_gauge
        self.total, self.done = max(pose_updates, 1), 0
        self.lr, self.lr_final = lr, lr_final
        self.refiner.rate = self._rate  # the refiner reads its rate per update
        self.order = np.random.default_rng(seed).permutation(len(trainer.scene.train))
        self.cursor = 0
        self.params = list(trainer.params.values())

    def _rate(self, _step: int) -> float:
        frac = min(self.done / self.total, 1.0)
        return self.lr * math.exp(frac * math.log(self.lr_final / self.lr))

    def scene_steps(self, count: int, poses_learn: bool) -> None:
        trainer, refiner = self.trainer, self.refiner
        refiner.gauge = self.gauge
        for _ in range(count):
            if poses_learn:
                trainer.train_step(trainer.step)
                self.done += 1
            else:
                refiner.after_step = self._drop_pose_update  # shadows the method for this step
                try:
                    trainer.train_step(trainer.step)
                finally:
                    del refiner.after_step
            trainer.step += 1

    def _drop_pose_update(self, _step: int) -> None:
        self.refiner._rendered = []
        self.refiner.delta.grad = None

    def _next_view(self) -> int:
        index = int(self.order[self.cursor % len(self.order)])
        self.cursor += 1
        return index

    def _render(self, index: int, delta_row: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        trainer, refiner = self.trainer, self.refiner
        view = trainer.batch_view(index)
        if delta_row is None:
            viewmat = refiner.camera(view.viewmat, view, trainer.step)
        else:
            fix = correction_matrices(delta_row[None], refiner.extent, refiner.pivots[index : index + 1])
            viewmat = fix[0].to(view.viewmat) @ view.viewmat
        image, _, _ = trainer.renderer(trainer.params, viewmat, view.K, view.gt.shape[1], view.gt.shape[0],
                                       0, trainer.background)  # fmt: skip
        return image, view

    def pose_steps(self, count: int) -> None:
        trainer, refiner = self.trainer, self.refiner
        refiner.gauge = self.gauge if self.pose_gauge else None
        for p in self.params:
            p.requires_grad_(False)
        try:
            for _ in range(count):
                index = self._next_view()
                image, view = self._render(index)
                loss, _ = trainer.runner.view_loss(image, view, trainer.background)
                loss.backward()
                refiner.after_step(trainer.step)
                self.done += 1
        finally:
            for p in self.params:
                p.requires_grad_(True)
            refiner.gauge = self.gauge

    @torch.no_grad()
    def newton_sweeps(self, sweeps: int, damping: float = 1e-2, eps: float = 1e-3) -> None:
        """Per view: one Levenberg-damped Gauss-Newton step on the squared residual of its render."""
        refiner = self.refiner
        n_views = len(refiner.delta)
        for _ in range(sweeps):
            new = refiner.delta.detach().clone()
            for index in range(n_views):
                row = refiner.delta.detach()[index]
                base, view = self._render(index, row)
                residual = (base - view.gt).reshape(-1)
                jac = torch.zeros(residual.numel(), 6)
                for k in range(6):
                    step = torch.zeros(6)
                    step[k] = eps
                    plus, _ = self._render(index, row + step)
                    minus, _ = self._render(index, row - step)
                    jac[:, k] = (plus - minus).reshape(-1) / (2 * eps)
                normal = jac.T @ jac
                normal = normal + damping * torch.diag(normal.diagonal()).clamp_min(1e-12)
                new[index] = row - torch.linalg.solve(normal, jac.T @ residual)
            if self.pose_gauge and self.gauge is not None:
                new = without_gauge(new, self.gauge)
            refiner.delta.data.copy_(new)


def plain_psnr(folder: Path, run_dir: Path, args: argparse.Namespace) -> float:
    """Test PSNR of the same perturbed scene trained for --steps without pose refinement."""
    scene = load_scene(folder)
    scene.train = perturbed(list(scene.train), scene.extent, args.seed, args.degrees, args.fraction, args.gauge_free)
    cfg = build_config(overrides=[{
        "train": {"steps": args.steps, "device": "cpu", "pose_refine": False},
        "model": {"sh_degree": 0}, "strategy": {"refine_start": 10**6},
        "log": {"progress_every": 10**6, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [], "save_steps": []},
    }, *args.set])  # fmt: skip
    return float(Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None).fit().final_test_psnr)


def run(args: argparse.Namespace) -> dict[str, Any]:
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_demo_scene(Path(tmp) / "scene", n_views=args.views, width=args.size, height=args.size, seed=0,
                                  distances=args.distances, elevations=args.elevations)  # fmt: skip
        scene = load_scene(folder)
        truth = list(scene.train)
        scene.train = perturbed(truth, scene.extent, args.seed, args.degrees, args.fraction, args.gauge_free)
        given = list(scene.train)
        if args.schedule == "joint":
            scene_total, pose_updates = args.steps, args.steps
        elif args.schedule == "alternate":
            scene_total = args.rounds * args.scene_block + args.polish
            pose_block = 0 if args.newton else args.pose_block
            pose_updates = args.rounds * (pose_block + args.scene_block * args.joint_blocks) + args.polish
        else:
            scene_total = args.scene_steps + args.polish
            pose_updates = (0 if args.newton else args.pose_steps) + args.polish
        cfg = build_config(overrides=[{
            "train": {"steps": scene_total, "device": "cpu", "pose_refine": True},
            "optim": {"pose_lr": args.pose_lr, "pose_lr_final": args.pose_lr_final},
            "model": {"sh_degree": 0}, "strategy": {"refine_start": 10**6},
            "log": {"progress_every": 10**6, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [], "save_steps": []},
        }, *args.set])  # fmt: skip
        trainer = Trainer(cfg, scene, Path(tmp) / "run", torch.device("cpu"), log=lambda m: None)
        trainer._begin(False, None)  # seeded as fit seeds a new run
        trainer.record = RunRecord(first_step=0, max_gaussians=trainer.gaussian_count())
        refiner = trainer.pose_refiner
        if args.gauge == "seven":  # before Schedule, which keeps the refiner's gauge
            refiner.gauge = gauge_basis(refiner.viewmats, refiner.pivots, refiner.extent,
                                        common_rotation=False).to(refiner.delta.device)  # fmt: skip
        sched = Schedule(trainer, pose_updates, args.pose_lr, args.pose_lr_final, args.pose_gauge == "on", args.seed)
        arrays = lambda views: [v.viewmat.double().numpy() for v in views]  # noqa: E731
        phases: list[tuple[str, float, float]] = []

        def phase_done(name: str) -> None:  # the aligned errors after each phase
            now = pose_errors(arrays(trainer.pose_refiner.refined(given)), arrays(truth), scene.extent, align=True)
            phases.append((name, *now))

        def pose_phase(updates: int) -> None:
            if args.newton:
                sched.newton_sweeps(args.newton)
            else:
                sched.pose_steps(updates)
            phase_done("pose")

        if args.schedule == "joint":
            sched.scene_steps(args.steps, poses_learn=True)
        elif args.schedule == "alternate":
            for _ in range(args.rounds):
                sched.scene_steps(args.scene_block, poses_learn=args.joint_blocks)
                phase_done("joint" if args.joint_blocks else "scene")
                pose_phase(args.pose_block)
        else:
            sched.scene_steps(args.scene_steps, poses_learn=False)
            pose_phase(args.pose_steps)
        if args.polish:
            sched.scene_steps(args.polish, poses_learn=True)
            phase_done("polish")
        refined = trainer.pose_refiner.refined(given)
        psnr = trainer.evaluate_test()["psnr"]
        gaussians = trainer.gaussian_count()
        extent = scene.extent
        plain = plain_psnr(folder, Path(tmp) / "plain", args) if args.plain else None
    out: dict[str, Any] = {
        "args": vars(args),
        "test_psnr": psnr,
        "plain_test_psnr": plain,
        "gaussians": gaussians,
        "seconds": time.perf_counter() - began,
        "phases": phases,
    }
    for name, align in (("aligned", True), ("raw", False)):
        before = pose_errors(arrays(given), arrays(truth), extent, align=align)
        after = pose_errors(arrays(refined), arrays(truth), extent, align=align)
        out[name] = {"before": before, "after": after, "ratio": [b / a for b, a in zip(before, after, strict=True)]}
    for name, views in (("before", given), ("after", refined)):
        axes = axis_errors(arrays(views), arrays(truth))
        out[f"axes_{name}"] = {"common": axes.mean(axis=0).tolist(), "mean_abs": np.abs(axes).mean(axis=0).tolist()}
    return out


def _override(text: str) -> dict[str, Any]:
    try:
        return parse_override(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=("joint", "alternate", "late"), default="joint")
    parser.add_argument("--steps", type=int, default=500, help="joint: steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scene-block", type=int, default=200)
    parser.add_argument("--pose-block", type=int, default=100)
    parser.add_argument("--scene-steps", type=int, default=400, help="late: scene-only steps")
    parser.add_argument("--pose-steps", type=int, default=200, help="late: pose-only steps")
    parser.add_argument(
        "--joint-blocks", action="store_true", help="alternate: the poses learn in the scene blocks too"
    )
    parser.add_argument("--polish", type=int, default=0, help="joint steps at the end")
    parser.add_argument("--pose-gauge", choices=("on", "off"), default="on")
    parser.add_argument("--newton", type=int, default=0, help="Gauss-Newton sweeps per pose block instead of Adam")
    parser.add_argument("--pose-lr", type=float, default=5e-3)
    parser.add_argument("--pose-lr-final", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=1, help="perturbation seed")
    parser.add_argument("--degrees", type=float, default=1.0, help="each view's perturbation rotation")
    parser.add_argument("--fraction", type=float, default=0.01, help="each view's perturbation shift / extent")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--views", type=int, default=16, help="views of the demo scene (every 8th held out)")
    parser.add_argument("--distances", type=lambda text: tuple(float(d) for d in text.split(",")), default=None,
                        help="camera distances of the demo scene, cycled over the views (default: all 4.5)")
    parser.add_argument("--elevations", type=lambda text: tuple(float(e) for e in text.split(",")), default=None,
                        help="ring elevations of the demo scene in degrees (default: 18,42)")
    parser.add_argument("--gauge", choices=("ten", "seven"), default="ten",
                        help="ten: similarity and common rotation held (the product); seven: similarity only")
    parser.add_argument("--plain", action="store_true", help="also train without pose refinement")
    parser.add_argument("--gauge-free", action="store_true",
                        help="perturb orthogonally to the ten held gauge directions (perturbed())")
    parser.add_argument("--set", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="a config override (section.key=value, repeatable), applied after the script's own "
                             "to both the refined and the --plain trainer")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = run(args)
    al, raw = out["aligned"], out["raw"]
    for name, rot, centre in out["phases"]:
        print(f"  after {name}: aligned {rot:.3f} deg / {centre:.4f}")
    print(f"{args.schedule} seed {args.seed}: aligned {al['before'][0]:.3f} deg / {al['before'][1]:.4f} -> "
          f"{al['after'][0]:.3f} / {al['after'][1]:.4f} ({al['ratio'][0]:.2f}x, {al['ratio'][1]:.2f}x); raw "
          f"{raw['before'][0]:.3f} / {raw['before'][1]:.4f} -> {raw['after'][0]:.3f} / {raw['after'][1]:.4f} "
          f"({raw['ratio'][0]:.2f}x, {raw['ratio'][1]:.2f}x); test PSNR {out['test_psnr']:.2f} dB"
          + (f" ({out['plain_test_psnr']:.2f} without refinement)" if args.plain else "") + "; "
          f"{out['gaussians']} Gaussians; {out['seconds']:.0f} s")  # fmt: skip
    for name in ("before", "after"):
        axes = out[f"axes_{name}"]
        print(f"  {name}: common (pitch, yaw, roll) {np.round(axes['common'], 3).tolist()} deg, "
              f"mean |.| {np.round(axes['mean_abs'], 3).tolist()}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
