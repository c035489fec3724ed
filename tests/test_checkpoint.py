import os

import pytest
import torch

from gstrain.errors import UserError
from gstrain.train.checkpoint import (
    CheckpointWriter,
    find_checkpoint,
    list_checkpoints,
    load_latest_checkpoint,
    require_checkpoint,
    save_checkpoint,
)
from gstrain.train.state_file import atomic_torch_save


def test_save_keeps_newest_and_loads_latest(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"step": step, "params": {}, "x": torch.full((3,), float(step))}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    state = load_latest_checkpoint(tmp_path)
    assert state["step"] == 30 and torch.equal(state["x"], torch.full((3,), 30.0))


def test_atomic_write_leaves_old_file_when_save_fails(tmp_path):
    path = tmp_path / "ckpt" / "step_1.pt"
    atomic_torch_save({"v": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        atomic_torch_save({"v": Unpicklable()}, path)
    assert torch.load(path, weights_only=False) == {"v": 1}
    assert [p for p in os.listdir(path.parent) if p.endswith(".tmp")] == []


def test_corrupt_newest_is_named_never_skipped_in_silence(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1, "params": {}}, keep=0)
    bad = tmp_path / "ckpt" / "step_2.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match=r"step_2\.pt is damaged .*--allow-older-checkpoint .*step_1\.pt"):
        load_latest_checkpoint(tmp_path)
    said = []
    state, path, damaged = find_checkpoint(tmp_path, allow_older=True, log=said.append)
    assert (state["step"], path.name, damaged) == (1, "step_1.pt", [bad])
    assert len(said) == 1 and "step_2.pt" in said[0] and "step_1.pt" in said[0]
    # a readable file that is not a checkpoint is damaged too
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(UserError, match="not a gstrain checkpoint"):
        load_latest_checkpoint(tmp_path)


def test_every_checkpoint_damaged_says_so(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step_5.pt").write_bytes(b"")
    with pytest.raises(UserError, match="only checkpoint .*step_5.pt is damaged"):
        require_checkpoint(tmp_path, allow_older=True)
    (tmp_path / "ckpt" / "step_6.pt").write_bytes(b"x")
    with pytest.raises(UserError, match="every checkpoint .* is damaged"):
        require_checkpoint(tmp_path, allow_older=True)


def test_missing_checkpoint_is_user_error(tmp_path):
    assert load_latest_checkpoint(tmp_path) is None
    with pytest.raises(UserError, match="no checkpoint"):
        require_checkpoint(tmp_path)


def test_background_writer_snapshots_state_and_keeps_newest(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2)
    x = torch.zeros(4)
    opt_state = {"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]}
    for step in (1, 2, 3):
        x.fill_(float(step))
        path = writer.save(step, {"step": step, "params": {}, "x": x, "opt": opt_state})
        x.fill_(-1.0)  # the loop goes on changing its tensors while the write is in flight
        opt_state["state"][0]["exp_avg"].fill_(-1.0)
        opt_state["state"][0]["exp_avg"] = torch.ones(2)
    writer.wait()
    assert path == tmp_path / "ckpt" / "step_3.pt"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3]
    state = load_latest_checkpoint(tmp_path)
    assert torch.equal(state["x"], torch.full((4,), 3.0))
    assert torch.equal(state["opt"]["state"][0]["exp_avg"], torch.ones(2))


def test_background_writer_reports_a_failed_write(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run folder should be")
    writer = CheckpointWriter(blocker)
    writer.save(1, {"step": 1})
    with pytest.raises(UserError, match="could not write a checkpoint"):
        writer.wait()
    writer.wait()  # the error is reported once
