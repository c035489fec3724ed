"""The `gstrain` command line: parses flags, builds the config, and hands off to the modules.

Bad input of any kind ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer >= 0.22 vendors click; older releases use the click package
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc  # type: ignore[no-redef]

from gstrain.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train 3D Gaussian Splatting scenes from COLMAP data, with a timed, warp-reduced rasterizer.",
)


def _err(message: str) -> None:
    print(f"gstrain: error: {message}", file=sys.stderr)


def _log(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 reports (errors: every rank)
        print(message, file=sys.stderr)


def _flag_overrides(**flags: Any) -> dict[str, dict[str, Any]]:
    """Map the convenience flags onto config sections (None = not given)."""
    where = {
        "steps": ("train", "steps"),
        "seed": ("train", "seed"),
        "device": ("train", "device"),
        "factor": ("data", "factor"),
        "backend": ("render", "backend"),
        "atomic_mode": ("render", "atomic_mode"),
        "atomic_threshold": ("render", "atomic_threshold"),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, value in flags.items():
        if value is not None:
            section, key = where[name]
            out.setdefault(section, {})[key] = value
    return out


ConfigOpt = Annotated[
    list[Path] | None,
    typer.Option("--config", "-c", help="YAML config file(s), merged in order over the defaults."),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override any config key: --set strategy.refine_every=200 (repeatable)."),
]
DeviceOpt = Annotated[str | None, typer.Option(help="auto | cpu | cuda (auto: the GPU when present).")]
FactorOpt = Annotated[int | None, typer.Option(help="Downscale images by this factor (uses images_N/ if present).")]


@app.command()
def fit(
    scene: Annotated[Path, typer.Argument(help="COLMAP scene folder: images/ and sparse/0 (or sparse/).")],
    config: ConfigOpt = None,
    out: Annotated[Path | None, typer.Option(help="Run folder (default: runs/<scene name>).")] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (default from config: 30000).")] = None,
    factor: FactorOpt = None,
    device: DeviceOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its checkpoint.")] = False,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    backend: Annotated[str | None, typer.Option(
        help="Rasterizer: auto | reference | cuda | gsplat (auto: cuda on a GPU, reference on the CPU)."
    )] = None,
    atomic_mode: Annotated[
        str | None, typer.Option(help="Backward reduction of our CUDA rasterizer: atomic | warp | distwar | arc.")
    ] = None,
    atomic_threshold: Annotated[int | None, typer.Option(help="distwar's lane threshold T (1..32).")] = None,
    set_: SetOpt = None,
    viewer: Annotated[bool, typer.Option("--viewer", help="Watch it train in the browser (viewer.port, ...).")] = False,
) -> None:
    """Train Gaussians on a COLMAP scene; writes checkpoints, PLY, TensorBoard logs to the run folder."""
    from gstrain.config import build_config, check_atomic_mode, merge_dict, parse_override, validate
    from gstrain.data.colmap import load_scene
    from gstrain.dist.launch import finish_process_group, init_from_env, on_rank_zero, torchrun_world
    from gstrain.render import resolve_device
    from gstrain.run_dir import create_run_dir, default_run_dir, load_run, update_run_config
    from gstrain.train.trainer import Trainer

    if not scene.exists():
        raise UserError(f"scene folder not found: {scene}")
    if atomic_mode is not None:
        check_atomic_mode(atomic_mode, flag=True)
    overrides = [_flag_overrides(
        steps=steps, seed=seed, device=device, factor=factor, backend=backend,
        atomic_mode=atomic_mode, atomic_threshold=atomic_threshold,
    )]
    overrides += [parse_override(s) for s in (set_ or [])]
    if resume:
        run_dir = out or Path("runs") / scene.resolve().name
        cfg, _meta = load_run(run_dir)
        for path in config or []:
            from gstrain.config import load_yaml

            merge_dict(cfg, load_yaml(path), origin=str(path))
        for update in overrides:
            merge_dict(cfg, update, origin="command line")
        validate(cfg)
    else:
        cfg = build_config(config, overrides)
        run_dir = out or default_run_dir(scene)
    dev = resolve_device(cfg.train.device)
    world = torchrun_world(cfg.dist.always)
    if world:  # under torchrun: one process per GPU, each owning a shard (gstrain/dist)
        if viewer:
            raise UserError("--viewer is not available under torchrun; train on one process to watch it")
        _rank, world, dev = init_from_env(dev, cfg.dist.timeout_s, cfg.dist.backend)
    messages: list[str] = []  # held back so that bad input still ends with exactly one line
    loaded = load_scene(scene, factor=cfg.data.factor, test_every=cfg.data.test_every, log=messages.append)
    if len(loaded.points) == 0 and cfg.model.init != "random":
        raise UserError(
            f"the sparse model in {scene} has no 3D points; pass --set model.init=random to start from random points"
        )
    for note in [*messages, *loaded.notes]:
        _log(note if note.startswith("gstrain:") else f"gstrain: {note}")
    view = loaded.train[0] if loaded.train else loaded.test[0]
    _log(
        f"gstrain: {len(loaded.train)} train / {len(loaded.test)} test views at {view.width}x{view.height}, "
        f"{len(loaded.points)} SfM points, device {dev}"
    )
    live = None
    if viewer:  # before the run folder exists: a busy port is bad input like any other
        from gstrain.viewer.live import LiveViewer

        live = LiveViewer(cfg, loaded, log=_log)
    if resume:
        on_rank_zero(lambda: update_run_config(run_dir, cfg))
    else:
        on_rank_zero(lambda: create_run_dir(run_dir, scene, cfg))
    if world:
        from gstrain.dist.trainer import DistTrainer

        trainer = DistTrainer(cfg, loaded, run_dir, dev, log=_log)
    else:
        trainer = Trainer(cfg, loaded, run_dir, dev, log=_log)
    trainer.viewer = live
    try:
        result = trainer.fit(resume=resume)
    finally:
        if live is not None:
            live.close()
        finish_process_group()
    parts = [f"{result.status} at step {result.step} in {result.seconds:.1f}s", f"{result.num_gaussians} Gaussians"]
    if result.initial_test_psnr is not None:
        parts.append(f"test PSNR {result.initial_test_psnr:.2f} -> {result.final_test_psnr or float('nan'):.2f} dB")
    elif result.final_test_psnr is not None:
        parts.append(f"test PSNR {result.final_test_psnr:.2f} dB")
    _log("gstrain: " + ", ".join(parts) + f"; run folder {run_dir}")
    if result.status == "interrupted":
        _log(f"gstrain: resume with: gstrain fit {scene} --out {run_dir} --resume")
        raise typer.Exit(130)
    if result.status == "stopped":
        _log(f"gstrain: paused at train.stop_at={cfg.train.stop_at} of {cfg.train.steps} steps; go on with: "
             f"gstrain fit {scene} --out {run_dir} --resume --set train.stop_at=0")
    if result.status == "nan":
        raise typer.Exit(3)


@app.command("eval")
def eval_(
    run: Annotated[Path, typer.Argument(help="Run folder written by gstrain fit.")],
    device: DeviceOpt = None,
) -> None:
    """Render the held-out views and score them (PSNR, SSIM, LPIPS when available offline)."""
    from gstrain.evaluate import evaluate_run

    metrics = evaluate_run(run, device=device or "auto", log=_log)
    lp = metrics.get("lpips")
    lp_text = f"{lp:.4f}" if lp is not None else f"n/a ({metrics.get('lpips_note', 'unavailable')})"
    print(
        f"test views {metrics['num_views']}: PSNR {metrics['psnr']:.2f} dB, SSIM {metrics['ssim']:.4f}, "
        f"LPIPS {lp_text}{_masked_text(metrics)}  -> {run / 'metrics.json'}"
    )


def _masked_text(metrics: dict) -> str:
    """masks: the eval line says when test views were scored on their kept pixels only."""
    n = metrics.get("masked_views") or 0
    return f" (masked: {n} of {metrics['num_views']} views scored on kept pixels only)" if n else ""


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="Run folder written by gstrain fit.")],
    format: Annotated[str, typer.Option("--format", help="Export format: ply | splat | ply-compressed.")] = "ply",
    out: Annotated[Path | None, typer.Option(help="Output file (default: <run>/point_cloud/iteration_N/).")] = None,
) -> None:
    """Export the latest checkpoint's Gaussians for viewers (3DGS PLY, .splat, compressed PLY)."""
    from gstrain.formats import check_format, default_export_name, export_gaussians
    from gstrain.run_dir import load_run
    from gstrain.train.checkpoint import require_checkpoint

    check_format(format)
    load_run(run)
    state = require_checkpoint(run)
    path = out or run / "point_cloud" / f"iteration_{state['step']}" / default_export_name(format)
    count = export_gaussians(state["params"], path, format)
    print(f"wrote {count} Gaussians (step {state['step']}, {format}) to {path}")


