"""Export formats read back by independent readers: plyfile for PLY / compressed PLY, numpy for .splat.

The decoders here follow the formats' public layouts (3DGS PLY; antimatter15's 32-byte .splat
record; PlayCanvas's compressed PLY with per-chunk bounds), not gsplat's writer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

plyfile = pytest.importorskip("plyfile")

from cli_util import assert_one_error, call_cli  # noqa: E402

from gstrain.formats import export_gaussians  # noqa: E402

C0 = 0.28209479177387814


def _params(n: int = 700, k_rest: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    quats = torch.randn(n, 4, generator=g)
    return {
        "means": torch.randn(n, 3, generator=g) * 2,
        "scales": torch.rand(n, 3, generator=g) * 4 - 6,
        "quats": quats,
        "opacities": torch.randn(n, generator=g) * 3,
        "sh0": torch.randn(n, 1, 3, generator=g) * 0.8,
        "shN": torch.randn(n, k_rest, 3, generator=g) * 0.3,
    }


def _match(ref_means: np.ndarray, got_means: np.ndarray, tol: float) -> np.ndarray:
    """Index into the reference for each read-back Gaussian (files may reorder them)."""
    d = np.linalg.norm(ref_means[None, :, :] - got_means[:, None, :], axis=2)
    idx = d.argmin(1)
    assert d[np.arange(len(idx)), idx].max() < tol
    assert len(set(idx.tolist())) == len(idx), "two file records matched one Gaussian"
    return idx


def _unit_quats(q: np.ndarray) -> np.ndarray:
    q = q / np.linalg.norm(q, axis=1, keepdims=True)
    return q * np.where(q[:, :1] < 0, -1.0, 1.0)  # q and -q are one rotation


def test_ply_round_trip(tmp_path):
    p = _params()
    path = tmp_path / "g.ply"
    assert export_gaussians(p, path, "ply") == 700
    v = plyfile.PlyData.read(str(path))["vertex"]
    np.testing.assert_array_equal(np.stack([v["x"], v["y"], v["z"]], 1), p["means"].numpy())
    np.testing.assert_array_equal(v["opacity"], p["opacities"].numpy())
    np.testing.assert_array_equal(np.stack([v[f"rot_{i}"] for i in range(4)], 1), p["quats"].numpy())
    rest = np.stack([v[f"f_rest_{i}"] for i in range(9)], 1).reshape(-1, 3, 3)  # channel-major
    np.testing.assert_array_equal(rest.transpose(0, 2, 1), p["shN"].numpy())


def test_splat_records(tmp_path):
    p = _params()
    p["means"][5] = float("nan")  # dropped: a viewer cannot place it
    path = tmp_path / "g.splat"
    assert export_gaussians(p, path, "splat") == 699
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, 32)  # 3 f32 pos, 3 f32 scale, 4 u8 rgba, 4 u8 rot
    pos = raw[:, 0:12].copy().view("<f4")
    scale = raw[:, 12:24].copy().view("<f4")
    rgba = raw[:, 24:28].astype(np.float64) / 255
    rot = (raw[:, 28:32].astype(np.float64) - 128) / 128
    keep = np.arange(700) != 5
    ref = {k: v.numpy()[keep].astype(np.float64) for k, v in p.items()}
    idx = _match(ref["means"], pos.astype(np.float64), 1e-6)
    np.testing.assert_allclose(scale, np.exp(ref["scales"][idx]), rtol=1e-6)
    rgb = np.clip(ref["sh0"][idx, 0] * C0 + 0.5, 0, 1)
    alpha = 1 / (1 + np.exp(-ref["opacities"][idx]))
    np.testing.assert_allclose(rgba, np.concatenate([rgb, alpha[:, None]], 1), atol=1.01 / 255)
    np.testing.assert_allclose(_unit_quats(rot), _unit_quats(ref["quats"][idx]), atol=2.5 / 128)


def _unorm(v: np.ndarray, bits: int) -> np.ndarray:
    return (v & ((1 << bits) - 1)) / ((1 << bits) - 1)


def _decode_compressed(path) -> dict[str, np.ndarray]:
    """PlayCanvas compressed PLY: 256 Gaussians per chunk, positions/scales/colours as unorms
    between the chunk's min and max, the smallest-three quaternion, SH rest as 8-bit in [-4, 4]."""
    ply = plyfile.PlyData.read(str(path))
    chunk, vert = ply["chunk"], ply["vertex"]
    c = {name: np.repeat(np.asarray(chunk[name], np.float64), 256)[: vert.count] for name in chunk.data.dtype.names}

    def lerp(axis: str, kind: str, t: np.ndarray) -> np.ndarray:
        lo, hi = c[f"min_{kind}{axis}"], c[f"max_{kind}{axis}"]
        return lo + (hi - lo) * t

    def p111011(v: np.ndarray) -> list[np.ndarray]:
        return [_unorm(v >> 21, 11), _unorm(v >> 11, 10), _unorm(v, 11)]

    pos = np.asarray(vert["packed_position"], np.int64)
    means = np.stack([lerp(a, "", t) for a, t in zip("xyz", p111011(pos), strict=True)], 1)
    sc = np.asarray(vert["packed_scale"], np.int64)
    scales = np.stack([lerp(a, "scale_", t) for a, t in zip("xyz", p111011(sc), strict=True)], 1)
    col = np.asarray(vert["packed_color"], np.int64)
    rgb = np.stack([lerp(a, "", _unorm(col >> s, 8)) for a, s in zip("rgb", (24, 16, 8), strict=True)], 1)
    alpha = _unorm(col, 8)
    rot = np.asarray(vert["packed_rotation"], np.int64)
    abc = [(_unorm(rot >> s, 10) - 0.5) / (math.sqrt(2) * 0.5) for s in (20, 10, 0)]
    largest = np.sqrt(np.clip(1 - sum(x * x for x in abc), 0, None))
    which = rot >> 30
    quats = np.zeros((len(rot), 4))
    for i in range(4):
        rest = [j for j in range(4) if j != i]
        sel = which == i
        quats[sel, i] = largest[sel]
        for j, x in zip(rest, abc, strict=True):
            quats[sel, j] = x[sel]
    sh = ply["sh"].data
    shn = np.stack([(np.asarray(sh[name], np.float64) / 256 - 0.5) * 8 for name in sh.dtype.names], 1)
    return {"means": means, "scales": scales, "rgb": rgb, "alpha": alpha, "quats": quats, "shN": shn}


