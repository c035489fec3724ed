"""train.batch_size: B views a step, the mean of their losses, one optimizer step; densification
statistics from all B views (checked against gsplat's own statistics code)."""

from __future__ import annotations

import torch

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.render.reference import render_reference
from gstrain.train.fused_ssim import training_loss_for
from gstrain.train.trainer import Trainer, ViewSampler

STEPS = {"train": {"steps": 6, "device": "cpu", "seed": 3},
         "model": {"init": "random", "init_points": 300, "sh_degree": 1},
         "strategy": {"refine_start": 100, "refine_stop": 200},
         "log": {"progress_every": 1, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0}}


def _trainer(demo_scene, tmp_path, **over):
    sections = {k: dict(v) for k, v in STEPS.items()}
    for key, value in over.items():
        section, name = key.split("__")
        sections.setdefault(section, {})[name] = value
    cfg = build_config(None, [sections])
    scene = load_scene(demo_scene, factor=1, test_every=cfg.data.test_every)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return Trainer(cfg, scene, run, torch.device("cpu"), log=lambda m: None)


def test_batch_step_is_the_mean_of_the_view_losses(demo_scene, tmp_path):
    """One batch step of B=3 equals one Adam step on the gradient of the mean of three reference renders."""
    trainer = _trainer(demo_scene, tmp_path, train__batch_size=3)
    start = {k: v.detach().clone() for k, v in trainer.params.items()}
    sampler = ViewSampler(len(trainer.scene.train), trainer.cfg.train.seed)
    views = [sampler.next() for _ in range(3)]
    trainer.train_step(0)

    ref = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone()) for k, v in start.items()})
    loss_fn = training_loss_for(torch.device("cpu"), False)
    losses = []
    for idx in views:
        view = trainer.scene.train[idx]
        image, _, _ = render_reference(ref, view.viewmat, view.K, view.width, view.height, 0, trainer.background)
        losses.append(loss_fn(image, view.image.float() / 255.0, trainer.cfg.train.ssim_lambda)[0])
    (sum(losses) / 3).backward()
    opt = {k: torch.optim.Adam([p], lr=trainer.optimizers[k].param_groups[0]["initial_lr"] if k == "means"
                               else trainer.optimizers[k].param_groups[0]["lr"], eps=trainer.cfg.optim.eps)
           for k, p in ref.items()}
    for o in opt.values():
        o.step()
    for name, p in trainer.params.items():
        assert torch.allclose(p.detach(), ref[name].detach(), atol=1e-6, rtol=1e-5), name
        assert not torch.equal(p.detach(), start[name]) or name == "shN", name


def test_batch_statistics_match_gsplat(demo_scene, tmp_path):
    """Our dense statistics over B views equal gsplat's own _update_state (fast_stats=false)."""
    fast = _trainer(demo_scene, tmp_path, train__batch_size=4, strategy__refine_start=1, strategy__refine_every=1000)
    slow = _trainer(demo_scene, tmp_path, train__batch_size=4, strategy__refine_start=1, strategy__refine_every=1000,
                    strategy__fast_stats=False)
    for step in range(3):
        fast.train_step(step)
        slow.train_step(step)
    for key in ("grad2d", "count"):
        a, b = fast.strategy.state[key], slow.strategy.state[key]
        assert a is not None and float(b.sum()) > 0
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-9), key


def test_batch_and_dist_keys_are_validated():
    import pytest

    from gstrain.errors import UserError

    for key, value in [("train.batch_size", 0), ("dist.partition", "nearest"), ("dist.compress", "int8"),
                       ("dist.timeout_s", 0), ("dist.backend", "mpi"), ("dist.count_weight", 1.5),
                       ("dist.rebalance_above", 0.5), ("dist.rebalance_window", 0), ("dist.max_imbalance", 0.9)]:
        section, name = key.split(".")
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            build_config(None, [{section: {name: value}}])
    with pytest.raises(UserError, match="dist.rebalance_above needs"):
        build_config(None, [{"dist": {"rebalance_above": 1.5, "partition": "round_robin"}}])
    cfg = build_config(None, [{"dist": {"partition": "views", "rebalance_above": 1.5}}])  # views rebalance by load
    assert cfg.dist.partition == "views"
    cfg = build_config(None, [{"dist": {"partition": "round_robin", "compress": "fp16"}, "train": {"batch_size": 4}}])
    assert (cfg.dist.partition, cfg.dist.compress, cfg.train.batch_size) == ("round_robin", "fp16", 4)
