"""The `gstrain` command line: parses flags, builds the config, and hands off to the modules.

Bad input of any kind ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer >= 0.22 vendors click; older releases use the click package
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc  # type: ignore[no-redef]

from gstrain.allocator import configure_allocator
from gstrain.choices import (
    ATOMIC_MODES,
    BACKENDS,
    CAMERA_PATHS,
    DEVICES,
    EXPORT_FORMATS,
    PROFILE_BACKENDS,
    RENDER_OUTPUTS,
    SFM_MATCHERS,
)
from gstrain.errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train 3D Gaussian Splatting scenes from COLMAP data, with a timed, warp-reduced rasterizer.",
)


def _one_of(options: tuple[str, ...]) -> str:
    """A help text's list of the allowed values, from their owner (gstrain/choices.py)."""
    return " | ".join(options)


def _err(message: str) -> None:
    # one write: under torchrun every rank prints its line to the same pipe, and print's separate
    # write of the newline let two ranks' lines run together
    sys.stderr.write(f"gstrain: error: {message}\n")
    sys.stderr.flush()


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
        "atomic_threshold": ("dev", "atomic_threshold"),
        "threads": ("train", "threads"),
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
DeviceOpt = Annotated[str | None, typer.Option(help=f"{_one_of(DEVICES)} (auto: the GPU when present).")]
FactorOpt = Annotated[int | None, typer.Option(help="Downscale images by this factor (uses images_N/ if present).")]


SceneOpt = Annotated[Path | None, typer.Option(
    "--scene", help="The run's scene folder after a move (checked to be the same scene, then kept in run.json).",
)]
AllowOlderOpt = Annotated[bool, typer.Option(
    "--allow-older-checkpoint",
    help="When the newest checkpoint is damaged, use the newest readable one (and say which).",
)]


