"""--force replaces only files gstrain wrote: its PLY and MP4 outputs carry a mark inside them; a
user's file (text, a real PLY, an MP4, a .splat) keeps its bytes and mode, and .splat, which has no
room for a mark, is never replaced outside the run's own folder.

Each refusal compares digests and modes before and after; marks are checked with readers other
than gstrain's (plyfile, the ffmpeg binary).
"""

from __future__ import annotations

import hashlib
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli
from plyfile import PlyData, PlyElement

from gstrain.data.ply_points import read_ply_points
from gstrain.files import carries_gstrain_mark
from gstrain.model import load_ply

RENDER = ["--frames", "2", "--size", "16x16"]


def _state(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), stat.S_IMODE(path.stat().st_mode)



def _means(run: Path) -> torch.Tensor:
    return torch.load(run / "ckpt" / "step_4.pt", weights_only=False)["params"]["means"]


def _plain_ply(path: Path, body_text: bytes = b"") -> Path:
    """A real binary PLY made with plyfile, without gstrain's mark (its comment, if any, is another)."""
    vertex = np.zeros(3, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4")])
    vertex["x"] = [1, 2, 3]
    PlyData([PlyElement.describe(vertex, "vertex")], comments=["made by hand"]).write(str(path))
    with path.open("ab") as fh:
        fh.write(body_text)  # bytes after the vertices: not a header line
    return path


def _plain_mp4(path: Path) -> Path:
    import imageio.v2 as imageio

    writer = imageio.get_writer(path, format="FFMPEG", mode="I", fps=5, codec="libx264",
                                macro_block_size=1, ffmpeg_log_level="error")
    for i in range(2):
        writer.append_data(np.full((16, 16, 3), 60 * i, np.uint8))
    writer.close()
    return path


@pytest.mark.parametrize("name, make", [
    ("user.ply", lambda p: p.write_bytes(b"data\n")),
    ("plain.ply", _plain_ply),
    ("mark_in_body.ply", lambda p: _plain_ply(p, b"\ncomment written by gstrain\n")),
    ("user.compressed.ply", _plain_ply),
    ("model.bin", lambda p: p.write_bytes(b"\x00" * 64)),
])  # fmt: skip
def test_export_force_keeps_a_users_file(run_copy: Path, tmp_path: Path, name: str, make) -> None:
    mine = tmp_path / name
    make(mine)
    mine.chmod(0o640)
    before = _state(mine)
    assert_one_error(*call_cli("export", run_copy, "--out", mine), "exists", "--force")
    assert_one_error(*call_cli("export", run_copy, "--out", mine, "--force"), str(mine), "did not write")
    assert _state(mine) == before


def test_splat_is_never_forced_outside_the_run(run_copy: Path, tmp_path: Path) -> None:
    mine = tmp_path / "user.splat"
    mine.write_bytes(bytes(range(96)))
    mine.chmod(0o600)
    before = _state(mine)
    assert_one_error(*call_cli("export", run_copy, "--out", mine, "--force"), str(mine), "no room", "move or delete")
    assert _state(mine) == before
    # gstrain's own .splat outside the run cannot be told from a user's: refused the same way
    ours = tmp_path / "ours.splat"
    code, err = call_cli("export", run_copy, "--out", ours)
    assert code == 0, err
    written = _state(ours)
    assert_one_error(*call_cli("export", run_copy, "--out", ours, "--force"), "no room")
    assert _state(ours) == written
    # inside the run's point_cloud/ it is gstrain's: replaced
    inside = run_copy / "point_cloud" / "iteration_4" / "point_cloud.splat"
    for _ in range(2):
        code, err = call_cli("export", run_copy, "--format", "splat")
        assert code == 0, err
    assert inside.stat().st_size == 32 * _means(run_copy).shape[0]


@pytest.mark.parametrize("name", ["a.ply", "b.compressed.ply", "c.bin"])
def test_export_force_replaces_gstrains_own_export(run_copy: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    code, err = call_cli("export", run_copy, "--out", out)
    assert code == 0, err
    ply = PlyData.read(str(out))  # an independent reader: the mark is a plain header comment
    assert ply.comments == ["written by gstrain"]
    assert carries_gstrain_mark(out)
    out.chmod(0o604)
    first = out.stat().st_ino
    code, err = call_cli("export", run_copy, "--out", out, "--force")
    assert code == 0, err
    assert out.stat().st_ino != first and stat.S_IMODE(out.stat().st_mode) == 0o604
    means = _means(run_copy)
    if name.endswith(".compressed.ply"):
        # PlayCanvas layout still there: chunk and vertex elements, packed vertices one per Gaussian
        ply = PlyData.read(str(out))
        assert [e.name for e in ply.elements][:2] == ["chunk", "vertex"]
        assert ply["vertex"].count == means.shape[0]
        return
    ply = PlyData.read(str(out))
    xyz = np.stack([ply["vertex"][k] for k in "xyz"], axis=1)
    assert np.array_equal(xyz, means.numpy())
    assert torch.equal(load_ply(out)["means"].detach(), means)  # gstrain's Gaussian reader
    assert np.array_equal(read_ply_points(out)[0], means.numpy())  # and its point-cloud reader


def test_the_runs_own_ply_carries_the_mark(tiny_run: Path) -> None:
    plys = sorted((tiny_run / "point_cloud").rglob("*.ply"))
    code, err = call_cli("export", tiny_run) if not plys else (0, "")
    assert code == 0, err
    for ply in sorted((tiny_run / "point_cloud").rglob("*.ply")):
        assert PlyData.read(str(ply)).comments == ["written by gstrain"], ply


def _ffmpeg_comment(path: Path) -> str:
    import imageio_ffmpeg

    probe = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)],
                           capture_output=True, text=True)
    lines = [line.split(":", 1)[1].strip() for line in probe.stderr.splitlines()
             if line.strip().startswith("comment")]
    return lines[0] if lines else ""


