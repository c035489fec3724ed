"""Run the real `gstrain` command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str | Path, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "gstrain", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=timeout, env=env,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, one line on stderr, no traceback, and the line says what is wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("gstrain: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle.lower() in errors[0].lower(), (needle, errors[0])


def call_cli(*args: str | Path) -> tuple[int, str]:
    """Run gstrain's console entry point in this process: (exit code, stderr). Faster than a
    subprocess, and lets a test monkeypatch what the command will meet (a full disk, say)."""
    import contextlib
    import io
    import signal

    from gstrain.cli import main

    err = io.StringIO()
    # main() installs its SIGTERM handler and ignores both signals once the command returns
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    argv = sys.argv
    sys.argv = ["gstrain", *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, err.getvalue()


def assert_one_error(code: int, stderr: str, *needles: str) -> None:
    """assert_user_error for call_cli's result."""
    assert_user_error(subprocess.CompletedProcess([], code, "", stderr), *needles)


# A 4-step run of the 64 px demo scene with checkpoints at steps 2 and 4 (the fault tests' subject)
TINY = ["--set", "log.progress_every=2", "--set", "model.sh_degree=1", "--set", "log.ckpt_every=2",
        "--set", "log.keep_ckpts=0", "--set", "strategy.refine_start=100", "--seed", "5"]


def fit_tiny_run(out: Path, scene: Path) -> Path:
    """`gstrain fit` of TINY into `out` (asserts it trained)."""
    code, err = call_cli("fit", scene, "--out", out, "--steps", "4", *TINY)
    assert code == 0, err
    return out


def copy_run(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` under tmp_path, for a test that damages or overwrites its files."""
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run"))
