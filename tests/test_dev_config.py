"""The dev section: gstrain's own switches live there (set with --set dev.KEY=VALUE), the user
config shows none of them, and configs written before it existed still load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from gstrain.config import Config, build_config, config_from_dict, parse_override
from gstrain.dev_config import DevConfig
from gstrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# where each dev key lived before the section existed, and a value that is not its default
OLD_PLACES = {
    ("train", "fused_ssim"): ("fused_ssim", False), ("optim", "fused_adam"): ("fused_adam", False),
    ("strategy", "fast_stats"): ("fast_stats", False), ("render", "ellipse_cull"): ("ellipse_cull", False),
    ("render", "fused_sh"): ("fused_sh", False), ("train", "cuda_graphs"): ("cuda_graphs", False),
    ("render", "atomic_threshold"): ("atomic_threshold", 5), ("log", "time_every"): ("time_every", 7),
    ("dist", "always"): ("always_distributed", True),
}  # fmt: skip
# dev keys that never lived anywhere else, with their defaults
NEW_KEYS = {"adam_in_backward": True, "decode_in": "processes", "fused_bilateral": True,
            "bilateral_backward": "row_runs", "fused_remap": True}


def test_the_dev_keys_left_the_user_sections():
    defaults = Config().to_dict()
    assert sorted(defaults["dev"]) == sorted([new for new, _ in OLD_PLACES.values()] + list(NEW_KEYS))
    for section, key in OLD_PLACES:
        assert key not in defaults[section], f"{section}.{key}"
    for new, value in OLD_PLACES.values():
        assert getattr(DevConfig(), new) != value  # the test values differ from the defaults


def test_set_dev_keys_on_the_command_line():
    cfg = build_config(overrides=[parse_override("dev.cuda_graphs=false"), parse_override("dev.time_every=3"),
                                  parse_override("dev.always_distributed=true")])  # fmt: skip
    assert (cfg.dev.cuda_graphs, cfg.dev.time_every, cfg.dev.always_distributed) == (False, 3, True)
    with pytest.raises(UserError, match="dev.atomic_threshold must be 1..32; got 40"):
        build_config(overrides=[parse_override("dev.atomic_threshold=40")])
    with pytest.raises(UserError, match="dev.time_every must be >= 1; got 0"):
        build_config(overrides=[parse_override("dev.time_every=0")])
    with pytest.raises(UserError, match="unknown config key 'dev.fast'"):
        build_config(overrides=[parse_override("dev.fast=true")])


def test_default_yaml_shows_only_the_users_keys():
    shipped = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert "dev" not in shipped
    for section, key in OLD_PLACES:
        assert key not in shipped.get(section, {}), f"{section}.{key}"
    # ... and lists the dev keys in its closing comment, each with its default
    text = (REPO / "configs" / "default.yaml").read_text()
    for new in [new for new, _ in OLD_PLACES.values()] + list(NEW_KEYS):
        default = getattr(DevConfig(), new)
        assert f"#   {new}: {str(default).lower()}" in text, new


def _old_run_config() -> dict:
    """A run's saved config as versions before the dev section wrote it: every dev key in its old
    section, with a value other than the default."""
    old = Config().to_dict()
    del old["dev"]
    for (section, key), (_, value) in OLD_PLACES.items():
        old[section][key] = value
    return old


def test_an_old_runs_config_yaml_loads_into_dev_silently(tmp_path, capsys):
    from gstrain.run_dir import create_run_dir, load_run

    run = tmp_path / "run"
    create_run_dir(run, tmp_path, Config())
    (run / "config.yaml").write_text(yaml.safe_dump(_old_run_config(), sort_keys=False))
    loaded, _ = load_run(run)
    assert dataclasses.asdict(loaded.dev) == {**{new: value for new, value in OLD_PLACES.values()}, **NEW_KEYS}
    assert capsys.readouterr().err == ""  # the run wrote those keys itself: nothing to tell
    # saved again, it is the new layout
    assert config_from_dict(loaded.to_dict()).to_dict() == loaded.to_dict()


def test_an_old_key_in_a_config_file_works_with_a_note(tmp_path, capsys):
    f = tmp_path / "mine.yaml"
    f.write_text("train:\n  steps: 50\n  cuda_graphs: false\ndist:\n  always: true\n")
    cfg = build_config([f])
    assert (cfg.train.steps, cfg.dev.cuda_graphs, cfg.dev.always_distributed) == (50, False, True)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"gstrain: note: {f}: train.cuda_graphs is now dev.cuda_graphs",
                   f"gstrain: note: {f}: dist.always is now dev.always_distributed"]  # fmt: skip
    # the same through --set, and the dev spelling wins where one mapping gives both
    cfg = build_config(overrides=[parse_override("log.time_every=9"),
                                  {"render": {"fused_sh": False}, "dev": {"fused_sh": True}}])  # fmt: skip
    assert (cfg.dev.time_every, cfg.dev.fused_sh) == (9, True)
    assert capsys.readouterr().err.count("gstrain: note: command line:") == 2


def test_dev_switches_reach_the_renderer_and_the_strategy():
    import torch

    from gstrain.render import Renderer
    from gstrain.train.strategies import build_strategy
    from gstrain.train.strategies.default import FastStatsStrategy

    cfg = build_config(overrides=[{"dev": {"ellipse_cull": False, "fused_sh": False, "atomic_threshold": 3,
                                           "fast_stats": False}}])  # fmt: skip
    options = Renderer(cfg.render, torch.device("cpu"), dev=cfg.dev).options
    assert (options.ellipse_cull, options.fused_sh, options.atomic_threshold) == (False, False, 3)
    assert type(build_strategy(cfg.strategy, 1.0, torch.device("cpu"), cfg.dev).gsplat) is not FastStatsStrategy
    assert type(build_strategy(cfg.strategy, 1.0, torch.device("cpu")).gsplat) is FastStatsStrategy
