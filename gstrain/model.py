"""Gaussian parameters: initialisation from a point cloud, and the 3DGS PLY format.

Parameters live in a torch.nn.ParameterDict with the names gsplat's strategies expect
(see docs/CONVENTIONS.md): means, scales (log), quats (w x y z), opacities (logit), sh0, shN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import numpy as np
import torch
from torch import Tensor

from gstrain.errors import UserError
from gstrain.files import PLY_MARK, write_atomic
from gstrain.knn import knn_rms_distance

SH_C0 = 0.28209479177387814  # Y_0^0, the DC term of the real SH basis



# --------------------------------------------------------------------------------------------
# Small helpers the trainer needs


def num_sh_rest(sh_degree: int) -> int:
    """Number of non-DC SH coefficients per channel for a degree: (d+1)^2 - 1."""
    if sh_degree < 0:
        raise ValueError(f"sh_degree must be >= 0, got {sh_degree}")
    return (sh_degree + 1) ** 2 - 1


def num_gaussians(params: Mapping[str, Tensor]) -> int:
    return int(params["means"].shape[0])


def sh_degree_of(params: Mapping[str, Tensor]) -> int:
    """Max SH degree stored in params, from the shape of shN."""
    degree = _degree_from_rest(int(params["shN"].shape[1]))
    if degree is None:
        raise ValueError(f"shN has {params['shN'].shape[1]} coefficients, not (d+1)^2-1 for any d")
    return degree


def _degree_from_rest(k: int) -> int | None:
    d = math.isqrt(k + 1) - 1
    return d if (d + 1) ** 2 - 1 == k else None


# --------------------------------------------------------------------------------------------
# Initialisation


def init_gaussians(
    points: np.ndarray,
    colors: np.ndarray,
    sh_degree: int = 3,
    init_opacity: float = 0.1,
    init_scale: float = 1.0,
    device: torch.device | str = "cpu",
) -> torch.nn.ParameterDict:
    """One isotropic Gaussian per point, sized by its 3 nearest neighbours (as 3DGS does).

    The scale is init_scale times the RMS distance to the 3 nearest neighbours (3DGS and gsplat
    both use the RMS, sqrt(mean d^2)); with fewer than 4 points the available neighbours are
    used, and a lone point gets LONE_POINT_DIST. Rotations start at identity: the initial
    Gaussians are isotropic, so a random rotation changes nothing but the RNG stream, and
    identity keeps init deterministic and equal to 3DGS.
    """
    pts = np.asarray(points)
    cols = np.asarray(colors)
    if pts.ndim != 2 or pts.shape[1] != 3 or pts.shape[0] == 0:
        raise ValueError(f"points must be [P>0, 3], got {pts.shape}")
    if not np.isfinite(pts).all():
        raise ValueError("points contain NaN or inf")
    if cols.shape != pts.shape:
        raise ValueError(f"colors must be [P, 3] like points, got {cols.shape} vs {pts.shape}")
    if not 0.0 < init_opacity < 1.0:
        raise ValueError(f"init_opacity must be in (0, 1), got {init_opacity}")
    if init_scale <= 0.0:
        raise ValueError(f"init_scale must be > 0, got {init_scale}")

    # a copy: from_numpy would share the caller's array (the scene's SfM points), and on the CPU
    # the optimizer's in-place updates would then move them under every later model
    means = torch.tensor(pts, dtype=torch.float32)
    n = means.shape[0]
    # training on a GPU: the neighbour search runs there (1M SfM points: 30 s on one CPU core,
    # about 4 s on 16); CPU training keeps torch's one thread
    on_gpu = torch.device(device).type == "cuda"
    dist = knn_rms_distance(means.to(device) if on_gpu else means, k=3).cpu()
    scales = torch.log(dist * init_scale)[:, None].repeat(1, 3)
    quats = torch.zeros(n, 4)
    quats[:, 0] = 1.0
    opacities = torch.full((n,), math.log(init_opacity / (1.0 - init_opacity)))
    rgb = torch.from_numpy(np.ascontiguousarray(cols, dtype=np.float32)) / 255.0
    sh0 = ((rgb - 0.5) / SH_C0)[:, None, :]
    shN = torch.zeros(n, num_sh_rest(sh_degree), 3)

    tensors = {"means": means, "scales": scales, "quats": quats, "opacities": opacities,
               "sh0": sh0, "shN": shN}
    return torch.nn.ParameterDict(
        {k: torch.nn.Parameter(v.to(device=device, dtype=torch.float32).contiguous())
         for k, v in tensors.items()}
    )


def random_points(n: int, center: np.ndarray, radius: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n points uniform in a ball around center, with grey-ish colours: ([n,3] float32, [n,3] uint8).

    For scenes without SfM points (the user opts in). Colours are a mid grey per point with a
    small per-channel tint so nothing starts saturated.
    """
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    if radius <= 0:
        raise ValueError(f"radius must be > 0, got {radius}")
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=(n, 3))
    direction /= np.maximum(np.linalg.norm(direction, axis=1, keepdims=True), 1e-12)
    # r ~ u^(1/3) makes the density uniform over the ball's volume.
    r = radius * rng.random(n) ** (1.0 / 3.0)
    pts = np.asarray(center, dtype=np.float64).reshape(1, 3) + direction * r[:, None]
    grey = rng.uniform(96.0, 160.0, size=(n, 1))
    tint = rng.uniform(-16.0, 16.0, size=(n, 3))
    cols = np.clip(np.rint(grey + tint), 0, 255).astype(np.uint8)
    return pts.astype(np.float32), cols


