"""Issue 35's fit-side cases: an exposed or empty viewer host, a run pruned to nothing, a factor
that leaves no image, two fits on one run folder, more threads than CPUs, a moved scene, and a
seed out of range. Each ends in one line (or one note), never a traceback or a silent run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli

from gstrain.train.checkpoint import list_checkpoints

TINY = ["--device", "cpu", "--set", "log.progress_every=2", "--set", "model.sh_degree=1",
        "--set", "log.ckpt_every=2", "--set", "log.keep_ckpts=0", "--set", "strategy.refine_start=100",
        "--set", "log.eval_steps=[]", "--set", "log.save_steps=[]", "--seed", "5"]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _fit(scene: Path, run: Path, steps: int, *extra: str) -> None:
    code, err = call_cli("fit", scene, "--out", run, "--steps", str(steps), *TINY, *extra)
    assert code == 0, err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, demo_scene: Path) -> Path:
    run = tmp_path_factory.mktemp("faults_fit") / "run"
    _fit(demo_scene, run, 2)
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------- 5: the viewer's host
def test_empty_host_is_refused(tiny_run: Path, demo_scene: Path, tmp_path: Path) -> None:
    assert_one_error(*call_cli("view", tiny_run, "--host", ""), "--host", "empty")
    assert_one_error(*call_cli("view", tiny_run, "--host", "  "), "--host", "empty")
    out = tmp_path / "run"
    assert_one_error(*call_cli("fit", demo_scene, "--out", out, "--steps", "2", "--viewer", "--device", "cpu",
                               "--set", "viewer.host="), "viewer.host", "empty")
    assert not out.exists()


def test_non_loopback_host_warns_once() -> None:
    from gstrain.viewer.serve import check_host, start_server, stop_quietly

    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert check_host(host) is None, host
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        assert "not a loopback address" in check_host(host), host
    said: list[str] = []
    server = start_server("0.0.0.0", _free_port(), log=said.append, key="viewer.host")
    try:
        assert len(said) == 1 and said[0].startswith("gstrain: warning: viewer.host 0.0.0.0"), said
    finally:
        stop_quietly(server)


# ------------------------------------------------------------------- 6: pruned to nothing
def test_pruning_every_gaussian_stops_and_keeps_the_last_good_checkpoint(demo_scene: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "40", "--device", "cpu",
                         "--set", "strategy.prune_opa=0.99", "--set", "strategy.refine_start=10",
                         "--set", "strategy.refine_every=10", "--set", "log.ckpt_every=5",
                         "--set", "log.keep_ckpts=0", "--set", "model.sh_degree=1", "--set", "log.save_steps=[]")
    assert_one_error(code, err, "strategy.prune_opa=0.99", "pruned every Gaussian")
    assert "done at step" not in err
    found = list_checkpoints(run)
    assert found, err
    emptied = int(re.search(r"densification at step (\d+) pruned", err).group(1))
    assert max(step for step, _ in found) < emptied  # none saved once the model was empty
    for _step, path in found:  # every kept checkpoint still has Gaussians: none saved after the prune
        state = torch.load(path, map_location="cpu", weights_only=False)
        assert state["params"]["means"].shape[0] > 0
    code, err = call_cli("eval", run, "--device", "cpu")  # the run is still usable
    assert code == 0, err


# ------------------------------------------------------------------- 7: a factor that leaves no image
def test_factor_leaving_tiny_images_is_refused(demo_scene: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_one_error(*call_cli("fit", demo_scene, "--out", out, "--factor", "200", "--steps", "2", *TINY),
                     "factor 200", "64x64", "1x1", "16 px")
    # 64 / 5 rounds to 13 px, under the 16 px floor; 64 / 4 is exactly 16
    assert_one_error(*call_cli("fit", demo_scene, "--out", out, "--factor", "5", "--steps", "2", *TINY),
                     "13x13")
    assert not out.exists()
    from gstrain.data.colmap import load_scene

    view = load_scene(demo_scene, factor=4).train[0]
    assert (view.width, view.height) == (16, 16)


# ------------------------------------------------------------------- 10: one fit per run folder
def test_second_fit_on_a_running_run_is_refused_and_a_kill_leaves_no_stale_lock(
    tiny_run: Path, demo_scene: Path, tmp_path: Path
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([sys.executable, "-m", "gstrain", "fit", str(demo_scene), "--out", str(run), "--resume",
                              "--steps", "100000", *TINY], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 90
        while not any(step > 2 for step, _ in list_checkpoints(run)):  # the first fit is training
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first fit did not train in 90 s"
            time.sleep(0.2)
        config = (run / "config.yaml").read_bytes()
        # without the lock it would train on beside the first (stop_at: briefly, so that it would end)
        code, err = call_cli("fit", demo_scene, "--out", run, "--resume", "--steps", "100000", *TINY,
                             "--set", "train.ssim_lambda=0.5", "--set", "train.stop_at=1")
        assert_one_error(code, err, str(run), "in use by another gstrain", f"pid {first.pid}")
        assert "keeps checkpoint" not in err  # it wrote nothing, so it says nothing about the folder
        assert (run / "config.yaml").read_bytes() == config  # its merged config was not saved
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock
        first.communicate()
    code, err = call_cli("fit", demo_scene, "--out", run, "--resume", "--steps", str(max(s for s, _ in
                         list_checkpoints(run)) + 2), *TINY)
    assert code == 0, err


def test_fresh_fit_into_a_locked_folder_is_refused(tmp_path: Path, demo_scene: Path) -> None:
    from gstrain.run_lock import RunLock

    run = tmp_path / "run"
    run.mkdir()
    held = RunLock(run)  # another fit that has just made the folder (an flock conflicts within a process too)
    held.acquire()
    try:
        assert_one_error(*call_cli("fit", demo_scene, "--out", run, "--steps", "2", *TINY), "in use by another gstrain")
        assert sorted(p.name for p in run.iterdir()) == [".gstrain.lock"]
    finally:
        held.release()
    _fit(demo_scene, run, 2)  # the lock file alone does not make the folder someone else's


# ------------------------------------------------------------------- 11: threads
def test_more_threads_than_cpus_are_capped_with_a_note(demo_scene: Path, tmp_path: Path) -> None:
    from gstrain.threads import apply_threads

    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    said: list[str] = []
    try:
        assert apply_threads(1000, torch.device("cpu"), said.append) == cpus
        assert torch.get_num_threads() == cpus
        assert said == [f"gstrain: train.threads=1000 is more than the {cpus} CPUs this process may use; using {cpus}"]
        # one over is enough to be capped (a test that stays fast where nothing caps it)
        code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "1", *TINY,
                             "--threads", str(cpus + 1))
        assert code == 0, err
        assert f"train.threads={cpus + 1} is more than the {cpus} CPUs" in err
        assert f"{cpus} CPU threads" in err
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------- 12: a moved scene
def test_moved_scene_with_scene_flag_and_resume(demo_scene: Path, tmp_path: Path) -> None:
    import shutil

    from gstrain.data.demo import write_demo_scene

    first = tmp_path / "scene_a"
    shutil.copytree(demo_scene, first)
    run = tmp_path / "run"
    _fit(first, run, 2)
    moved = first.rename(tmp_path / "scene_b")
    assert_one_error(*call_cli("eval", run, "--device", "cpu"), "missing", "--scene")
    other = write_demo_scene(tmp_path / "other", n_views=16, width=64, height=64, seed=1)  # other poses
    before = _digest(run)
    assert_one_error(*call_cli("eval", run, "--device", "cpu", "--scene", other), "is not the scene")
    assert_one_error(*call_cli("render", run, "--scene", other, "--frames", "1", "--size", "16x16"),
                     "is not the scene")
    assert _digest(run) == before

    code, err = call_cli("eval", run, "--device", "cpu", "--scene", moved)
    assert code == 0, err
    assert json.loads((run / "run.json").read_text())["scene"] == str(moved.resolve())
    code, err = call_cli("render", run, "--frames", "1", "--size", "16x16")  # found through run.json now
    assert code == 0, err

    again = moved.rename(tmp_path / "scene_c")  # fit --resume takes the moved scene as its SCENE
    assert_one_error(*call_cli("fit", other, "--out", run, "--resume", "--steps", "4", *TINY), "is not the scene")
    code, err = call_cli("fit", again, "--out", run, "--resume", "--steps", "4", *TINY)
    assert code == 0, err
    assert json.loads((run / "run.json").read_text())["scene"] == str(again.resolve())
    assert max(s for s, _ in list_checkpoints(run)) == 4


# ------------------------------------------------------------------- 15: the seed's range
def test_seed_out_of_range_is_one_line_for_the_flag_and_a_saved_config(tiny_run: Path, demo_scene: Path,
                                                                        tmp_path: Path) -> None:
    import shutil

    import yaml

    from gstrain.config import build_config

    out = tmp_path / "new"
    assert_one_error(*call_cli("fit", demo_scene, "--out", out, "--steps", "2", *TINY[:-2],
                               "--seed", "99999999999999999999"),
                     "train.seed", "99999999999999999999")
    assert not out.exists()
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["seed"] = 2**32
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    before = _digest(run)
    assert_one_error(*call_cli("fit", demo_scene, "--out", run, "--resume", "--steps", "4", *TINY[:-2]), "train.seed")
    assert _digest(run) == before
    # the range is what numpy's seed takes (torch's is wider): the largest passes, one more does not
    np.random.seed(2**32 - 1)
    with pytest.raises(ValueError):
        np.random.seed(2**32)
    assert build_config(overrides=[{"train": {"seed": 2**32 - 1}}]).train.seed == 2**32 - 1


# ------------------------------------------------------------------- 16: dist.timeout_s
def test_dist_timeout_below_the_minimum_is_refused(demo_scene: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_one_error(*call_cli("fit", demo_scene, "--out", out, "--steps", "2", *TINY,
                               "--set", "dist.timeout_s=0.001"), "dist.timeout_s")
    assert not out.exists()
