from pathlib import Path

import pytest

from gstrain.config import Config, build_config, config_from_dict, parse_override
from gstrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_defaults_match_default_yaml():
    # configs/default.yaml documents the defaults; it must not drift from the dataclasses.
    assert build_config([REPO / "configs/default.yaml"]).to_dict() == Config().to_dict()


@pytest.mark.parametrize("name", ["default.yaml", "demo.yaml", "mcmc.yaml"])
def test_shipped_configs_load(name):
    build_config([REPO / "configs" / name])


def test_yaml_then_overrides_in_order(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("train:\n  steps: 100\nstrategy:\n  refine_every: 50\n")
    cfg = build_config([f], [{"train": {"steps": 7}}, parse_override("render.atomic_mode=warp")])
    assert cfg.train.steps == 7
    assert cfg.strategy.refine_every == 50
    assert cfg.render.atomic_mode == "warp"


def test_unknown_key_and_section_are_errors(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  stepz: 100\n")
    with pytest.raises(UserError, match="unknown config key 'train.stepz'"):
        build_config([f])
    with pytest.raises(UserError, match="unknown config section 'trian'"):
        build_config(overrides=[{"trian": {"steps": 1}}])


def test_bad_values_are_errors():
    with pytest.raises(UserError, match="expects an integer"):
        build_config(overrides=[{"train": {"steps": "many"}}])
    with pytest.raises(UserError, match="atomic_mode must be one of"):
        build_config(overrides=[{"render": {"atomic_mode": "fast"}}])
    with pytest.raises(UserError, match="train.device"):
        build_config(overrides=[{"train": {"device": "tpu"}}])
    with pytest.raises(UserError, match="strategy.reset_every must be >= 1; got 0"):
        build_config(overrides=[{"strategy": {"reset_every": 0}}])
    with pytest.raises(UserError, match="section.key=value"):
        parse_override("steps=3")
    with pytest.raises(UserError, match="not found"):
        build_config(["/nonexistent/x.yaml"])


def test_types_are_coerced_from_strings():
    cfg = build_config(overrides=[parse_override("train.steps=12"), parse_override("strategy.absgrad=true"),
                                  parse_override("optim.means_lr=1e-4")])
    assert cfg.train.steps == 12 and cfg.strategy.absgrad is True and cfg.optim.means_lr == 1e-4


def test_round_trip_through_dict():
    cfg = build_config(overrides=[{"log": {"eval_steps": [5, 10]}}])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_backend_and_atomic_mode_are_separate_choices():
    cfg = build_config(overrides=[parse_override("render.backend=gsplat"), parse_override("render.atomic_mode=warp")])
    assert (cfg.render.backend, cfg.render.atomic_mode) == ("gsplat", "warp")
    with pytest.raises(UserError) as err:
        build_config(overrides=[parse_override("render.atomic_mode=gsplat")])
    assert str(err.value) == ("render.atomic_mode gsplat is no longer an atomic mode: gsplat's rasterizer is a "
                              "backend, use render.backend=gsplat")
    with pytest.raises(UserError, match="render.backend must be one of auto, reference, cuda, gsplat; got 'vulkan'"):
        build_config(overrides=[parse_override("render.backend=vulkan")])
    with pytest.raises(UserError, match="render.atomic_mode must be one of atomic, warp, distwar, arc; got 'fast'"):
        build_config(overrides=[parse_override("render.atomic_mode=fast")])


def test_saved_config_with_atomic_mode_gsplat_loads_as_backend_gsplat(tmp_path):
    """Run folders and checkpoints from before render.backend=gsplat existed still load."""
    old = Config().to_dict()
    old["render"] = {"backend": "auto", "atomic_mode": "gsplat", "atomic_threshold": 5}
    cfg = config_from_dict(old)
    assert (cfg.render.backend, cfg.render.atomic_mode, cfg.render.atomic_threshold) == ("gsplat", "arc", 5)
    assert old["render"]["atomic_mode"] == "gsplat"  # the caller's dict is not modified

    from gstrain.run_dir import create_run_dir, load_run

    run = tmp_path / "run"
    create_run_dir(run, tmp_path, Config())
    saved = run / "config.yaml"
    saved.write_text(saved.read_text().replace("atomic_mode: arc", "atomic_mode: gsplat"))
    loaded, _ = load_run(run)
    assert (loaded.render.backend, loaded.render.atomic_mode) == ("gsplat", "arc")
