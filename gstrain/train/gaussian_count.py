"""A run whose densification pruned every Gaussian stops there, with one line that says why.

Nothing is left to render, so every later step would train nothing and end "done" with an empty
model. The check runs when the count is known on the host anyway (after a densifying step, or
at a sharded run's agreement), so it costs no sync; it raises before that step could write a
checkpoint, so the run folder keeps the last one that still had Gaussians.
"""

from __future__ import annotations

from gstrain.config import StrategyConfig
from gstrain.errors import UserError


def check_gaussians_left(count: int, strategy: StrategyConfig, step: int) -> None:
    """UserError naming the settings that pruned everything when `count` is 0 after `step`."""
    if count > 0:
        return
    if strategy.name == "default":
        cause = (f"strategy.prune_opa={strategy.prune_opa:g} prunes Gaussians less opaque than that, "
                 f"strategy.prune_scale3d={strategy.prune_scale3d:g} the larger ones")
        fix = "lower strategy.prune_opa (or raise strategy.prune_scale3d)"
    else:
        cause = f"strategy.name={strategy.name}"
        fix = "change the strategy.* settings"
    raise UserError(f"the densification at step {step} pruned every Gaussian ({cause}); stopped with none "
                    f"left to train: {fix}, then resume from the last checkpoint or start again")
