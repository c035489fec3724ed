"""No lost files, round 2 (issue 35): export, demo-scene and sfm never replace a file gstrain did not
write, nor a run's own records; export's format follows the file name; every output gets the
mode open() would give it; a run with 0 Gaussians is one line in export and view.

Data-loss cases compare digests and modes of every file before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_util import TINY, assert_one_error, call_cli


def _files(folder: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, permission bits) of every file under folder."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _user_file(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)



def _num_gaussians(run: Path) -> int:
    return int(torch.load(run / "ckpt" / "step_4.pt", weights_only=False)["params"]["means"].shape[0])


# ------------------------------------------------------------ 1. export over files
def test_export_refuses_a_users_file_without_force(run_copy: Path, tmp_path: Path) -> None:
    mine = _user_file(tmp_path / "user.ply", "data\n")
    before = _files(tmp_path)
    assert_one_error(*call_cli("export", run_copy, "--out", mine), "exists", "--force")
    assert _files(tmp_path) == before
    # --force replaces only what gstrain wrote: the user's file keeps its bytes and mode
    assert_one_error(*call_cli("export", run_copy, "--out", mine, "--force"), "did not write", str(mine))
    assert _files(tmp_path) == before
    # gstrain's own export is replaced with --force, and keeps its mode (as open() would)
    ours = tmp_path / "ours.ply"
    code, err = call_cli("export", run_copy, "--out", ours)
    assert code == 0, err
    ours.chmod(0o640)
    first = ours.stat().st_ino
    code, err = call_cli("export", run_copy, "--out", ours, "--force")
    assert code == 0, err
    assert ours.stat().st_ino != first and stat.S_IMODE(ours.stat().st_mode) == 0o640
    # the run's own export folder is gstrain's: the default export is replaced without --force
    for _ in range(2):
        code, err = call_cli("export", run_copy)
        assert code == 0, err
    assert (run_copy / "point_cloud" / "iteration_4" / "point_cloud.ply").is_file()


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_export_never_writes_among_a_runs_records(run_copy: Path, tiny_run: Path, force: list[str]) -> None:
    before = _files(run_copy)
    for target in ("ckpt/step_4.pt", "ckpt/step_9.ply", "ckpt/new/x.ply", "config.yaml", "run.json",
                   "train_summary.json", "tb/x.ply"):
        code, err = call_cli("export", run_copy, "--out", run_copy / target, *force)
        assert_one_error(code, err, "choose another path")
    # the same guard for another run's folder, named through a path with '..' in it
    sneaky = run_copy / "point_cloud" / ".." / "ckpt" / "step_4.pt"
    assert_one_error(*call_cli("export", tiny_run, "--out", sneaky, *force), "ckpt")
    assert _files(run_copy) == before
    code, err = call_cli("eval", run_copy, "--device", "cpu")  # the checkpoint still loads
    assert code == 0, err


def test_render_never_writes_among_a_runs_records(run_copy: Path) -> None:
    before = _files(run_copy)
    render = ["render", run_copy, "--frames", "1", "--size", "16x16", "--force"]
    assert_one_error(*call_cli(*render, "--out", run_copy / "ckpt" / "frames"), "ckpt")
    assert_one_error(*call_cli(*render, "--out", run_copy / "tb" / "v.mp4"), "tb")
    assert _files(run_copy) == before


# ------------------------------------------------------------ 8. export format from the name
def _kind(path: Path) -> str:
    head = path.read_bytes()[:2000]
    if not head.startswith(b"ply\n"):
        return "splat"
    return "ply-compressed" if b"element chunk" in head else "ply"


def test_export_format_follows_the_extension(run_copy: Path, tmp_path: Path) -> None:
    n = _num_gaussians(run_copy)
    for name, kind in (("a.splat", "splat"), ("b.ply", "ply"), ("c.compressed.ply", "ply-compressed"),
                       ("D.SPLAT", "splat"), ("e.bin", "ply")):
        code, err = call_cli("export", run_copy, "--out", tmp_path / name)
        assert code == 0, (name, err)
        assert _kind(tmp_path / name) == kind, name
    assert (tmp_path / "a.splat").stat().st_size == 32 * n  # 32 bytes a Gaussian, every one finite
    # a compressed PLY is a PLY file: --format ply-compressed may name it plain .ply
    code, err = call_cli("export", run_copy, "--format", "ply-compressed", "--out", tmp_path / "f.ply")
    assert code == 0, err
    assert _kind(tmp_path / "f.ply") == "ply-compressed"


@pytest.mark.parametrize("fmt, name", [("splat", "b.ply"), ("ply", "x.splat"), ("ply", "x.compressed.ply"),
                                       ("splat", "x.compressed.ply"), ("ply-compressed", "x.splat")])
def test_export_format_contradicting_the_extension_is_refused(run_copy: Path, tmp_path: Path, fmt: str,
                                                              name: str) -> None:
    assert_one_error(*call_cli("export", run_copy, "--format", fmt, "--out", tmp_path / name), "does not match")
    assert not (tmp_path / name).exists()


# ------------------------------------------------------------ 9. modes of outputs
@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_outputs_get_the_mode_open_would_give(demo_scene: Path, tmp_path: Path, mask: int) -> None:
    expected = 0o666 & ~mask
    run = tmp_path / "run"
    with _umask(mask):
        code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "2", *TINY)
        assert code == 0, err
        code, err = call_cli("export", run, "--out", tmp_path / "x.splat")
        assert code == 0, err
        code, err = call_cli("render", run, "--frames", "2", "--size", "16x16", "--out", tmp_path / "v.mp4")
        assert code == 0, err
        reference = tmp_path / "by_open"
        with open(reference, "w"):
            pass
    assert stat.S_IMODE(reference.stat().st_mode) == expected  # what open() gives, independently
    outputs = [run / "ckpt" / "step_2.pt", run / "config.yaml", run / "run.json", run / "train_summary.json",
               run / "point_cloud" / "iteration_2" / "point_cloud.ply", tmp_path / "x.splat", tmp_path / "v.mp4"]
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in outputs}
    assert modes == {p.name: oct(expected) for p in outputs}


# ------------------------------------------------------------ 13, 14. a run with 0 Gaussians
def _emptied(value, n: int):
    """value with every tensor whose first dimension is n cut to 0 rows (params and optimizer state)."""
    if torch.is_tensor(value):
        return value[:0].clone() if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, dict):
        return {k: _emptied(v, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_emptied(v, n) for v in value)
    return value


@pytest.fixture
def empty_run(run_copy: Path) -> Path:
    """run_copy whose newest checkpoint holds 0 Gaussians (as a run that pruned everything would)."""
    path = run_copy / "ckpt" / "step_4.pt"
    state = torch.load(path, weights_only=False)
    n = int(state["params"]["means"].shape[0])
    torch.save(_emptied(state, n), path)
    (run_copy / "ckpt" / "step_2.pt").unlink()
    return run_copy


@pytest.mark.parametrize("fmt", ["ply", "splat", "ply-compressed"])
def test_export_of_zero_gaussians_is_one_line(empty_run: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / f"x.{fmt}"
    assert_one_error(*call_cli("export", empty_run, "--format", fmt, "--out", out), "0 Gaussians")
    assert not out.exists()


def test_export_when_no_gaussian_survives_the_format(tmp_path: Path) -> None:
    from gstrain.errors import UserError
    from gstrain.formats import export_gaussians

    n = 300
    gen = torch.Generator().manual_seed(0)
    p = {"means": torch.randn(n, 3, generator=gen), "scales": torch.randn(n, 3, generator=gen) - 3,
         "quats": torch.randn(n, 4, generator=gen), "opacities": torch.full((n,), -8.0),  # all under 1/255
         "sh0": torch.randn(n, 1, 3, generator=gen), "shN": torch.zeros(n, 3, 3)}
    with pytest.raises(UserError, match="none of the 300 Gaussians"):
        export_gaussians(p, tmp_path / "x.compressed.ply", "ply-compressed")
    assert not (tmp_path / "x.compressed.ply").exists()
    # one NaN opacity drops that Gaussian only (gsplat's own check would drop every one)
    p["opacities"] = torch.zeros(n)
    p["opacities"][7] = float("nan")
    assert export_gaussians(p, tmp_path / "x.splat", "splat") == n - 1
    assert (tmp_path / "x.splat").stat().st_size == 32 * (n - 1)


def test_view_of_zero_gaussians_is_one_line(empty_run: Path) -> None:
    pytest.importorskip("viser")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert_one_error(*call_cli("view", empty_run, "--port", str(port)), "0 Gaussians")


def test_splat_arrays_of_no_gaussians_are_empty() -> None:
    from gstrain.viewer.convert import splat_arrays

    p = {"means": torch.zeros(0, 3), "scales": torch.zeros(0, 3), "quats": torch.zeros(0, 4),
         "opacities": torch.zeros(0), "sh0": torch.zeros(0, 1, 3)}
    arrays = splat_arrays(p)
    assert {k: v.shape for k, v in arrays.items()} == {
        "centers": (0, 3), "covariances": (0, 3, 3), "rgbs": (0, 3), "opacities": (0, 1)}


# ------------------------------------------------------------ 2. demo-scene over a folder
def _sfm_like_scene(folder: Path) -> Path:
    """What `gstrain sfm photos folder` leaves, with the user's own photo names among them."""
    for name in ("000.png", "IMG_1.jpg", "IMG_2.jpg"):
        _user_file(folder / "images" / name, f"the user's photo {name}")
    for name in ("cameras.bin", "images.bin", "points3D.bin"):
        _user_file(folder / "sparse" / "0" / name, f"the user's model {name}", 0o640)
    _user_file(folder / "sfm.json", json.dumps({"photos": [], "files": ["images/000.png"]}))
    return folder