def test_compressed_ply_decodes_within_quantisation(tmp_path):
    p = _params()
    path = tmp_path / "g.compressed.ply"
    visible = int((torch.sigmoid(p["opacities"]) > 1 / 255).sum())
    assert 0 < visible < 700  # some are invisible and must be dropped
    assert export_gaussians(p, path, "ply-compressed") == visible
    got = _decode_compressed(path)
    ref = {k: v.numpy().astype(np.float64) for k, v in p.items()}
    span = ref["means"].max(0) - ref["means"].min(0)
    idx = _match(ref["means"], got["means"], float(np.linalg.norm(span)) / 1000)
    # chunk-relative 10/11-bit positions: within one step of the whole scene's span
    np.testing.assert_allclose(got["means"], ref["means"][idx], atol=float(span.max()) / 1023)
    np.testing.assert_allclose(got["scales"], ref["scales"][idx], atol=4.0 / 1023)
    np.testing.assert_allclose(got["rgb"], ref["sh0"][idx, 0] * C0 + 0.5, atol=(np.ptp(ref["sh0"]) * C0) / 255 + 1e-6)
    np.testing.assert_allclose(got["alpha"], 1 / (1 + np.exp(-ref["opacities"][idx])), atol=0.6 / 255)
    np.testing.assert_allclose(_unit_quats(got["quats"]), _unit_quats(ref["quats"][idx]), atol=3e-3)
    shn = ref["shN"][idx].transpose(0, 2, 1).reshape(len(idx), -1)  # channel-major, as in 3DGS PLY
    np.testing.assert_allclose(got["shN"], np.clip(shn, -4, 4 - 8 / 256), atol=8 / 256 + 1e-9)


def test_export_cli_rejects_unknown_format(tmp_path):
    assert_one_error(*call_cli("export", tmp_path, "--format", "obj"), "unsupported export format")
