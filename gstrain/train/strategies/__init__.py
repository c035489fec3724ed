"""Densification strategies: one small interface (base.Strategy), one module per strategy, and
the registry (registry.py) that names them. This file imports nothing heavy: the config reads
the registry's names through it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gstrain.errors import UserError
from gstrain.train.strategies.registry import REGISTRY, STRATEGY_NAMES

if TYPE_CHECKING:
    import torch

    from gstrain.config import StrategyConfig
    from gstrain.dev_config import DevConfig
    from gstrain.train.strategies.base import Strategy

__all__ = ["STRATEGY_NAMES", "build_strategy", "strategy_class"]


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under `name`; UserError for a name nobody registered."""
    if name not in REGISTRY:
        raise UserError(f"strategy.name must be one of {', '.join(STRATEGY_NAMES)}; got '{name}'")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_strategy(cfg: StrategyConfig, scene_extent: float, device: torch.device,
                   dev: DevConfig | None = None) -> Strategy:  # fmt: skip
    """The strategy `cfg.name` names, with its initial state; `dev`: the config's dev section."""
    return strategy_class(cfg.name)(cfg, scene_extent, device, dev)
