"""Checkpoints hold plain data and are read without unpickling objects: a crafted checkpoint or
shard in someone else's run folder is refused with one line and runs nothing. Older checkpoints
(the numpy random state as an array) stay readable."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from gstrain.errors import UserError
from gstrain.train.checkpoint import load_latest_checkpoint, save_checkpoint
from gstrain.train.run_state import _rng_state, _set_rng_state
from gstrain.train.state_file import UnsafeStateFile, load_state
from tests.cli_util import assert_one_error, call_cli

FIT = ("--device", "cpu", "--steps", "8", "--set", "model.init=random", "--set", "model.init_points=300",
       "--set", "log.eval_steps=[]", "--set", "log.save_steps=[]", "--set", "log.ckpt_every=4",
       "--set", "log.keep_ckpts=0")  # fmt: skip


class CreatesFile:
    """Unpickling this opens (creates) `target`: what a hostile checkpoint would do, harmlessly."""

    def __init__(self, target) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.fixture(scope="module")
def trained(demo_scene, tmp_path_factory):
    """A single-process run with checkpoints at steps 4 and 8."""
    run = tmp_path_factory.mktemp("safety") / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, *FIT)
    assert code == 0, err
    return run


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_new_checkpoints_are_plain_data(trained):
    # torch's own weights-only reader, with no allowlist of ours, reads every checkpoint
    for path in (trained / "ckpt").glob("*.pt"):
        state = torch.load(path, weights_only=True)
        assert state["step"] in (4, 8) and isinstance(state["rng"]["numpy"]["state"]["key"], list)


def test_crafted_checkpoint_is_refused_and_runs_nothing(trained, demo_scene, tmp_path):
    run = _copy(trained, tmp_path)
    target = tmp_path / "pwned"
    state = torch.load(run / "ckpt" / "step_8.pt", weights_only=True)
    torch.save({**state, "step": 12, "extra": CreatesFile(target)}, run / "ckpt" / "step_12.pt")
    # the payload works: an unrestricted load creates the file (the fault the reader prevents)
    torch.load(run / "ckpt" / "step_12.pt", weights_only=False)
    assert target.exists()
    target.unlink()
    before = (run / "ckpt" / "step_12.pt").read_bytes()

    assert_one_error(*call_cli("eval", run, "--device", "cpu"), "step_12.pt", "io.open", "could run code")
    for args in (("export", run, "--out", tmp_path / "out.ply"),
                 ("fit", demo_scene, "--out", run, "--resume", "--device", "cpu")):  # fmt: skip
        code, err = call_cli(*args)
        assert_one_error(code, err, "step_12.pt", "never holds")
    with pytest.raises(UserError, match="step_12.pt is damaged"):
        load_latest_checkpoint(run)
    assert not target.exists()
    assert (run / "ckpt" / "step_12.pt").read_bytes() == before  # named, left as it was
    assert not (tmp_path / "out.ply").exists()


def test_older_checkpoint_with_a_numpy_random_state_still_loads(trained, tmp_path):
    """Checkpoints from before the plain random state held numpy.random.get_state()'s array."""
    run = _copy(trained, tmp_path)
    np.random.seed(123)
    legacy = np.random.get_state()
    expected = np.random.rand(5)  # what the generator gives after that state
    state = torch.load(run / "ckpt" / "step_8.pt", weights_only=True)
    state["rng"]["numpy"] = legacy
    torch.save(state, run / "ckpt" / "step_8.pt")
    loaded = load_latest_checkpoint(run)
    assert isinstance(loaded["rng"]["numpy"][1], np.ndarray)
    np.random.seed(0)
    _set_rng_state(loaded["rng"])
    assert np.array_equal(np.random.rand(5), expected)
    code, err = call_cli("export", run, "--out", tmp_path / "out.ply")
    assert code == 0, err


def test_plain_random_state_continues_the_generators():
    np.random.seed(7)
    np.random.normal()  # a cached Gaussian is part of the state too
    saved = _rng_state()
    expected = (np.random.normal(size=3), np.random.rand(3), torch.rand(3))
    np.random.seed(99)
    _set_rng_state(torch.load(_roundtrip(saved), weights_only=True))
    got = (np.random.normal(size=3), np.random.rand(3), torch.rand(3))
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert torch.equal(got[2], expected[2])


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_saving_refuses_anything_but_plain_data(tmp_path):
    with pytest.raises(TypeError, match=r"\['x'\] is a numpy.ndarray"):
        save_checkpoint(tmp_path, 1, {"step": 1, "params": {}, "x": np.zeros(2)})
    assert not (tmp_path / "ckpt" / "step_1.pt").exists()


def test_unsafe_file_names_what_it_asked_for(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"a": CreatesFile(tmp_path / "pwned")}, path)
    with pytest.raises(UnsafeStateFile, match=r"asks for io\.open, which"):
        load_state(path)
    assert not (tmp_path / "pwned").exists()


def test_numpy_one_names_of_the_array_reconstructor_are_read_too(tmp_path):
    """numpy 1.x pickled its arrays as numpy.core.multiarray._reconstruct (numpy 2: numpy._core)."""
    import io

    np.random.seed(1)
    legacy = np.random.get_state()
    buf = io.BytesIO()
    torch.save({"step": 1, "params": {}, "rng": {"numpy": legacy}}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    assert data.count(b"numpy._core.multiarray\n") == 1  # pickle's GLOBAL opcode: module and name on lines
    (tmp_path / "old.pt").write_bytes(data.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n"))
    assert np.array_equal(load_state(tmp_path / "old.pt")["rng"]["numpy"][1], legacy[1])
