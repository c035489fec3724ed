"""Features under `torchrun -m gstrain fit` on the CPU (gloo): --viewer with two ranks (rank 0
serves the page, training ends), the strategies the sharded step cannot run refused in one line,
and one rank (dist.always) running the plain engine, where they work, with a sharded checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(scene: Path, run: Path, world: int, *args: str, steps: int = 8) -> subprocess.Popen:
    cmd = [str(TORCHRUN), f"--nproc-per-node={world}", "-m", "gstrain", "fit", str(scene), "--out", str(run),
           "--device", "cpu", "--steps", str(steps), "--set", "model.init=random", "--set", "model.init_points=300",
           "--set", f"train.batch_size={world}", "--set", "log.eval_steps=[]", "--set", "log.save_steps=[]", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _page_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as reply:
            return reply.status == 200 and len(reply.read()) > 0
    except OSError:
        return False


@pytest.mark.slow
def test_viewer_under_two_ranks_serves_the_page_on_rank_zero_and_training_ends(demo_scene, tmp_path):
    port = _free_port()
    proc = _torchrun(demo_scene, tmp_path / "run", 2, "--viewer", "--set", f"viewer.port={port}",
                     "--set", "viewer.refresh_every=5", "--set", "log.progress_every=5", steps=150)
    answered = False
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        answered = answered or _page_answers(port)
        time.sleep(0.2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert answered  # the page served while the ranks trained
    assert err.count("live viewer at http://127.0.0.1:") == 1  # rank 0 alone serves it
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["steps"] == 150 and summary["backend"].startswith("sharded/")
    assert (tmp_path / "run" / "ckpt" / "step_150.shards" / "manifest.json").is_file()


def test_absgrad_with_several_ranks_is_one_line_naming_what_is_missing(demo_scene, tmp_path):
    proc = _torchrun(demo_scene, tmp_path / "run", 2, "--set", "strategy.absgrad=true")
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    lines = [x for x in err.splitlines() if x.startswith("gstrain: error:")]
    assert lines and "with several ranks" in lines[0] and "absolute values" in lines[0], err[-2000:]
    assert "/gstrain/" not in err  # no traceback through gstrain (torchrun prints its own for a failed worker)


@pytest.mark.slow
def test_mcmc_under_two_ranks_relocates_and_samples_per_owner(demo_scene, tmp_path):
    """Each owner grows its shard up to half of cap_max (300 + 5% per refinement, 3 refinements)."""
    run = tmp_path / "run"
    proc = _torchrun(demo_scene, run, 2, "--set", "strategy.name=mcmc", "--set", "strategy.cap_max=330",
                     "--set", "strategy.refine_start=2", "--set", "strategy.refine_every=4",
                     "--set", "strategy.refine_stop=15", steps=16)  # fmt: skip
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 16 and summary["backend"].startswith("sharded/")
    from gstrain.train.shards import gather_shards

    state = gather_shards(run / "ckpt" / "step_16.shards")
    count = len(state["params"]["means"])
    assert 300 < count <= 330, count  # sampled past the initial 300, each owner within 165
    assert bool(torch.isfinite(state["params"]["means"]).all())


def test_one_rank_runs_the_plain_engine_with_absgrad_and_a_sharded_checkpoint(demo_scene, tmp_path):
    run = tmp_path / "run"
    proc = _torchrun(demo_scene, run, 1, "--set", "dist.always=true", "--set", "strategy.absgrad=true",
                     "--set", "strategy.grow_grad2d=0.0002", steps=12)
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    manifest = json.loads((run / "ckpt" / "step_12.shards" / "manifest.json").read_text())
    assert manifest["world"] == 1 and manifest["step"] == 12  # the distributed trainer's save
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 12 and not summary["backend"].startswith("sharded/"), summary  # the plain engine


class _PausedFor:
    """A live viewer stand-in whose page stays paused for `polls` quarter-second polls."""

    def __init__(self, polls: int) -> None:
        self.polls = polls

    def still_paused(self, should_stop) -> bool:
        time.sleep(0.05)
        self.polls -= 1
        return self.polls >= 0


def _hold(rank: int, world: int, polls: int) -> float:
    import torch
    import torch.distributed as dist

    from gstrain.distributed.trainer import hold_while_paused

    dist.barrier()  # both ranks past their imports: the clocks start together
    t0 = time.monotonic()
    hold_while_paused(_PausedFor(polls) if rank == 0 else None, torch.device("cpu"), lambda: False)
    return time.monotonic() - t0


def test_a_paused_page_holds_every_rank_until_it_resumes():
    """Rank 0's pause (6 polls of 0.05 s here) holds rank 1 as well; a page not paused holds nobody."""
    from gstrain.distributed.local import run_local

    held = run_local(_hold, 2, 6, timeout=180)  # two processes importing torch on a busy machine
    assert all(h >= 6 * 0.05 for h in held), held
    free = run_local(_hold, 2, 0, timeout=180)
    assert all(h < 6 * 0.05 for h in free), free
