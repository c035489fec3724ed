"""A sharded checkpoint whose shards are not the ones its manifest lists (from another step,
another rank, changed since, or crafted) is refused by name, like any damaged checkpoint: by
eval, export, a W=1 resume and, on every rank with the same line, a W=2 resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gstrain.distributed.local import run_local
from gstrain.errors import UserError
from gstrain.train.checkpoint import find_checkpoint
from tests.cli_util import assert_one_error, call_cli

TORCHRUN = Path(sys.executable).with_name("torchrun")
pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python")
FIT = ("--device", "cpu", "--set", "model.init=random", "--set", "model.init_points=300", "--set", "train.batch_size=2",
       "--set", "log.eval_steps=[]", "--set", "log.save_steps=[]", "--set", "log.ckpt_every=4",
       "--set", "log.keep_ckpts=0")  # fmt: skip


def _torchrun(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--nproc-per-node=2", "-m", "gstrain", "fit", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


class CreatesFile:
    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.fixture(scope="module")
def sharded(demo_scene, tmp_path_factory):
    """A W=2 run with sharded checkpoints at steps 4 and 8."""
    run = tmp_path_factory.mktemp("shards") / "run"
    proc = _torchrun(demo_scene, "--out", run, "--steps", "8", *FIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run(sharded, tmp_path):
    shutil.copytree(sharded, tmp_path / "run")
    return tmp_path / "run"


def _shards(run: Path, step: int) -> Path:
    return run / "ckpt" / f"step_{step}.shards"


@pytest.mark.slow
def test_shards_carry_rank_step_world_and_the_manifest_their_digests(sharded):
    folder = _shards(sharded, 8)
    manifest = json.loads((folder / "manifest.json").read_text())
    for rank in (0, 1):
        data = (folder / f"rank{rank}.pt").read_bytes()
        assert manifest["shards"][rank] == {"file": f"rank{rank}.pt", "bytes": len(data),
                                            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
        stamp = torch.load(folder / f"rank{rank}.pt", weights_only=True)["shard"]
        assert stamp == {"rank": rank, "world": 2, "step": 8}


def test_shard_from_another_step_is_named(run, demo_scene, tmp_path):
    shutil.copy(_shards(run, 4) / "rank1.pt", _shards(run, 8) / "rank1.pt")
    assert_one_error(*call_cli("eval", run, "--device", "cpu"), "step_8.shards", "rank1.pt is from step 4, not 8")
    for args in (("export", run, "--out", tmp_path / "out.ply"),
                 ("fit", demo_scene, "--out", run, "--resume", "--device", "cpu")):  # W=1 resume  # fmt: skip
        code, err = call_cli(*args)
        assert_one_error(code, err, "step_8.shards", "rank1.pt is from step 4")
    assert not (tmp_path / "out.ply").exists()
    # as for any damaged newest checkpoint, the older one is used only when asked, and named
    said: list[str] = []
    state, path, damaged = find_checkpoint(run, allow_older=True, log=said.append)
    assert (state["step"], path.name, damaged) == (4, "step_4.shards", [_shards(run, 8)])
    assert "step_8.shards" in said[0]


def test_one_ranks_file_copied_over_another_is_named(run):
    folder = _shards(run, 8)
    shutil.copy(folder / "rank0.pt", folder / "rank1.pt")
    code, err = call_cli("eval", run, "--device", "cpu")
    assert_one_error(code, err, "rank1.pt holds rank 0's shard, not rank 1's")


def test_shard_changed_since_it_was_written_is_named(run):
    shard = _shards(run, 8) / "rank1.pt"
    state = torch.load(shard, weights_only=True)  # rank, step and world still right
    state["params"]["opacities"] += 1.0
    torch.save(state, shard)
    code, err = call_cli("eval", run, "--device", "cpu")
    assert_one_error(code, err, "rank1.pt is not the file manifest.json lists", "sha256")


def test_renamed_shards_folder_is_named(run):
    _shards(run, 4).rename(_shards(run, 12))
    code, err = call_cli("eval", run, "--device", "cpu")
    assert_one_error(code, err, "step_12.shards", "is from step 4, not 12")


def test_crafted_shard_is_refused_and_runs_nothing(run, tmp_path):
    target = tmp_path / "pwned"
    shard = _shards(run, 8) / "rank1.pt"
    torch.save({**torch.load(shard, weights_only=True), "extra": CreatesFile(target)}, shard)
    for args in (("eval", run, "--device", "cpu"), ("export", run, "--out", tmp_path / "out.ply")):
        code, err = call_cli(*args)
        assert_one_error(code, err, "step_8.shards", "rank1.pt", "io.open", "could run code")
    assert not target.exists()


def test_manifest_without_digests_is_still_read_and_checked(run, tmp_path):
    """Manifests of format 1 list no digests: the shards' own rank, step and world still count."""
    for step in (4, 8):
        path = _shards(run, step) / "manifest.json"
        manifest = json.loads(path.read_text())
        del manifest["shards"]
        path.write_text(json.dumps({**manifest, "format": 1}))
    code, err = call_cli("export", run, "--out", tmp_path / "out.ply")
    assert code == 0, err
    shutil.copy(_shards(run, 4) / "rank0.pt", _shards(run, 8) / "rank0.pt")
    code, err = call_cli("eval", run, "--device", "cpu")
    assert_one_error(code, err, "rank0.pt is from step 4, not 8")


def test_two_rank_resume_of_a_mixed_folder_stops_every_rank_with_one_line(run, demo_scene):
    shutil.copy(_shards(run, 4) / "rank1.pt", _shards(run, 8) / "rank1.pt")
    before = {p.name: p.read_bytes() for p in _shards(run, 8).iterdir()}
    proc = _torchrun(demo_scene, "--out", run, "--resume", "--steps", "12", *FIT)
    assert proc.returncode != 0
    line = (f"gstrain: error: checkpoint {_shards(run, 8)} is damaged (rank1.pt is from step 4, not 8); "
            f"pass --allow-older-checkpoint")  # fmt: skip
    errors = [x for x in proc.stderr.splitlines() if x.startswith("gstrain: error:")]
    assert len(errors) == 2 and all(x.startswith(line) for x in errors), proc.stderr[-3000:]
    assert proc.stderr.count("exitcode  : 2") == 2  # torchrun's report: both ranks exited 2
    assert "collective" not in proc.stderr.lower() and "another rank died" not in proc.stderr
    assert {p.name: p.read_bytes() for p in _shards(run, 8).iterdir()} == before
    assert not _shards(run, 12).exists()


def _save_fails_on_rank_one(rank: int, world: int, run: str) -> str:
    import gstrain.distributed.checkpoint as sharded_checkpoint

    if rank == 1:  # its disk is full: write_atomic turns the OSError into one line (a UserError)
        def full(obj, path):
            raise UserError(f"no space left on device while writing {path}")

        sharded_checkpoint.save_state = full
    state = {"step": 3, "params": {"means": torch.zeros(2, 3)}}
    try:
        sharded_checkpoint.save_sharded(Path(run), 3, state, rank, world, [2, 2], "locality")
    except UserError as exc:
        return str(exc)
    return "published"


def test_a_rank_that_cannot_write_its_shard_stops_every_rank_with_its_reason(tmp_path):
    said = run_local(_save_fails_on_rank_one, 2, str(tmp_path), timeout=20)
    assert said[1].startswith(f"could not write a sharded checkpoint under {tmp_path / 'ckpt'}: no space left")
    assert "another rank failed to write its shard: no space left on device" in said[0]
    assert not (tmp_path / "ckpt" / "step_3.shards").exists()
