"""Gaussian init from points, kNN scales, and the 3DGS PLY format."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gstrain.errors import UserError
from gstrain.knn import knn_sq_dists
from gstrain.model import (
    SH_C0,
    init_gaussians,
    load_ply,
    num_gaussians,
    random_points,
    save_ply,
    sh_degree_of,
)

EXPECTED_KEYS = {"means", "scales", "quats", "opacities", "sh0", "shN"}


def _random_params(n: int, degree: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = (degree + 1) ** 2 - 1
    return {
        "means": torch.randn(n, 3, generator=g) * 10,
        "scales": torch.randn(n, 3, generator=g),
        "quats": torch.randn(n, 4, generator=g),
        "opacities": torch.randn(n, generator=g),
        "sh0": torch.randn(n, 1, 3, generator=g),
        "shN": torch.randn(n, k, 3, generator=g),
    }


def _read_header(path) -> tuple[list[str], int]:
    blob = path.read_bytes()
    end = blob.index(b"end_header\n") + len(b"end_header\n")
    lines = blob[:end].decode("ascii").splitlines()
    return lines, end


# ---------------------------------------------------------------------------------- init


def test_init_shapes_and_values():
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(50, 3)).astype(np.float32)
    cols = rng.integers(0, 256, size=(50, 3)).astype(np.uint8)
    p = init_gaussians(pts, cols, sh_degree=3, init_opacity=0.1)
    assert set(p.keys()) == EXPECTED_KEYS
    assert p["means"].shape == (50, 3)
    assert p["scales"].shape == (50, 3)
    assert p["quats"].shape == (50, 4)
    assert p["opacities"].shape == (50,)
    assert p["sh0"].shape == (50, 1, 3)
    assert p["shN"].shape == (50, 15, 3)
    assert all(v.dtype == torch.float32 and v.requires_grad for v in p.values())
    assert torch.equal(p["quats"], torch.tensor([[1.0, 0, 0, 0]]).expand(50, 4))
    assert torch.allclose(torch.sigmoid(p["opacities"]), torch.full((50,), 0.1))
    assert torch.count_nonzero(p["shN"]) == 0
    assert torch.equal(p["means"].detach(), torch.from_numpy(pts))
    # Isotropic: the three log-scales agree.
    assert torch.equal(p["scales"][:, 0], p["scales"][:, 2])
    assert num_gaussians(p) == 50 and sh_degree_of(p) == 3


def test_sh_dc_inverts_to_colour():
    cols = np.array([[0, 128, 255], [10, 20, 30], [255, 255, 255], [1, 2, 3]], dtype=np.uint8)
    pts = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = init_gaussians(pts, cols, sh_degree=0)
    rgb = p["sh0"].detach()[:, 0, :] * SH_C0 + 0.5
    assert torch.allclose(rgb, torch.from_numpy(cols).float() / 255.0, atol=1e-6)
    assert p["shN"].shape == (4, 0, 3)
    assert sh_degree_of(p) == 0


def test_knn_scales_on_hand_made_points():
    # Origin with neighbours at distances 1, 2, 3 along the axes, and one far point.
    pts = np.array([[0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 3], [100, 0, 0]], dtype=np.float32)
    cols = np.zeros((5, 3), np.uint8)
    p = init_gaussians(pts, cols, init_scale=2.0)
    # Point 0: RMS of (1, 2, 3) = sqrt(14/3).
    assert math.isclose(float(p["scales"].detach()[0, 0]), math.log(2.0 * math.sqrt(14 / 3)), rel_tol=1e-6)
    # Point 1: neighbours 0 (1), 2 (sqrt 5), 3 (sqrt 10) -> sqrt((1 + 5 + 10) / 3).
    assert math.isclose(float(p["scales"].detach()[1, 0]), math.log(2.0 * math.sqrt(16 / 3)), rel_tol=1e-6)
    # Far point: 99 (to point 1), 100 (to the origin), sqrt(100^2 + 4) (to point 2).
    far = math.sqrt((99**2 + 100**2 + 100**2 + 4) / 3)
    assert math.isclose(float(p["scales"].detach()[4, 0]), math.log(2.0 * far), rel_tol=1e-6)


def test_duplicate_points_get_finite_scales():
    pts = np.zeros((6, 3), np.float32)
    p = init_gaussians(pts, np.zeros((6, 3), np.uint8))
    assert torch.isfinite(p["scales"]).all()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_few_points(n):
    pts = np.array([[0, 0, 0], [3, 0, 0], [0, 4, 0]], dtype=np.float32)[:n]
    p = init_gaussians(pts, np.full((n, 3), 128, np.uint8))
    assert p["means"].shape == (n, 3)
    assert torch.isfinite(p["scales"]).all()
    if n == 2:
        assert torch.allclose(p["scales"], torch.full((2, 3), math.log(3.0)))
    if n == 3:
        # Point 0: neighbours at 3 and 4 -> RMS sqrt(12.5).
        assert math.isclose(float(p["scales"].detach()[0, 0]), math.log(math.sqrt(12.5)), rel_tol=1e-6)


@pytest.mark.parametrize("workers", [1, 3])
def test_knn_matches_brute_force_with_outliers(workers):
    """Against brute force; with several threads (GPU runs use the idle cores) every row is the
    one thread's, bit for bit."""
    g = torch.Generator().manual_seed(1)
    core = torch.randn(3000, 3, generator=g) * torch.tensor([5.0, 5.0, 0.05])
    far = torch.randn(200, 3, generator=g) * 100 + 1000  # far from the origin, too
    pts = torch.cat([core, far])
    got = knn_sq_dists(pts, 3, workers=workers)
    d = torch.cdist(pts.double(), pts.double()).fill_diagonal_(float("inf"))
    want = d.topk(3, dim=1, largest=False).values.square()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-8)
    if workers > 1:
        assert torch.equal(got, knn_sq_dists(pts, 3))