@app.command()
def view(
    run: Annotated[Path, typer.Argument(help="Run folder written by gstrain fit.")],
    port: Annotated[int, typer.Option(help="Port of the web page.")] = 8080,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
) -> None:
    """Show a trained run in the browser: Gaussians, cameras, scores, and our renderer's view."""
    from gstrain.viewer.serve import serve_run

    serve_run(run, host=host, port=port, log=_log)


@app.command()
def profile(
    target: Annotated[Path, typer.Argument(help="COLMAP scene, run folder, or test_garden-style .npz.")],
    atomic_mode: Annotated[
        str, typer.Option(help="Our CUDA backward: atomic | warp | distwar | arc | all (comma-separated list allowed).")
    ] = "all",
    backend: Annotated[str, typer.Option(
        help="cuda (our kernels, a column per mode) | gsplat (gsplat's rasterizer, one column) | all (both)."
    )] = "all",
    iters: Annotated[int, typer.Option(help="Measured iterations per mode.")] = 50,
    warmup: Annotated[int, typer.Option(help="Unmeasured iterations first (ARC also finishes tuning).")] = 10,
    factor: FactorOpt = None,
    scale: Annotated[int, typer.Option(help=".npz only: render at this multiple of its resolution.")] = 1,
    config: ConfigOpt = None,
    out: Annotated[Path | None, typer.Option(help="Where profile.json and tb/ go.")] = None,
    switches: Annotated[bool, typer.Option(
        "--switches", help="Time each speed switch instead: all on, each one off alone, all off (baseline)."
    )] = False,
) -> None:
    """Time training steps per rasterizer mode on the same Gaussians: per-phase medians and speedups."""
    from gstrain.profile import profile_columns, run_profile

    modes = profile_columns(atomic_mode, backend, switches)
    report = run_profile(target, modes, iters=iters, warmup=warmup, factor=factor, npz_scale=scale,
                         config_files=config, out_dir=out, log=_log, switches=switches)
    print(report["table"])
    print(f"wrote {Path(report['out_dir']) / 'profile.json'}")


