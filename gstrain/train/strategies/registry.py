"""The strategy registry: a name -> the class that implements it, as "module:Class" under this package.

Kept free of imports so that the config can validate `strategy.name` without loading gsplat.
A new strategy is one new module here plus one line below.
"""

from __future__ import annotations

REGISTRY: dict[str, str] = {
    "default": "default:DefaultStrategy",  # gsplat's DefaultStrategy (clone, split, prune, reset)
    "mcmc": "mcmc:McmcStrategy",  # gsplat's MCMCStrategy (relocation; on the CPU through mcmc_cpu.py)
}
STRATEGY_NAMES: tuple[str, ...] = tuple(REGISTRY)
