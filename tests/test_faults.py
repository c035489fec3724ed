"""The cases a hostile user finds (issue 20): files gstrain did not write are never destroyed,
damaged checkpoints are named, faults end in one line, and resume/config checks come first.

Commands run in this process through the console entry point (call_cli), so that a fault such
as a full disk can be put in their way; signals are tested in test_signals.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from cli_util import TINY, assert_one_error, call_cli

from gstrain.train.checkpoint import list_checkpoints


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}



# ------------------------------------------------------------ files gstrain did not write
def test_render_never_touches_user_files(run_copy: Path, tmp_path: Path) -> None:
    mine = tmp_path / "frames"
    mine.mkdir()
    for i in range(3):
        (mine / f"{i:05d}.png").write_bytes(b"the user's own frame %d" % i)
    before = _digest(mine)
    render = ["render", run_copy, "--path", "orbit", "--size", "16x16"]
    assert_one_error(*call_cli(*render, "--frames", "2", "--out", mine), "did not write")
    assert_one_error(*call_cli(*render, "--frames", "2", "--out", mine, "--force"), "did not write")
    assert _digest(mine) == before

    ours = tmp_path / "ours"
    code, err = call_cli(*render, "--frames", "3", "--out", ours)
    assert code == 0, err
    assert sorted(p.name for p in ours.glob("*.png")) == ["00000.png", "00001.png", "00002.png"]
    assert_one_error(*call_cli(*render, "--frames", "2", "--out", ours), "--force")
    (ours / "notes.txt").write_text("the user's note, put beside our frames")
    code, err = call_cli(*render, "--frames", "2", "--out", ours, "--force")
    assert code == 0, err
    # the earlier render's three frames went, the new two came; the user's note stayed
    assert sorted(p.name for p in ours.glob("*.png")) == ["00000.png", "00001.png"]
    assert (ours / "notes.txt").read_text() == "the user's note, put beside our frames"

    video = tmp_path / "user.mp4"
    video.write_bytes(b"the user's own video")
    assert_one_error(*call_cli(*render, "--frames", "2", "--out", video), "exists", "--force")
    assert_one_error(*call_cli(*render, "--frames", "2", "--out", video, "--force"), "did not write")
    assert video.read_bytes() == b"the user's own video"


def test_fit_out_with_user_files_or_a_file(demo_scene: Path, tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("my: own config\n")
    (folder / "train_summary.json").write_text('{"mine": true}')
    before = _digest(folder)
    assert_one_error(*call_cli("fit", demo_scene, "--out", folder, "--steps", "2", *TINY), "did not write")
    assert _digest(folder) == before
    file = tmp_path / "a_file"
    file.write_text("x")
    assert_one_error(*call_cli("fit", demo_scene, "--out", file, "--steps", "2", *TINY), "is a file")
    assert file.read_text() == "x"


def test_export_refuses_links_devices_and_unwritable_paths(run_copy: Path, tmp_path: Path) -> None:
    target = tmp_path / "target.ply"
    target.write_bytes(b"the user's file")
    link = tmp_path / "link.ply"
    link.symlink_to(target)
    assert_one_error(*call_cli("export", run_copy, "--out", link), "symbolic link")
    assert link.is_symlink() and target.read_bytes() == b"the user's file"

    if Path("/dev/full").exists():
        assert_one_error(*call_cli("export", run_copy, "--out", "/dev/full"), "not a regular file")
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    assert_one_error(*call_cli("export", run_copy, "--out", blocker / "x.ply"), "cannot write")

    # with --force an earlier export is replaced, through a temp file in its folder (nothing left beside it)
    out = tmp_path / "out.ply"
    code, err = call_cli("export", run_copy, "--out", out)
    assert code == 0, err
    first = out.stat().st_ino
    code, err = call_cli("export", run_copy, "--out", out, "--force")
    assert code == 0, err
    assert out.stat().st_ino != first  # a new file renamed into place
    from gstrain.model import load_ply

    state = torch.load(run_copy / "ckpt" / "step_4.pt", weights_only=False)
    assert torch.equal(load_ply(out)["means"].detach(), state["params"]["means"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []


# ------------------------------------------------------------ damaged checkpoints
def test_damaged_newest_checkpoint_is_named_and_kept(run_copy: Path, demo_scene: Path) -> None:
    newest = run_copy / "ckpt" / "step_4.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated
    damaged = newest.read_bytes()
    for command in (["eval", run_copy], ["export", run_copy], ["render", run_copy, "--frames", "1"],
                    ["fit", demo_scene, "--out", run_copy, "--resume", "--steps", "6"]):
        assert_one_error(*call_cli(*command), "step_4.pt", "damaged", "--allow-older-checkpoint")
    assert newest.read_bytes() == damaged

    code, err = call_cli("export", run_copy, "--allow-older-checkpoint", "--out", run_copy / "older.ply")
    assert code == 0, err
    assert "step_4.pt" in err and "step_2.pt" in err  # which file is damaged, which one is used

    code, err = call_cli("fit", demo_scene, "--out", run_copy, "--resume", "--steps", "6",
                         "--allow-older-checkpoint")
    assert code == 0, err
    assert "step_2.pt (step 2)" in err
    # resumed from step 2, and the damaged file was set aside (not overwritten) where the user sees it
    assert (run_copy / "ckpt" / "step_4.pt.damaged").read_bytes() == damaged
    summary = json.loads((run_copy / "train_summary.json").read_text())
    assert summary["first_step"] == 2 and summary["steps"] == 6


def test_only_checkpoint_garbage_says_so(run_copy: Path) -> None:
    for _, path in list_checkpoints(run_copy):
        path.unlink()
    (run_copy / "ckpt" / "step_4.pt").write_bytes(b"garbage")
    assert_one_error(*call_cli("eval", run_copy), "only checkpoint", "step_4.pt", "damaged")
    assert_one_error(*call_cli("eval", run_copy, "--allow-older-checkpoint"), "only checkpoint")


# ------------------------------------------------------------ output errors, checkpoint first
def _disk_full_for(monkeypatch: pytest.MonkeyPatch, endings: tuple[str, ...]) -> None:
    """The disk fills up when a file with one of these endings is put in place (the last step
    of every atomic write), as a real ENOSPC would surface."""
    import gstrain.files

    real = gstrain.files.os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(endings):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(gstrain.files.os, "replace", replace)


def test_full_disk_keeps_the_last_good_checkpoint(demo_scene: Path, tmp_path: Path, monkeypatch) -> None:
    """The final checkpoint meets a full disk: one line naming it, the step-2 checkpoint intact,
    and no PLY was written before it (the run's state comes first)."""
    _disk_full_for(monkeypatch, ("step_4.pt", ".ply"))
    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "4", *TINY, "--set", "log.save_steps=[4]")
    assert_one_error(code, err, "no space left on device", "step_4.pt")
    assert f"keeps checkpoint {run / 'ckpt' / 'step_2.pt'}" in err
    assert torch.load(run / "ckpt" / "step_2.pt", weights_only=False)["step"] == 2
    assert not (run / "point_cloud").exists()
    assert [p.name for p in (run / "ckpt").iterdir()] == ["step_2.pt"]  # no temp file left


