"""gsplat's MCMC operations on the CPU. gsplat runs two of their steps as CUDA kernels only:
- the relocation: the opacity and scale a Gaussian keeps when it is split into n copies at one
  place (Eq. 9 of "3D Gaussian Splatting as Markov Chain Monte Carlo", Kheradmand et al. 2024),
  so that the copies together render as the original did; here in PyTorch, in float64 (the
  alternating sum over binomial coefficients cancels heavily);
- the 3D covariances the position noise is shaped by.
`cpu_ops()` has gsplat's MCMC operations call these, so that strategy.name=mcmc trains on the
CPU too (tests, CPU ranks).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from gstrain.render.projection import _quat_to_rotmat


def relocation(opacities: Tensor, scales: Tensor, ratios: Tensor, binoms: Tensor) -> tuple[Tensor, Tensor]:
    """New (opacities [N], scales [N,3]) for Gaussians each becoming `ratios` [N] copies (clamped
    to 1..n_max); binoms [n_max, n_max] holds C(i, k) at [i, k], as gsplat's MCMC state does."""
    n_max = binoms.shape[0]
    n = ratios.clamp(1, n_max).long()
    o = opacities.double()
    new_o = 1.0 - (1.0 - o) ** (1.0 / n.double())
    # sum over i = 1..n of sum over k < i of C(i-1, k) (-1)^k o'^(k+1) / sqrt(k+1): the i-sums
    # of C(i-1, k) for every n are one cumulative sum over the table's rows
    counts = torch.cumsum(binoms.double(), dim=0)[n - 1]  # [N, n_max]: sum_{j<n} C(j, k)
    k = torch.arange(n_max, dtype=torch.float64, device=opacities.device)
    terms = (-1.0) ** k / torch.sqrt(k + 1.0) * new_o[:, None] ** (k + 1.0)
    denom = (counts * terms).sum(dim=1)
    new_scales = (o / denom)[:, None] * scales.double()
    return new_o.to(opacities.dtype), new_scales.to(scales.dtype)


def covariances(quats: Tensor, scales: Tensor, compute_covar: bool = True, compute_preci: bool = False,
                triu: bool = False) -> tuple[Tensor | None, None]:  # fmt: skip
    """R S S^T R^T [N,3,3] of quats [N,4] (w,x,y,z) and linear scales [N,3], in the call form of
    gsplat's quat_scale_to_covar_preci (what MCMC's noise asks for: full covariances only)."""
    if compute_preci or triu:
        raise NotImplementedError("only full covariances (MCMC's position noise)")
    m = _quat_to_rotmat(quats) * scales[:, None, :]
    return (m @ m.transpose(-1, -2) if compute_covar else None), None


@contextmanager
def cpu_ops() -> Iterator[None]:
    """Inside the block gsplat's MCMC operations (gsplat.strategy.ops) relocate with `relocation`
    and shape their noise with `covariances`."""
    from gsplat.strategy import ops

    kernels = ops.compute_relocation, ops.quat_scale_to_covar_preci
    ops.compute_relocation, ops.quat_scale_to_covar_preci = relocation, covariances
    try:
        yield
    finally:
        ops.compute_relocation, ops.quat_scale_to_covar_preci = kernels