# --------------------------------------------------------------------------------------------
# PLY (the original 3DGS layout)


def _ply_names(k_rest: int) -> list[str]:
    names = ["x", "y", "z", "nx", "ny", "nz", "f_dc_0", "f_dc_1", "f_dc_2"]
    names += [f"f_rest_{i}" for i in range(3 * k_rest)]
    names += ["opacity", "scale_0", "scale_1", "scale_2", "rot_0", "rot_1", "rot_2", "rot_3"]
    return names


def _similarity_parts(transform: np.ndarray) -> tuple[float, np.ndarray]:
    """(s, t) of a [4,4] matrix that must be x -> s*x + t (no rotation, no shear)."""
    m = np.asarray(transform, dtype=np.float64)
    if m.shape != (4, 4):
        raise ValueError(f"transform must be [4,4], got {m.shape}")
    s = float(m[0, 0])
    if s <= 0 or not np.allclose(m[:3, :3], s * np.eye(3), rtol=1e-6, atol=1e-9 * s) \
            or not np.allclose(m[3], [0, 0, 0, 1]):
        raise ValueError("transform must be a uniform scale plus translation (rotation is not supported)")
    return s, m[:3, 3]


def save_ply(params: Mapping[str, Tensor], path: Path, transform: np.ndarray | None = None) -> None:
    """Write params as a 3DGS PLY (binary little-endian float32), atomically.

    Properties: x y z nx ny nz f_dc_0..2 f_rest_0..3K-1 opacity scale_0..2 rot_0..3, with f_rest
    channel-major (all R coefficients, then G, then B), opacity as logit, scales as log, rot as
    w x y z and zero normals. `transform`, if given, must be x -> s*x + t (uniform scale s > 0
    plus translation, no rotation; e.g. undoing a world normalisation): means become s*x + t and
    log-scales gain log(s); quats, SH and opacity are unchanged by such a map.
    """
    path = Path(path)

    def arr(name: str) -> np.ndarray:
        return params[name].detach().to("cpu", torch.float32).numpy()

    means = arr("means")
    scales = arr("scales")
    n = means.shape[0]
    sh0 = arr("sh0").reshape(n, 3)
    shN = arr("shN")
    k_rest = shN.shape[1]
    if transform is not None:
        s, t = _similarity_parts(transform)
        means = (means.astype(np.float64) * s + t).astype(np.float32)
        scales = (scales.astype(np.float64) + math.log(s)).astype(np.float32)

    names = _ply_names(k_rest)
    data = np.zeros(n, dtype=np.dtype([(name, "<f4") for name in names]))
    flat = data.view("<f4").reshape(n, len(names))  # same memory, one column per property
    flat[:, 0:3] = means
    flat[:, 6:9] = sh0
    # [N, K, 3] -> [N, 3, K]: channel-major, as 3DGS writes features_rest.
    flat[:, 9:9 + 3 * k_rest] = shN.transpose(0, 2, 1).reshape(n, 3 * k_rest)
    col = 9 + 3 * k_rest
    flat[:, col] = arr("opacities").reshape(n)
    flat[:, col + 1:col + 4] = scales
    flat[:, col + 4:col + 8] = arr("quats")

    header = "ply\nformat binary_little_endian 1.0\n" + PLY_MARK.decode("ascii") + "\n"  # --force may replace it
    header += f"element vertex {n}\n"
    header += "".join(f"property float {name}\n" for name in names) + "end_header\n"

    def write(f: IO[bytes]) -> None:
        f.write(header.encode("ascii"))
        f.write(data.tobytes())

    write_atomic(path, write)  # temp file + rename; a link or device at `path` is refused


_PLY_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "i2", "int16": "i2", "ushort": "u2", "uint16": "u2",
    "int": "i4", "int32": "i4", "uint": "u4", "uint32": "u4",
    "float": "f4", "float32": "f4", "double": "f8", "float64": "f8",
}