def test_random_points():
    pts, cols = random_points(1000, np.array([1.0, 2.0, 3.0]), 5.0, seed=0)
    assert pts.shape == (1000, 3) and pts.dtype == np.float32
    assert cols.shape == (1000, 3) and cols.dtype == np.uint8
    assert np.linalg.norm(pts - [1, 2, 3], axis=1).max() <= 5.0 + 1e-4
    assert cols.min() >= 64 and cols.max() <= 192
    again, _ = random_points(1000, np.array([1.0, 2.0, 3.0]), 5.0, seed=0)
    assert np.array_equal(pts, again)


# ---------------------------------------------------------------------------------- PLY


def test_ply_header_exact(tmp_path):
    path = tmp_path / "pc.ply"
    save_ply(_random_params(7, 3), path)
    lines, _ = _read_header(path)
    names = ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
    names += [f"f_rest_{i}" for i in range(45)]
    names += ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    # gstrain's mark is a comment line after `format`: what lets a later --force replace the file
    assert lines == ["ply", "format binary_little_endian 1.0", "comment written by gstrain", "element vertex 7"] + [
        f"property float {n}" for n in names
    ] + ["end_header"]
    assert path.stat().st_size == len("\n".join(lines)) + 1 + 7 * 4 * len(names)
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_ply_round_trip_bitwise(tmp_path, degree):
    params = _random_params(33, degree, seed=degree)
    params["opacities"][0] = float("nan")  # odd bit patterns survive too
    params["means"][1, 0] = -0.0
    path = tmp_path / "pc.ply"
    save_ply(params, path)
    loaded = load_ply(path)
    assert set(loaded.keys()) == EXPECTED_KEYS
    for k, v in params.items():
        got = loaded[k].detach()
        assert got.shape == v.shape and got.dtype == torch.float32, k
        assert torch.equal(got.view(torch.int32), v.view(torch.int32)), k
    assert sh_degree_of(loaded) == degree


def test_ply_f_rest_is_channel_major(tmp_path):
    params = _random_params(2, 1)
    # Coefficient j of channel c gets the value 10 * c + j for vertex 0.
    shN = torch.zeros(2, 3, 3)
    for j in range(3):
        for c in range(3):
            shN[0, j, c] = 10 * c + j
    params["shN"] = shN
    params["sh0"] = torch.tensor([[[0.5, 1.5, 2.5]], [[0, 0, 0]]])
    path = tmp_path / "pc.ply"
    save_ply(params, path)
    lines, offset = _read_header(path)
    n_props = sum(1 for line in lines if line.startswith("property"))
    rows = np.frombuffer(path.read_bytes()[offset:], dtype="<f4").reshape(2, n_props)
    assert rows[0, 6:9].tolist() == [0.5, 1.5, 2.5]
    # f_rest_0..2 = R coefficients 0..2, then G, then B.
    assert rows[0, 9:18].tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    assert rows[0, 3:6].tolist() == [0, 0, 0]  # normals


