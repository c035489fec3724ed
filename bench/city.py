"""The generated block city that the studies share: Gaussians on the walls, roofs and streets of a
grid of buildings, and the cameras that look at it.

- dist_comm (issue 16) uses its surface points and walks cameras down its streets;
- big_scene (issue 37) renders it from phone and drone cameras into a COLMAP folder, and
  big_curve trains on it at any N.

The layout (building heights) is drawn first from the generator, so it is the same for every N
of one seed; then Gaussians per surface in proportion to its area. city_points draws in exactly
the order dist_comm's study always did, so its stored results stay reproducible.
Colours are a function of position and surface (no random draws): a palette colour per
building with a grid of dark windows on the walls, grey roofs, asphalt with a dashed centre line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 40.0  # metres per block side (the building's footprint is inset by INSET)
STREET = 12.0
INSET = 2.0
MIN_HEIGHT, HEIGHT_RANGE = 10.0, 50.0
FLATNESS = 0.1  # a surface Gaussian's thickness over its width
OPACITY = 0.9
# windows on the walls: every WINDOW_PITCH metres along, every FLOOR metres up
WINDOW_PITCH, FLOOR = 3.0, 3.5
ASPHALT, MARKING, GLASS = (0.22, 0.22, 0.24), (0.92, 0.92, 0.85), (0.12, 0.17, 0.26)


@dataclass
class CityPoints:
    """Surface samples of the city: positions, outward normals, colours in [0, 1]."""

    means: torch.Tensor  # [N, 3] float32, metres, z up
    normals: torch.Tensor  # [N, 3] unit
    colors: torch.Tensor  # [N, 3] float32 in [0, 1]
    area: float  # of every surface together (m^2)
    blocks: int

    @property
    def pitch(self) -> float:
        return BLOCK + STREET

    @property
    def sigma(self) -> float:
        """In-surface standard deviation of a Gaussian that covers its share of the area."""
        return math.sqrt(self.area / self.means.shape[0])


def street_centre(line: int) -> float:
    """The middle of the open corridor between building rows `line - 1` and `line` (x or y)."""
    return line * (BLOCK + STREET) - STREET / 2


def city_points(n: int, g: torch.Generator, blocks: int = 24) -> CityPoints:
    """n points on the surfaces of a blocks x blocks city, drawn from g (which moves on)."""
    pitch = BLOCK + STREET
    ix, iy = torch.meshgrid(torch.arange(blocks), torch.arange(blocks), indexing="ij")
    x0 = ix.flatten().float() * pitch + INSET
    y0 = iy.flatten().float() * pitch + INSET
    side = BLOCK - 2 * INSET
    hgt = MIN_HEIGHT + torch.rand(blocks * blocks, generator=g) * HEIGHT_RANGE
    area_walls = 4 * side * hgt
    area_roof = torch.full_like(hgt, side * side)
    ground = (blocks * pitch) ** 2 - blocks * blocks * BLOCK * BLOCK
    areas = torch.cat([area_walls, area_roof, torch.tensor([ground])])
    counts = torch.bincount(torch.multinomial(areas / areas.sum(), n, replacement=True, generator=g),
                            minlength=areas.numel())  # fmt: skip
    nb = blocks * blocks
    base = _building_colors(nb)
    means, normals, colors = [], [], []
    # walls: a side (0: y = y0 facing -y, 1: x = x0 + side facing +x, 2: y = y0 + side, 3: x = x0), a position, a height
    b_id = torch.repeat_interleave(torch.arange(nb), counts[:nb])
    m = b_id.numel()
    s = torch.randint(0, 4, (m,), generator=g)
    t = torch.rand(m, generator=g) * side
    z = torch.rand(m, generator=g) * hgt[b_id]
    bx, by = x0[b_id], y0[b_id]
    wx = torch.where(s == 0, bx + t, torch.where(s == 1, bx + side, torch.where(s == 2, bx + side - t, bx)))
    wy = torch.where(s == 0, by, torch.where(s == 1, by + t, torch.where(s == 2, by + side, by + side - t)))
    means.append(torch.stack([wx, wy, z], 1))
    side_normals = torch.tensor([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    normals.append(side_normals[s])
    window = ((t % WINDOW_PITCH) > 0.8) & ((t % WINDOW_PITCH) < 2.2) & ((z % FLOOR) > 1.0) & ((z % FLOOR) < 2.6)
    colors.append(torch.where(window[:, None], torch.tensor(GLASS), base[b_id]))
    # roofs
    b_id = torch.repeat_interleave(torch.arange(nb), counts[nb : 2 * nb])
    u = torch.rand(b_id.numel(), 2, generator=g) * side
    means.append(torch.stack([x0[b_id] + u[:, 0], y0[b_id] + u[:, 1], hgt[b_id]], 1))
    normals.append(torch.tensor([0.0, 0.0, 1.0]).expand(b_id.numel(), 3))
    colors.append(0.35 + 0.25 * base[b_id].mean(1, keepdim=True).expand(-1, 3))
    # streets: bands beside the grid lines, running along x or along y
    k = int(counts[-1])
    along = torch.rand(k, generator=g) * blocks * pitch
    line = torch.randint(0, blocks, (k,), generator=g).float()
    across = line * pitch - STREET + 2.0
    across += torch.rand(k, generator=g) * STREET
    horiz = torch.rand(k, generator=g) < 0.5
    means.append(torch.stack([torch.where(horiz, along, across), torch.where(horiz, across, along), torch.zeros(k)], 1))
    normals.append(torch.tensor([0.0, 0.0, 1.0]).expand(k, 3))
    # a dashed line down the middle of each band (3 m on, 3 m off)
    marking = ((across - (line * pitch - STREET / 2 + 2.0)).abs() < 0.2) & ((along % 6.0) < 3.0)
    colors.append(torch.where(marking[:, None], torch.tensor(MARKING), torch.tensor(ASPHALT)))
    return CityPoints(torch.cat(means), torch.cat(normals).contiguous(), torch.cat(colors).float(),
                      float(areas.sum()), blocks)  # fmt: skip


def _building_colors(count: int) -> torch.Tensor:
    """[count, 3] light facade colours: hues spread by the golden ratio, no random draws."""
    hue = (torch.arange(count, dtype=torch.float64) * 0.6180339887) % 1.0
    h6 = hue[:, None] * 6.0 - torch.tensor([3.0, 2.0, 4.0])
    rgb = (h6.abs() * torch.tensor([1.0, -1.0, -1.0]) + torch.tensor([-1.0, 2.0, 2.0])).clamp(0, 1)
    return (0.55 + 0.35 * rgb).float()


def quats_facing(normals: torch.Tensor) -> torch.Tensor:
    """[N, 4] (w, x, y, z) rotations that take the local z axis onto each unit normal (not -z)."""
    q = torch.stack([1.0 + normals[:, 2], -normals[:, 1], normals[:, 0], torch.zeros_like(normals[:, 0])], 1)
    return q / q.norm(dim=1, keepdim=True)


def city_gaussians(n: int, seed: int, blocks: int = 24, sh_degree: int = 0) -> dict[str, torch.Tensor]:
    """The city as n flat Gaussians lying in its surfaces, in gstrain's parameter layout
    (docs/CONVENTIONS.md: log scales, wxyz quats, logit opacities, SH with shN zero)."""
    from gstrain.model import SH_C0, num_sh_rest

    pts = city_points(n, torch.Generator().manual_seed(seed), blocks)
    sigma = pts.sigma
    scales = torch.tensor([sigma, sigma, sigma * FLATNESS]).log().expand(n, 3).contiguous()
    return {
        "means": pts.means,
        "scales": scales,
        "quats": quats_facing(pts.normals),
        "opacities": torch.full((n,), math.log(OPACITY / (1 - OPACITY))),
        "sh0": ((pts.colors - 0.5) / SH_C0)[:, None, :].contiguous(),
        "shN": torch.zeros(n, num_sh_rest(sh_degree), 3),
    }


def look_at(eye: np.ndarray, target: np.ndarray, up: np.ndarray) -> np.ndarray:
    """World-to-camera [4, 4] float32 (COLMAP: x right, y down, z forward) at eye, facing target."""
    f = target - eye
    f /= np.linalg.norm(f)
    r = np.cross(f, up)
    r /= np.linalg.norm(r)
    d = np.cross(f, r)
    rot = np.stack([r, d, f])
    m = np.eye(4, dtype=np.float32)
    m[:3, :3], m[:3, 3] = rot, -rot @ eye
    return m