@app.command("demo-scene")
def demo_scene(
    out: Annotated[Path, typer.Argument(help="Folder to write the generated COLMAP scene to.")],
    views: Annotated[int, typer.Option(help="Number of views.")] = 32,
    size: Annotated[int, typer.Option(help="Image width and height in pixels.")] = 128,
    masks: Annotated[bool, typer.Option(
        "--masks", help="Paint a moving magenta distractor into the training views and write masks/ for it."
    )] = False,
) -> None:
    """Write the embedded synthetic demo scene as a real COLMAP scene (images/ + sparse/0)."""
    from gstrain.data.demo import write_demo_scene

    if views < 2 or size < 16:
        raise UserError("demo-scene needs --views >= 2 and --size >= 16")
    write_demo_scene(out, n_views=views, width=size, height=size, masks=masks)
    extra = ", with a masked distractor" if masks else ""
    print(f"wrote demo scene ({views} views, {size}x{size}{extra}) to {out}")


@app.command()
def sfm(
    photos: Annotated[Path, typer.Argument(help="Folder of photos (jpg, png, tif, bmp) of one scene.")],
    scene: Annotated[Path, typer.Argument(help="Output scene folder (images/ + sparse/0) for gstrain fit.")],
    camera_model: Annotated[
        str, typer.Option(help="COLMAP camera model to estimate (SIMPLE_RADIAL, OPENCV, PINHOLE, ...).")
    ] = "SIMPLE_RADIAL",
    matcher: Annotated[
        str, typer.Option(help="exhaustive (any photo set) | sequential (video frames, in name order).")
    ] = "exhaustive",
    max_size: Annotated[int, typer.Option(help="Longest image side (px) for features and output.")] = 1600,
    force: Annotated[bool, typer.Option("--force", help="Replace SCENE if it holds another scene.")] = False,
) -> None:
    """Structure-from-motion with COLMAP (pycolmap): photos -> an undistorted, posed scene."""
    from gstrain.sfm import run_sfm

    report = run_sfm(
        photos, scene, camera_model=camera_model, matcher=matcher, max_size=max_size, force=force, log=_log
    )
    print(
        f"registered {report.num_registered} of {report.num_photos} photos, {report.num_points} points, "
        f"reprojection error {report.reprojection_error:.2f} px, {report.seconds:.1f}s -> {scene} "
        f"(next: gstrain fit {scene})"
    )


@app.command()
def render(
    run: Annotated[Path, typer.Argument(help="Run folder written by gstrain fit.")],
    path: Annotated[str, typer.Option(help="Cameras: test | train (dataset) | orbit | spiral.")] = "orbit",
    out: Annotated[
        Path | None, typer.Option(help="FILE.mp4, or a folder for PNG frames (default: <run>/renders/).")
    ] = None,
    what: Annotated[str, typer.Option(help="rgb | depth | alpha.")] = "rgb",
    fps: Annotated[int, typer.Option(help="Frames per second of the video.")] = 30,
    size: Annotated[str | None, typer.Option(help="Output size WxH (default: the dataset's).")] = None,
    frames: Annotated[int, typer.Option(help="Frames along an orbit or spiral.")] = 120,
    device: DeviceOpt = None,
) -> None:
    """Render the trained Gaussians along a camera path to an MP4 or PNG frames."""
    from gstrain.video import render_run

    report = render_run(
        run, path=path, out=out, what=what, fps=fps, size=size, device=device or "auto", log=_log,
        n_frames=frames,
    )  # fmt: skip
    print(
        f"rendered {report.frames} {what} frames at {report.width}x{report.height} ({report.backend}) "
        f"in {report.seconds:.1f}s -> {report.out}"
    )


def main() -> None:
    """Console entry point: one line and exit 2 for bad input, whatever layer noticed it."""
    try:
        code = app(standalone_mode=False)
    except UserError as exc:
        _err(str(exc))
        sys.exit(2)
    except click_exc.NoArgsIsHelpError as exc:
        if exc.ctx is not None:
            print(exc.ctx.get_help())
        sys.exit(0)
    except click_exc.UsageError as exc:
        _err(" ".join(exc.format_message().split()))
        sys.exit(2)
    except click_exc.ClickException as exc:
        _err(" ".join(exc.format_message().split()))
        sys.exit(exc.exit_code or 1)
    except (typer.Abort, KeyboardInterrupt):
        _err("interrupted")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