def test_ply_transform_scale_and_translation(tmp_path):
    params = _random_params(5, 1)
    m = np.eye(4)
    m[:3, :3] *= 2.0
    m[:3, 3] = [1.0, -2.0, 3.0]
    path = tmp_path / "pc.ply"
    save_ply(params, path, transform=m)
    loaded = load_ply(path)
    want = params["means"] * 2.0 + torch.tensor([1.0, -2.0, 3.0])
    assert torch.allclose(loaded["means"].detach(), want, atol=1e-5)
    assert torch.allclose(loaded["scales"].detach(), params["scales"] + math.log(2.0), atol=1e-6)
    assert torch.equal(loaded["quats"].detach(), params["quats"])
    rot = np.eye(4)
    rot[:3, :3] = [[0, -1, 0], [1, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError):
        save_ply(params, tmp_path / "bad.ply", transform=rot)


def test_load_ply_missing(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_ply(tmp_path / "nope.ply")


def _one_line(err: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello world",
        b"ply\nformat ascii 1.0\nelement vertex 1\nproperty float x\nend_header\n1\n",
        b"ply\nformat binary_little_endian 1.0\nelement vertex 1\nproperty float x\n"
        b"property float y\nproperty float z\nend_header\n" + b"\0" * 12,  # a plain point cloud
        b"ply\nformat binary_little_endian 1.0\nelement vertex 2\nproperty float x\n",  # no end_header
    ],
)
def test_load_ply_rejects_bad_files(tmp_path, content):
    path = tmp_path / "bad.ply"
    path.write_bytes(content)
    with pytest.raises(UserError) as err:
        load_ply(path)
    _one_line(err)


def test_load_ply_truncated(tmp_path):
    path = tmp_path / "pc.ply"
    save_ply(_random_params(10, 3), path)
    blob = path.read_bytes()
    path.write_bytes(blob[:-5])
    with pytest.raises(UserError, match="truncated") as err:
        load_ply(path)
    _one_line(err)


def test_load_ply_rejects_odd_sh_count(tmp_path):
    path = tmp_path / "pc.ply"
    names = ["x", "y", "z", "f_dc_0", "f_dc_1", "f_dc_2", "f_rest_0", "f_rest_1", "f_rest_2",
             "opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    header = "ply\nformat binary_little_endian 1.0\nelement vertex 1\n"
    header += "".join(f"property float {n}\n" for n in names) + "end_header\n"
    path.write_bytes(header.encode() + b"\0" * 4 * len(names))
    with pytest.raises(UserError, match="SH degree"):
        load_ply(path)


def _brute_knn_sq(pts: torch.Tensor, k: int) -> torch.Tensor:
    d = torch.cdist(pts.double(), pts.double()).fill_diagonal_(float("inf"))
    return d.topk(k, dim=1, largest=False).values.square()


def test_knn_in_large_blocks_matches_brute_force():
    """The GPU's parameters (few large blocks, a larger distance budget), run on the CPU: exact."""
    from gstrain.knn import _knn_sq_dists

    g = torch.Generator().manual_seed(2)
    core = torch.randn(5000, 3, generator=g) * torch.tensor([3.0, 0.2, 3.0])
    far = torch.randn(100, 3, generator=g) * 50 + 300
    pts = torch.cat([core, far])
    got = _knn_sq_dists(pts, 3, 1, block=4096, budget=1 << 24)
    assert torch.allclose(got.double(), _brute_knn_sq(pts, 3), rtol=1e-4, atol=1e-8)


@pytest.mark.cuda
def test_knn_on_the_gpu_matches_brute_force():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(4)
    core = torch.randn(20000, 3, generator=g) * torch.tensor([5.0, 5.0, 0.05])
    far = torch.randn(300, 3, generator=g) * 100 + 1000
    pts = torch.cat([core, far])
    got = knn_sq_dists(pts.cuda(), 3)
    assert got.is_cuda
    assert torch.allclose(got.cpu().double(), _brute_knn_sq(pts, 3), rtol=1e-4, atol=1e-8)
