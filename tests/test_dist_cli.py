"""`torchrun -m gstrain fit` end to end on the CPU (gloo): a run, a Ctrl-C on one rank (all stop
at one step with a sharded checkpoint), and a killed rank (a one-line error, no hang)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python")


def _torchrun(scene: Path, run: Path, *sets: str, steps: int = 8) -> subprocess.Popen:
    cmd = [str(TORCHRUN), "--nproc-per-node=2", "-m", "gstrain", "fit", str(scene), "--out", str(run),
           "--device", "cpu", "--steps", str(steps), "--set", "model.init=random", "--set", "model.init_points=300",
           "--set", "train.batch_size=2", "--set", "log.eval_steps=[]", "--set", "log.save_steps=[]", *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _workers(parent: int) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def _wait_training(proc: subprocess.Popen, run: Path) -> dict[int, int]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        workers = _workers(proc.pid)
        if len(workers) == 2 and (run / "ckpt").is_dir():  # the first checkpoint is on disk: training runs
            return workers
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    proc.kill()
    pytest.fail("torchrun did not start training in 90 s")


def _signal_rank_one(scene: Path, run: Path, sig: int, extra: str) -> tuple[str, subprocess.Popen]:
    """A long torchrun fit (W=2, a checkpoint every 5 steps); `sig` to rank 1 once it trains.
    Returns (stderr, the finished process): it must end by itself, no hang."""
    proc = _torchrun(scene, run, "--set", "log.progress_every=5", "--set", "log.ckpt_every=5", "--set", extra,
                     steps=100_000)
    os.kill(_wait_training(proc, run)[1], sig)
    return proc.communicate(timeout=120)[1], proc


@pytest.mark.slow
def test_torchrun_fit_sigint_to_one_rank_stops_all_with_a_checkpoint(demo_scene, tmp_path):
    run = tmp_path / "run"
    err, proc = _signal_rank_one(demo_scene, run, signal.SIGINT, "log.keep_ckpts=0")
    line = next(x for x in err.splitlines() if "interrupted at step" in x)
    step = int(line.split("interrupted at step ")[1].split(";")[0])
    assert step % 5 == 0  # the ranks agree at a flag all-reduce, every log.progress_every steps
    manifest = json.loads((run / "ckpt" / f"step_{step}.shards" / "manifest.json").read_text())
    assert manifest["step"] == step and manifest["world"] == 2  # both ranks wrote their shard
    assert all(int(p.name.split("_")[1].split(".")[0]) <= step for p in (run / "ckpt").iterdir())
    assert err.count("checkpoint saved to") == 1  # rank 0 reports, once
    assert f"resume with: torchrun --nproc-per-node=2 -m gstrain fit {demo_scene} --out {run} --resume" in err
    assert proc.returncode != 0
    # rank 0's record has its share of the exchange: records went both ways between the two ranks
    comm = json.loads((run / "train_summary.json").read_text())["comm_bytes_per_step"]
    assert comm["sent"] > 0 and comm["received"] > 0, comm
    # eval reads the sharded run, gathered into one model
    ev = subprocess.run([sys.executable, "-m", "gstrain", "eval", str(run), "--device", "cpu"],
                        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert ev.returncode == 0 and "test views" in ev.stdout, ev.stderr


def test_killed_rank_ends_the_run_with_one_line(demo_scene, tmp_path):
    err, proc = _signal_rank_one(demo_scene, tmp_path / "run", signal.SIGKILL, "dist.timeout_s=20")
    assert proc.returncode != 0
    assert "gstrain: error: rank 0: distributed training stopped" in err, err[-2000:]
