"""Issue 35's sharded-run cases on the CPU (gloo, two ranks): a process group that cannot be set
up, the rank that outlives a SIGKILLed rank 0, the partition a run reports, and a sharded run
pruned to nothing. Each ends in gstrain lines, never a Python traceback of ours."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_util import assert_one_error, assert_user_error, call_cli, run_cli
from test_dist_cli import TORCHRUN, _torchrun, _wait_training

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_traceback_of_ours(err: str) -> None:
    """torchrun prints its own ChildFailedError traceback when a worker fails; ours must not appear."""
    assert "KeyboardInterrupt" not in err, err[-3000:]
    assert "/gstrain/" not in err.replace("-m gstrain", ""), err[-3000:]


# ------------------------------------------------------------------- 16: the process group
def test_process_group_set_up_failure_is_one_line(demo_scene: Path, tmp_path: Path, monkeypatch) -> None:
    """Rank 0 of two, whose peer never comes: the rendezvous waits dist.timeout_s, then one line."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    proc = run_cli("fit", demo_scene, "--out", out, "--device", "cpu", "--steps", "2", "--set", "dist.timeout_s=1",
                   timeout=120)
    assert_user_error(proc, "rank 0", "cannot set up the gloo process group", "dist.timeout_s=1")
    assert not out.exists()


# ------------------------------------------------------------------- 17: rank 0 killed
@pytest.mark.slow
def test_rank_outliving_a_killed_rank_zero_says_one_line(demo_scene: Path, tmp_path: Path) -> None:
    """torchrun SIGTERMs the ranks that outlive a failed one; that signal must not turn the
    survivor's error into a traceback (a race: tried three times)."""
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        proc = _torchrun(demo_scene, run, "--set", "log.progress_every=5", "--set", "log.ckpt_every=5",
                         "--set", "dist.timeout_s=20", steps=100_000)
        os.kill(_wait_training(proc, run)[0], signal.SIGKILL)
        err = proc.communicate(timeout=120)[1]
        assert proc.returncode != 0
        lines = err.replace("\r", "\n").splitlines()
        survivor = [x for x in lines if "gstrain: error: rank 1" in x or x.endswith("gstrain: error: interrupted")]
        assert len(survivor) == 1, err[-3000:]
        _no_traceback_of_ours(err)


def test_sigterm_while_the_error_line_is_printed_is_ignored(tmp_path: Path, monkeypatch) -> None:
    """The race above, made certain: torchrun's SIGTERM lands just as the survivor reports its
    error. The command has ended by then; the signal must not turn the line into a traceback."""
    import gstrain.cli

    report = gstrain.cli._err

    def late_signal(message: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode, here
        report(message)

    monkeypatch.setattr(gstrain.cli, "_err", late_signal)
    try:
        result = call_cli("eval", tmp_path / "no_such_run")
    except KeyboardInterrupt:  # not pytest's own stop: the traceback a user would have seen
        pytest.fail("a SIGTERM after the command ended escaped as KeyboardInterrupt")
    assert_one_error(*result, "run folder not found")


# ------------------------------------------------------------------- 18: the partition used
def test_views_partition_reports_its_locality_fallback(demo_scene: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _torchrun(demo_scene, run, "--set", "dist.partition=views", "--set", "log.ckpt_every=3", steps=6)
    err = proc.communicate(timeout=180)[1]
    assert proc.returncode == 0, err[-3000:]
    # the demo scene is too small for a balanced views partition: it falls back to locality
    assert "partitioned by locality instead" in err
    assert "2 ranks, dist.partition=locality:" in err and "dist.partition=views:" not in err
    manifests = sorted((run / "ckpt").glob("*.shards/manifest.json"))
    assert manifests
    assert {json.loads(m.read_text())["partition"] for m in manifests} == {"locality"}


# ------------------------------------------------------------------- 6, sharded
def test_sharded_run_pruned_to_nothing_stops_with_one_line(demo_scene: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _torchrun(demo_scene, run, "--set", "strategy.prune_opa=0.99", "--set", "strategy.refine_start=4",
                     "--set", "strategy.refine_every=4", "--set", "log.progress_every=2", "--set", "log.ckpt_every=2",
                     "--set", "log.keep_ckpts=0", steps=20)
    err = proc.communicate(timeout=180)[1]
    assert proc.returncode != 0
    assert "pruned every Gaussian" in err and "strategy.prune_opa=0.99" in err, err[-3000:]
    assert "done at step" not in err
    _no_traceback_of_ours(err)
    steps = sorted(int(p.name.split("_")[1].split(".")[0]) for p in (run / "ckpt").glob("step_*.shards"))
    emptied = int(re.search(r"densification at step (\d+) pruned", err).group(1))
    assert steps and max(steps) < emptied, (steps, emptied)  # none saved once the model was empty
    for step in steps:
        rows = json.loads((run / "ckpt" / f"step_{step}.shards" / "manifest.json").read_text())["rows"]
        assert sum(rows) > 0
    ev = subprocess.run([sys.executable, "-m", "gstrain", "eval", str(run), "--device", "cpu"], capture_output=True,
                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert ev.returncode == 0, ev.stderr