@app.command()
def fit(
    scene: Annotated[Path, typer.Argument(help="Scene folder: COLMAP (images/, sparse/0) or transforms.json.")],
    config: ConfigOpt = None,
    out: Annotated[Path | None, typer.Option(help="Run folder (default: runs/<scene name>).")] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (default from config: 30000).")] = None,
    factor: FactorOpt = None,
    device: DeviceOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its checkpoint.")] = False,
    seed: Annotated[int | None, typer.Option(help="Random seed.")] = None,
    backend: Annotated[str | None, typer.Option(
        help=f"Rasterizer: {_one_of(BACKENDS)} (auto: cuda on a GPU, reference on the CPU)."
    )] = None,
    atomic_mode: Annotated[
        str | None, typer.Option(help=f"Backward reduction of our CUDA rasterizer: {_one_of(ATOMIC_MODES)}.")
    ] = None,
    atomic_threshold: Annotated[
        int | None, typer.Option(help="distwar's lane threshold T (1..32; dev.atomic_threshold).")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads for torch (0: auto; train.threads).")] = None,
    allow_older_checkpoint: AllowOlderOpt = False,
    set_: SetOpt = None,
    viewer: Annotated[bool, typer.Option("--viewer", help="Watch it train in the browser (viewer.port, ...).")] = False,
) -> None:
    """Train Gaussians on a COLMAP scene; writes checkpoints, PLY, TensorBoard logs to the run folder."""
    from gstrain.config_checks import check_atomic_mode
    from gstrain.fit_run import FitRequest, run_fit

    if atomic_mode is not None:
        check_atomic_mode(atomic_mode, flag=True)
    overrides = [_flag_overrides(
        steps=steps, seed=seed, device=device, factor=factor, backend=backend,
        atomic_mode=atomic_mode, atomic_threshold=atomic_threshold, threads=threads,
    )]
    request = FitRequest(scene=scene, out=out, resume=resume, config_files=list(config or []),
                         overrides=overrides, sets=list(set_ or []), allow_older=allow_older_checkpoint,
                         viewer=viewer)
    code = run_fit(request, log=_log)
    if code:
        raise typer.Exit(code)


@app.command("eval")
def eval_(
    run: Annotated[Path, typer.Argument(help="Run folder written by gstrain fit.")],
    device: DeviceOpt = None,
    allow_older_checkpoint: AllowOlderOpt = False,
    scene: SceneOpt = None,
) -> None:
    """Render the held-out views and score them (PSNR, SSIM, LPIPS: weights fetched on first use)."""
    from gstrain.evaluate import evaluate_run

    metrics = evaluate_run(run, device=device or "auto", log=_log, allow_older=allow_older_checkpoint,
                           scene=scene)
    lp = metrics.get("lpips")
    lp_text = f"{lp:.4f}" if lp is not None else f"n/a ({metrics.get('lpips_note', 'unavailable')})"
    half = metrics["fitted_half"]  # None: a perfect half, or no view kept a pixel of its right half
    half_psnr = f"{half['psnr']:.2f} dB" if half["psnr"] is not None else "n/a"
    half_ssim = f"{half['ssim']:.4f}" if half["ssim"] is not None else "n/a"
    print(
        f"test views {metrics['num_views']} (raw render, no per-image correction): PSNR {metrics['psnr']:.2f} dB, "
        f"SSIM {metrics['ssim']:.4f}, LPIPS {lp_text}{_masked_text(metrics)}; colour fitted on the left half, "
        f"right half scored: PSNR {half_psnr}, SSIM {half_ssim}  -> {run / 'metrics.json'}"
    )


def _masked_text(metrics: dict) -> str:
    """masks: the eval line says when test views were scored on their kept pixels only."""
    n = metrics.get("masked_views") or 0
    return f" (masked: {n} of {metrics['num_views']} views scored on kept pixels only)" if n else ""


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="Run folder written by gstrain fit.")],
    format: Annotated[str | None, typer.Option(
        "--format", help=f"Export format: {_one_of(EXPORT_FORMATS)} (default: from --out's extension, else ply)."
    )] = None,
    out: Annotated[Path | None, typer.Option(help="Output file (default: <run>/point_cloud/iteration_N/).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing --out file that gstrain wrote (never a run's checkpoints or records)."
    )] = False,
    allow_older_checkpoint: AllowOlderOpt = False,
) -> None:
    """Export the latest checkpoint's Gaussians for viewers (3DGS PLY, .splat, compressed PLY)."""
    from gstrain.formats import check_export_target, default_export_name, export_format, export_gaussians
    from gstrain.run_dir import check_not_run_record, open_run

    fmt = export_format(out, format)
    if out is not None:  # before any work: a user's file, a link, a run's own records are never replaced
        check_not_run_record(out)
        check_export_target(out, fmt, force, ours=run / "point_cloud")
    opened = open_run(run, allow_older=allow_older_checkpoint, log=_log, load_views=False, renderer=False)
    path = out or run / "point_cloud" / f"iteration_{opened.step}" / default_export_name(fmt)
    count = export_gaussians(opened.params, path, fmt)
    print(f"wrote {count} Gaussians (step {opened.step}, {fmt}) to {path}")


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
        str, typer.Option(help=f"Our CUDA backward: {_one_of((*ATOMIC_MODES, 'all'))} (comma-separated list allowed).")
    ] = "all",
    backend: Annotated[str, typer.Option(
        help=f"{_one_of(PROFILE_BACKENDS)}: cuda is our kernels (a column per mode), gsplat gsplat's rasterizer "
        "(one column), all both."
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
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an earlier demo scene in OUT (only the files its demo-scene.json lists)."
    )] = False,
) -> None:
    """Write the embedded synthetic demo scene as a real COLMAP scene (images/ + sparse/0)."""
    from gstrain.data.demo import write_demo_scene

    if views < 2 or size < 16:
        raise UserError("demo-scene needs --views >= 2 and --size >= 16")
    write_demo_scene(out, n_views=views, width=size, height=size, masks=masks, force=force)
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
        str, typer.Option(help=f"{_one_of(SFM_MATCHERS)}: exhaustive for any photo set, sequential for video "
                               "frames (in name order).")
    ] = "exhaustive",
    max_size: Annotated[int, typer.Option(help="Longest image side (px) for features and output.")] = 1600,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an earlier gstrain sfm scene in SCENE (only the files its sfm.json lists)."
    )] = False,
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
    path: Annotated[
        str, typer.Option(help=f"Cameras: {_one_of(CAMERA_PATHS)} (test and train: the dataset's).")
    ] = "orbit",
    out: Annotated[
        Path | None, typer.Option(help="FILE.mp4, or a folder for PNG frames (default: <run>/renders/).")
    ] = None,
    what: Annotated[str, typer.Option(help=f"{_one_of(RENDER_OUTPUTS)}.")] = "rgb",
    fps: Annotated[int, typer.Option(help="Frames per second of the video.")] = 30,
    size: Annotated[str | None, typer.Option(help="Output size WxH (default: the dataset's).")] = None,
    frames: Annotated[int, typer.Option(help="Frames along an orbit or spiral.")] = 120,
    device: DeviceOpt = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace the frames of an earlier render in --out (only those), or a FILE.mp4 gstrain wrote."
    )] = False,
    allow_older_checkpoint: AllowOlderOpt = False,
    scene: SceneOpt = None,
) -> None:
    """Render the trained Gaussians along a camera path to an MP4 or PNG frames."""
    from gstrain.video import render_run

    report = render_run(
        run, path=path, out=out, what=what, fps=fps, size=size, device=device or "auto", log=_log,
        n_frames=frames, force=force, allow_older=allow_older_checkpoint, scene=scene,
    )  # fmt: skip
    print(
        f"rendered {report.frames} {what} frames at {report.width}x{report.height} ({report.backend}) "
        f"in {report.seconds:.1f}s -> {report.out}"
    )