@pytest.mark.parametrize("setup", ["sfm", "readme", "thesis_in_images"])
def test_demo_scene_never_writes_over_a_folder_it_did_not_fill(tmp_path: Path, setup: str) -> None:
    out = tmp_path / "out"
    if setup == "sfm":
        _sfm_like_scene(out)
    elif setup == "readme":
        _user_file(out / "readme.md", "notes")
    else:
        _user_file(out / "images" / "thesis.txt", "years of work", 0o600)
    before = _files(out)
    for force in ([], ["--force"]):
        code, err = call_cli("demo-scene", out, "--views", "2", "--size", "16", *force)
        assert_one_error(code, err, "did not write")
    assert _files(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no workspace left behind


def test_demo_scene_force_replaces_only_its_own_files(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    code, err = call_cli("demo-scene", out, "--views", "4", "--size", "16")
    assert code == 0, err
    first = _files(out)
    assert_one_error(*call_cli("demo-scene", out, "--views", "3", "--size", "16"), "--force")
    assert _files(out) == first
    note = _user_file(out / "notes.md", "the user's notes beside the scene", 0o600)
    code, err = call_cli("demo-scene", out, "--views", "3", "--size", "16", "--force")
    assert code == 0, err
    after = _files(out)
    assert sorted(p.name for p in (out / "images").iterdir()) == ["000.png", "001.png", "002.png"]
    assert after["notes.md"] == (hashlib.sha256(b"the user's notes beside the scene").hexdigest(), 0o600)
    assert note.read_text() == "the user's notes beside the scene"
    # a user's file among the scene's images would be read with it: refused, even with --force
    _user_file(out / "images" / "mine.png", "the user's picture")
    before = _files(out)
    assert_one_error(*call_cli("demo-scene", out, "--views", "2", "--size", "16", "--force"), "images/mine.png")
    assert _files(out) == before


# ------------------------------------------------------------ 3. sfm over a folder
@pytest.fixture
def photos(demo_scene: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("000.png", "001.png", "002.png"):
        shutil.copy(demo_scene / "images" / name, folder / name)
    return folder


@pytest.mark.parametrize("user_file", ["thesis.txt", "images/mypic.png", "readme.md"])
def test_sfm_refuses_a_folder_of_user_files_even_with_force(photos: Path, tmp_path: Path, user_file: str) -> None:
    out = tmp_path / "out"
    _user_file(out / user_file, "the user's own work", 0o640)
    before = _files(out)
    for force in ([], ["--force"]):
        code, err = call_cli("sfm", photos, out, *force)
        assert_one_error(code, err, "did not write", Path(user_file).name)
        assert "different scene" not in err
    assert _files(out) == before


def _fake_reconstruct(pycolmap, photos, names, sizes, work, model, matcher, max_size, notes, log):
    """The SfM stages' output without COLMAP: the photos as undistorted images and a model."""
    (work / "undistorted" / "images").mkdir(parents=True)
    (work / "undistorted" / "sparse").mkdir()
    for name in names:
        shutil.copy(photos / name, work / "undistorted" / "images" / name)
    for part in ("cameras", "images", "points3D"):
        (work / "undistorted" / "sparse" / f"{part}.bin").write_bytes(f"model {part} of {names}".encode())
    return len(names), 10, 0.5, [None]


def test_sfm_force_replaces_only_what_sfm_json_lists(photos: Path, tmp_path: Path, monkeypatch) -> None:
    import gstrain.sfm

    monkeypatch.setattr(gstrain.sfm, "_reconstruct", _fake_reconstruct)
    out = tmp_path / "scene"
    code, err = call_cli("sfm", photos, out)
    assert code == 0, err
    listed = json.loads((out / "sfm.json").read_text())["files"]
    assert sorted(listed) == sorted(str(p.relative_to(out)) for p in out.rglob("*")
                                    if p.is_file() and p.name != "sfm.json")
    readme = _user_file(out / "readme.md", "how I took the photos", 0o600)
    keep = _files(out)["readme.md"]

    other = tmp_path / "other_photos"
    other.mkdir()
    for name in ("000.png", "001.png"):
        shutil.copy(photos / name, other / f"b{name}")
    before = _files(out)
    assert_one_error(*call_cli("sfm", other, out), "earlier scene", "--force")
    assert _files(out) == before
    code, err = call_cli("sfm", other, out, "--force")
    assert code == 0, err
    after = _files(out)
    assert sorted(p.name for p in (out / "images").iterdir()) == ["b000.png", "b001.png"]  # the old ones went
    assert after["readme.md"] == keep and readme.read_text() == "how I took the photos"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no workspace left behind

    # sfm.json written before it listed files: only the names gstrain sfm wrote then are replaced
    manifest = json.loads((out / "sfm.json").read_text())
    del manifest["files"]
    (out / "sfm.json").write_text(json.dumps(manifest))
    _user_file(out / "sparse" / "0" / "project.ini", "the user's COLMAP project")
    before = _files(out)
    assert_one_error(*call_cli("sfm", photos, out, "--force"), "did not write", "project.ini")
    assert _files(out) == before
    (out / "sparse" / "0" / "project.ini").unlink()
    code, err = call_cli("sfm", photos, out, "--force")
    assert code == 0, err
    assert sorted(p.name for p in (out / "images").iterdir()) == ["000.png", "001.png", "002.png"]
    assert _files(out)["readme.md"] == keep


def test_splat_arrays_match_a_known_gaussian() -> None:
    """A unit Gaussian at the origin with scale e^0 = 1: covariance identity, colour from SH DC."""
    from gstrain.viewer.convert import SH_C0, splat_arrays

    p = {"means": torch.zeros(1, 3), "scales": torch.zeros(1, 3), "quats": torch.tensor([[1.0, 0, 0, 0]]),
         "opacities": torch.zeros(1), "sh0": torch.full((1, 1, 3), 0.5 / SH_C0)}
    arrays = splat_arrays(p)
    np.testing.assert_allclose(arrays["covariances"][0], np.eye(3), atol=1e-6)
    np.testing.assert_allclose(arrays["rgbs"][0], [1.0, 1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(arrays["opacities"][0], [0.5], atol=1e-6)