def test_render_force_replaces_only_gstrains_mp4(run_copy: Path, tmp_path: Path) -> None:
    blob = tmp_path / "blob.mp4"
    blob.write_bytes(b"the user's own video")
    plain = _plain_mp4(tmp_path / "plain.mp4")
    for mine in (blob, plain):
        mine.chmod(0o640)
        before = _state(mine)
        assert_one_error(*call_cli("render", run_copy, *RENDER, "--out", mine, "--force"), str(mine), "did not write")
        assert _state(mine) == before
    assert not carries_gstrain_mark(plain)

    ours = tmp_path / "ours.mp4"
    code, err = call_cli("render", run_copy, *RENDER, "--out", ours)
    assert code == 0, err
    assert _ffmpeg_comment(ours) == "written by gstrain"  # ffmpeg itself reads the tag
    assert b"written by gstrain" in ours.read_bytes()
    first = ours.stat().st_ino
    assert_one_error(*call_cli("render", run_copy, *RENDER, "--out", ours), "exists", "--force")
    code, err = call_cli("render", run_copy, *RENDER, "--out", ours, "--force")
    assert code == 0, err
    assert ours.stat().st_ino != first


def test_mp4_mark_found_at_the_start_or_the_end(tmp_path: Path) -> None:
    """ffmpeg puts the moov box (and the tag) at the end, or with +faststart at the start; the
    padding makes the file larger than the scanned head and tail together."""
    import imageio.v2 as imageio

    for flags, moov_first in (([], False), (["-movflags", "+faststart"], True)):
        path = tmp_path / f"v{int(moov_first)}.mp4"
        writer = imageio.get_writer(path, format="FFMPEG", mode="I", fps=5, codec="libx264", quality=10,
                                    macro_block_size=1, ffmpeg_log_level="error",
                                    output_params=["-metadata", "comment=written by gstrain", *flags])
        rng = np.random.default_rng(0)
        for _ in range(30):
            writer.append_data(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8))  # noise: big frames
        writer.close()
        blob = path.read_bytes()
        assert len(blob) > 2 << 20
        at = blob.find(b"written by gstrain")
        assert (at < 1 << 20) if moov_first else (at > len(blob) - (1 << 20))
        assert carries_gstrain_mark(path)
