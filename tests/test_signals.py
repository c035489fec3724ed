"""Ctrl-C and SIGTERM on the installed `gstrain` console script: every interrupt ends with the
"interrupted" line and a run folder that `--resume` continues to the same parameters, bit for
bit, as an uninterrupted run of the same --steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_util import call_cli

from gstrain.train.checkpoint import list_checkpoints

STEPS = 40
COMMON = ["--steps", str(STEPS), "--seed", "7", "--set", "log.progress_every=5", "--set", "model.sh_degree=1",
          "--set", "log.ckpt_every=10", "--set", "strategy.refine_start=10", "--set", "strategy.refine_every=10"]
GSTRAIN = Path(sys.executable).parent / "gstrain"  # the console script pip installed


def _start(*args: str | Path) -> subprocess.Popen:
    assert GSTRAIN.is_file(), f"the gstrain console script is not installed beside {sys.executable}"
    # SIGINT as a terminal leaves it: a test runner started in the background inherits it ignored,
    # and Python would then never turn Ctrl-C into KeyboardInterrupt
    return subprocess.Popen([str(GSTRAIN), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _interrupted(proc: subprocess.Popen) -> str:
    """The stderr of a process that must end as interrupted: exit 130, the line, no traceback."""
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.rstrip().splitlines()[-1] == "gstrain: error: interrupted", err
    assert "Traceback" not in err and "Aborted at" not in err and "stack trace" not in err, err
    return err


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, demo_scene: Path) -> dict:
    run = tmp_path_factory.mktemp("signals") / "full"
    code, err = call_cli("fit", demo_scene, "--out", run, *COMMON)
    assert code == 0, err
    return torch.load(run / "ckpt" / f"step_{STEPS}.pt", weights_only=False)


def _resume_matches(run: Path, scene: Path, full: dict, *extra: str) -> None:
    code, err = call_cli("fit", scene, "--out", run, "--resume", *COMMON, *extra)
    assert code == 0, err
    state = torch.load(run / "ckpt" / f"step_{STEPS}.pt", weights_only=False)
    for key in full["params"]:
        assert torch.equal(full["params"][key], state["params"][key]), key


def test_ctrl_c_mid_run_then_resume_equals_uninterrupted(demo_scene: Path, tmp_path: Path, full_run: dict) -> None:
    run = tmp_path / "run"
    proc = _start("fit", demo_scene, "--out", run, *COMMON)
    _wait_for(run / "ckpt" / "step_10.pt", proc)
    proc.send_signal(signal.SIGINT)
    err = _interrupted(proc)
    assert "checkpoint saved" in err
    step = list_checkpoints(run)[-1][0]
    assert 10 <= step < STEPS
    _resume_matches(run, demo_scene, full_run)


def test_sigterm_in_the_early_window_then_resume_equals_uninterrupted(
    demo_scene: Path, tmp_path: Path, full_run: dict
) -> None:
    """SIGTERM as soon as the run folder exists (before or at the first steps): no native stack
    dump, a folder that --resume continues (from step 0 when no checkpoint was written)."""
    run = tmp_path / "run"
    proc = _start("fit", demo_scene, "--out", run, *COMMON)
    _wait_for(run / "run.json", proc)
    proc.send_signal(signal.SIGTERM)
    err = _interrupted(proc)
    assert "--resume" in err  # the line that says what was kept and how to go on
    _resume_matches(run, demo_scene, full_run)


@pytest.mark.slow
def test_two_quick_ctrl_c_stop_at_once_and_say_what_was_kept(
    demo_scene: Path, tmp_path: Path, full_run: dict
) -> None:
    run = tmp_path / "run"
    proc = _start("fit", demo_scene, "--out", run, *COMMON)
    _wait_for(run / "ckpt" / "step_10.pt", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = _interrupted(proc)
    assert "keeps checkpoint" in err or "checkpoint saved" in err, err
    _resume_matches(run, demo_scene, full_run)


def test_ctrl_c_while_starting_is_one_line(demo_scene: Path, tmp_path: Path) -> None:
    """Ctrl-C in the first second (imports, or loading the scene): the line, nothing half-written."""
    run = tmp_path / "run"
    proc = _start("fit", demo_scene, "--out", run, *COMMON)
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    _interrupted(proc)
    # nothing half-made: no folder, or one a fresh fit or --resume takes up (it has its run.json)
    assert not run.exists() or (run / "run.json").is_file()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_run_folder_is_made_waits_for_its_run_json(demo_scene: Path, tmp_path: Path, monkeypatch,
                                                                     sig: int) -> None:  # fmt: skip
    """A Ctrl-C or SIGTERM that lands between the run folder's first file and its run.json (the
    window the test above can hit) stops the fit only once run.json is written."""
    import gstrain.run_dir as run_dir_module
    from gstrain.config import build_config
    from gstrain.run_lock import RunLock
    from gstrain.signals import install_term_handler

    term_before, int_before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    install_term_handler()  # as the CLI does: SIGTERM raises KeyboardInterrupt
    # and Ctrl-C too, as in a fresh process (an earlier test in this worker may have left it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    saved = run_dir_module.save_config

    def stopped_midway(cfg, path):  # the signal arrives with the lock taken, before config.yaml
        os.kill(os.getpid(), sig)
        time.sleep(0.05)  # time for a handler to run, were it the stopping one
        saved(cfg, path)

    monkeypatch.setattr(run_dir_module, "save_config", stopped_midway)
    run = tmp_path / "run"
    lock = RunLock(run)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_dir_module.create_run_dir(run, demo_scene, build_config(), lock)
    finally:
        lock.release()
        signal.signal(signal.SIGTERM, term_before)
        signal.signal(signal.SIGINT, int_before)
    assert (run / "run.json").is_file() and (run / "config.yaml").is_file()
    assert run_dir_module.check_new_run_dir(run)  # a fresh fit takes it up


def _decode_workers_of(pid: int) -> list[int]:
    """The pids of `pid`'s children running gstrain's decode worker (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"gstrain.data.decode_worker" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_ctrl_c_with_images_from_disk_saves_ends_the_decoders_and_resumes(
    demo_scene: Path, tmp_path: Path, full_run: dict
) -> None:
    """data.images_on=disk decodes in worker processes of their own session, which a terminal's
    Ctrl-C does not reach: the trainer saves, says so, and its closing ends them; --resume (from
    disk again) gives the uninterrupted run's parameters, which used resident images, bit for bit."""
    run = tmp_path / "run"
    disk = ("--set", "data.images_on=disk")
    proc = _start("fit", demo_scene, "--out", run, *COMMON, *disk)
    _wait_for(run / "ckpt" / "step_10.pt", proc)
    workers = _decode_workers_of(proc.pid)
    assert workers, "no decode worker processes while the disk run trained"
    proc.send_signal(signal.SIGINT)
    err = _interrupted(proc)
    assert "checkpoint saved" in err
    deadline = time.time() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), "decode workers outlived the run"
    _resume_matches(run, demo_scene, full_run, *disk)