def test_full_disk_on_the_ply_after_the_checkpoint(demo_scene: Path, tmp_path: Path, monkeypatch) -> None:
    _disk_full_for(monkeypatch, (".ply",))
    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "4", *TINY, "--set", "log.save_steps=[4]")
    assert_one_error(code, err, "no space left on device", "point_cloud.ply")
    assert torch.load(run / "ckpt" / "step_4.pt", weights_only=False)["step"] == 4


def test_read_only_out_is_one_line(demo_scene: Path, tmp_path: Path, monkeypatch) -> None:
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if "readonly" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "readonly" / "run", "--steps", "2", *TINY)
    assert_one_error(code, err, "read-only")


# ------------------------------------------------------------ resume and config checks
def test_resume_with_incompatible_config_writes_nothing(run_copy: Path, demo_scene: Path) -> None:
    before = _digest(run_copy)
    code, err = call_cli("fit", demo_scene, "--out", run_copy, "--resume", "--set", "model.sh_degree=3")
    assert_one_error(code, err, "model.sh_degree: 1 -> 3")
    assert _digest(run_copy) == before
    code, err = call_cli("eval", run_copy)  # the run still works
    assert code == 0, err


def test_resume_with_another_scene_refuses(run_copy: Path, demo_scene: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(demo_scene, other)
    before = _digest(run_copy)
    assert_one_error(*call_cli("fit", other, "--out", run_copy, "--resume"), "was trained on", str(other))
    assert _digest(run_copy) == before


def test_resume_when_views_changed_refuses(run_copy: Path, demo_scene: Path, tmp_path: Path) -> None:
    """The same scene path with fewer training views than the checkpoint was trained on."""
    meta = json.loads((run_copy / "run.json").read_text())
    from gstrain.data.demo import write_demo_scene

    scene = tmp_path / "scene"
    write_demo_scene(scene, n_views=10, width=64, height=64, seed=0)  # the demo scene, with fewer views
    meta["scene"] = str(scene.resolve())
    (run_copy / "run.json").write_text(json.dumps(meta))
    assert_one_error(*call_cli("fit", scene, "--out", run_copy, "--resume", "--steps", "6"), "training views")


def test_eval_on_run_json_without_scene(run_copy: Path) -> None:
    meta = json.loads((run_copy / "run.json").read_text())
    del meta["scene"]
    (run_copy / "run.json").write_text(json.dumps(meta))
    assert_one_error(*call_cli("eval", run_copy), "does not name the scene")


@pytest.mark.parametrize("setting, needle", [
    ("log.progress_every=0", "log.progress_every must be >= 1"),
    ("log.tb_every=0", "log.tb_every must be >= 1"),
    ("train.sh_degree_interval=0", "train.sh_degree_interval must be >= 1"),
    ("optim.means_lr=-1e-4", "optim.means_lr must be a learning rate >= 0"),
    ("model.init_opacity=2", "model.init_opacity must be in (0, 1)"),
    ("data.background=[5,5,5]", "data.background must be three numbers in [0, 1]"),
    ("train.threads=-1", "train.threads must be >= 0"),
])
def test_fit_rejects_values_that_would_crash(demo_scene: Path, tmp_path: Path, setting: str, needle: str) -> None:
    out = tmp_path / "run"
    assert_one_error(*call_cli("fit", demo_scene, "--out", out, "--set", setting), needle)
    assert not out.exists()


def test_yaml_string_is_not_a_number(demo_scene: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text('train:\n  steps: "7"\n')
    assert_one_error(*call_cli("fit", demo_scene, "--config", cfg, "--out", tmp_path / "r"),
                     "train.steps", "expects an integer")


# ------------------------------------------------------------ dead-end folders
def test_folder_without_checkpoint_is_reusable_and_resumable(demo_scene: Path, tmp_path: Path) -> None:
    """A run folder left without a checkpoint (a crash before the first one) resumes at step 0 to
    the same result as an uninterrupted run, and a fresh fit may reuse it too."""
    full, dead = tmp_path / "full", tmp_path / "dead"
    code, err = call_cli("fit", demo_scene, "--out", full, "--steps", "4", *TINY)
    assert code == 0, err
    shutil.copytree(full, dead)
    shutil.rmtree(dead / "ckpt")
    (dead / "train_summary.json").unlink()
    reused = tmp_path / "reused"
    shutil.copytree(dead, reused)

    code, err = call_cli("fit", demo_scene, "--out", dead, "--resume", "--steps", "4", *TINY)
    assert code == 0, err
    assert "starting at step 0" in err
    code, err = call_cli("fit", demo_scene, "--out", reused, "--steps", "4", *TINY)
    assert code == 0, err
    assert "reusing" in err
    a = torch.load(full / "ckpt" / "step_4.pt", weights_only=False)
    for run in (dead, reused):
        b = torch.load(run / "ckpt" / "step_4.pt", weights_only=False)
        for key in a["params"]:
            assert torch.equal(a["params"][key], b["params"][key]), (run.name, key)
