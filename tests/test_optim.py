"""The per-tensor Adams and the position rate's exponential decay."""

from __future__ import annotations

import warnings

import pytest
import torch

from gstrain.config import OptimConfig
from gstrain.train.optim import build_means_scheduler, build_optimizers


def _optimizers(extent: float = 2.0, cfg: OptimConfig | None = None) -> dict[str, torch.optim.Optimizer]:
    n = 4
    params = torch.nn.ParameterDict({
        "means": torch.zeros(n, 3), "scales": torch.zeros(n, 3), "quats": torch.zeros(n, 4),
        "opacities": torch.zeros(n), "sh0": torch.zeros(n, 1, 3), "shN": torch.zeros(n, 15, 3),
    })  # fmt: skip
    return build_optimizers(params, cfg or OptimConfig(), extent)


def test_one_adam_per_tensor_and_the_position_rate_scales_with_the_scene():
    optimizers = _optimizers(extent=2.0)
    assert sorted(optimizers) == ["means", "opacities", "quats", "scales", "sh0", "shN"]
    # 3DGS's published rates: position 1.6e-4 times the scene extent, scales 5e-3 as they are
    assert optimizers["means"].param_groups[0]["lr"] == pytest.approx(1.6e-4 * 2.0)
    assert optimizers["scales"].param_groups[0]["lr"] == pytest.approx(5e-3)
    custom = _optimizers(extent=3.0, cfg=OptimConfig(means_lr=0.5, scales_lr=0.25))
    assert custom["means"].param_groups[0]["lr"] == pytest.approx(1.5)  # the config's rate, times the extent
    assert custom["scales"].param_groups[0]["lr"] == pytest.approx(0.25)


def test_decay_matches_torch_exponential_lr_and_ends_at_the_final_rate():
    cfg, steps = OptimConfig(), 300
    ours = _optimizers()["means"]
    theirs = _optimizers()["means"]
    schedule = build_means_scheduler(ours, cfg, steps)
    gamma = (cfg.means_lr_final / cfg.means_lr) ** (1.0 / steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warns: its optimizer never steps here
        reference = torch.optim.lr_scheduler.ExponentialLR(theirs, gamma=gamma)
        for _ in range(steps):
            schedule.step()
            reference.step()
            assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-12)
    assert ours.param_groups[0]["lr"] == pytest.approx(cfg.means_lr_final * 2.0, rel=1e-9)


def test_stepping_without_torch_optimizer_step_does_not_warn():
    # the fused Adam updates the tensors in one launch, outside torch's optimizer.step()
    cfg = OptimConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedule = build_means_scheduler(_optimizers()["means"], cfg, 100)
        for _ in range(3):
            schedule.step()
    # torch's own scheduler does warn in the same situation: what the class is there to avoid
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        reference = torch.optim.lr_scheduler.ExponentialLR(_optimizers()["means"], gamma=0.9)
        reference.step()


def test_resume_restores_the_rate_also_from_checkpoints_of_torch_exponential_lr():
    cfg, steps = OptimConfig(), 100
    first = _optimizers()["means"]
    schedule = build_means_scheduler(first, cfg, steps)
    for _ in range(40):
        schedule.step()
    want = first.param_groups[0]["lr"]
    saved_optimizer, saved_schedule = first.state_dict(), schedule.state_dict()

    # as Trainer.load_state_dict does: fresh optimizer, its saved state, then the schedule's
    for state in (saved_schedule, {"last_epoch": 40, "_last_lr": [want]}):
        again = _optimizers()["means"]
        again.load_state_dict(saved_optimizer)
        resumed = build_means_scheduler(again, cfg, steps)
        resumed.load_state_dict(state)
        assert again.param_groups[0]["lr"] == want
        resumed.step()
        schedule_next = want * resumed.gamma
        assert again.param_groups[0]["lr"] == pytest.approx(schedule_next, rel=1e-12)