def main() -> None:
    """Console entry point: one line and exit 2 for bad input, whatever layer noticed it."""
    configure_allocator()  # before anything allocates CUDA memory
    code = _run_app()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        if code == 0:
            # A finished rank leaves without the interpreter's teardown: gloo's worker threads may
            # still be dropping a finished collective, which needs the GIL that teardown takes away
            # (an abort, seen once in ~40 runs). Everything the command wrote is closed by now.
            os._exit(0)
        # torchrun ends every other rank as soon as one exits non-zero: the others, which met the
        # same fault (a damaged checkpoint is read by every rank), get a moment to say it themselves
        time.sleep(1.0)
    sys.exit(code)


def _run_app() -> int:
    """Run the command; its exit code, with every error turned into one line first."""
    from gstrain.files import os_error_text
    from gstrain.signals import ignore_stop_signals, install_term_handler

    try:
        try:
            # pycolmap's logging library installs a native SIGTERM handler on import (a stack dump,
            # no save): import it first, then install ours, so SIGTERM ends every command like Ctrl-C.
            import pycolmap  # noqa: F401

            install_term_handler()
            code = app(standalone_mode=False)
        finally:
            # The command has ended; what it kept is saved. A late Ctrl-C or SIGTERM (the second
            # of two quick ones, or torchrun's SIGTERM to the ranks that outlive a killed one)
            # must not interrupt the line that says so, or land in the exit handlers as a traceback.
            ignore_stop_signals()
    except UserError as exc:
        _err(str(exc))
        return 2
    except click_exc.NoArgsIsHelpError as exc:
        if exc.ctx is not None:
            print(exc.ctx.get_help())
        return 0
    except click_exc.UsageError as exc:
        _err(" ".join(exc.format_message().split()))
        return 2
    except click_exc.ClickException as exc:
        _err(" ".join(exc.format_message().split()))
        return exc.exit_code or 1
    except (typer.Abort, KeyboardInterrupt):
        ignore_stop_signals()  # when the interrupt came from ignoring them in the first place
        _err("interrupted")
        return 130
    except OSError as exc:  # a write that no layer expected to fail (full disk, read-only folder)
        _err(os_error_text(exc, exc.filename or "a file"))
        return 2
    if code == 130:  # fit's own interrupt: its lines said what was kept
        _err("interrupted")
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    main()