_PLY_HEADER_MAX = 1 << 20  # a 3DGS header is ~1.5 KB; anything past this is not one


def _parse_header(blob: bytes, path: Path) -> tuple[int, np.dtype, int]:
    """(vertex count, vertex dtype, data offset) of a binary little-endian PLY, from its first bytes."""
    bad = f"not a 3DGS PLY file: {path}"
    if not blob.startswith(b"ply"):
        raise UserError(f"{bad} (no 'ply' magic)")
    end = blob.find(b"end_header")
    if end < 0:
        raise UserError(f"{bad} (no end_header)")
    nl = blob.find(b"\n", end)
    if nl < 0:
        raise UserError(f"{bad} (truncated header)")
    try:
        lines = blob[:end].decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{bad} (header is not ASCII)") from None
    fmt = None
    count = -1
    fields: list[tuple[str, str]] = []
    element = None
    for line in lines[1:]:
        tok = line.split()
        if not tok or tok[0] in ("comment", "obj_info"):
            continue
        if tok[0] == "format" and len(tok) >= 2:
            fmt = tok[1]
        elif tok[0] == "element" and len(tok) == 3:
            if element == "vertex":
                break  # elements after the vertices do not affect where they are
            element = tok[1]
            if element != "vertex":
                raise UserError(f"{bad} (element '{element}' before the vertices)")
            try:
                count = int(tok[2])
            except ValueError:
                raise UserError(f"{bad} (bad vertex count '{tok[2]}')") from None
        elif tok[0] == "property" and element == "vertex":
            if len(tok) != 3 or tok[1] not in _PLY_TYPES:
                raise UserError(f"{bad} (unsupported vertex property '{line.strip()}')")
            fields.append((tok[2], "<" + _PLY_TYPES[tok[1]]))
        else:
            raise UserError(f"{bad} (unexpected header line '{line.strip()}')")
    if fmt != "binary_little_endian":
        raise UserError(f"{bad} (format '{fmt}', need binary_little_endian)")
    if element != "vertex" or count < 0:
        raise UserError(f"{bad} (no vertex element)")
    try:
        dtype = np.dtype(fields)
    except ValueError as e:
        raise UserError(f"{bad} ({e})") from None
    return count, dtype, nl + 1


def load_ply(path: Path, device: torch.device | str = "cpu") -> torch.nn.ParameterDict:
    """Read a 3DGS PLY written by save_ply, the original 3DGS code or a compatible tool.

    Bad input (missing, unreadable, truncated or not in the 3DGS layout) raises UserError.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"PLY file not found: {path}")
    try:
        with path.open("rb") as f:
            n, dtype, offset = _parse_header(f.read(_PLY_HEADER_MAX), path)
            f.seek(offset)
            raw = f.read(n * dtype.itemsize)  # only the vertices: no second copy of a large file
    except OSError as e:
        raise UserError(f"cannot read PLY file {path}: {e.strerror or e}") from None
    if len(raw) < n * dtype.itemsize:
        raise UserError(f"PLY file is truncated: {path} (header says {n} vertices)")
    data = np.frombuffer(raw, dtype=dtype, count=n)

    names = set(dtype.names or ())
    n_rest = sum(1 for name in names if name.startswith("f_rest_"))
    optional = ("nx", "ny", "nz")
    missing = [name for name in _ply_names(n_rest // 3) if name not in names and name not in optional]
    if missing:
        raise UserError(f"not a 3DGS PLY file: {path} (missing properties: {' '.join(missing[:6])})")
    k_rest = n_rest // 3
    if n_rest % 3 or _degree_from_rest(k_rest) is None:
        raise UserError(f"not a 3DGS PLY file: {path} ({n_rest} f_rest properties is no SH degree)")

    def cols(*fields: str) -> Tensor:
        stacked = np.stack([data[f].astype(np.float32) for f in fields], axis=1) if fields else \
            np.zeros((n, 0), np.float32)
        return torch.from_numpy(np.ascontiguousarray(stacked))

    rest = cols(*[f"f_rest_{i}" for i in range(n_rest)])
    tensors = {
        "means": cols("x", "y", "z"),
        "scales": cols("scale_0", "scale_1", "scale_2"),
        "quats": cols("rot_0", "rot_1", "rot_2", "rot_3"),
        "opacities": cols("opacity")[:, 0],
        "sh0": cols("f_dc_0", "f_dc_1", "f_dc_2")[:, None, :],
        # channel-major on disk: [N, 3, K] -> [N, K, 3]
        "shN": rest.reshape(n, 3, k_rest).transpose(1, 2),
    }
    return torch.nn.ParameterDict(
        {k: torch.nn.Parameter(v.to(device).contiguous()) for k, v in tensors.items()}
    )
