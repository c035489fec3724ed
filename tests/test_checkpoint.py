import os

import pytest
import torch

from gstrain.errors import UserError
from gstrain.train.checkpoint import (
    atomic_torch_save,
    list_checkpoints,
    load_latest_checkpoint,
    require_checkpoint,
    save_checkpoint,
)


def test_save_keeps_newest_and_loads_latest(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"step": step, "x": torch.full((3,), float(step))}, keep=2)
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


def test_corrupt_newest_falls_back(tmp_path):
    save_checkpoint(tmp_path, 1, {"step": 1}, keep=0)
    (tmp_path / "ckpt" / "step_2.pt").write_bytes(b"not a checkpoint")
    assert load_latest_checkpoint(tmp_path)["step"] == 1


def test_missing_checkpoint_is_user_error(tmp_path):
    assert load_latest_checkpoint(tmp_path) is None
    with pytest.raises(UserError, match="no checkpoint"):
        require_checkpoint(tmp_path)
