"""The command's start-up time (process start to the first training step) in train_summary.json:
checked against a sleep of known length and against the wall clock around a real fit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from gstrain.train.run_record import seconds_since_process_start


def test_process_clock_counts_a_known_sleep():
    code = ("import time; time.sleep(1.5)\n"
            "from gstrain.train.run_record import seconds_since_process_start as s; print(s())")
    value = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.5 <= value < 1.5 + 15, value  # the sleep, plus the interpreter's start and the import
    assert 0 < seconds_since_process_start() < 24 * 3600


def test_fit_records_its_startup_between_launch_and_exit(demo_scene, tmp_path):
    out = tmp_path / "run"
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gstrain", "fit", str(demo_scene), "--out", str(out), "--steps", "3",
                           "--set", "log.eval_steps=[0]"], check=True, capture_output=True, text=True)  # fmt: skip
    wall = time.monotonic() - began
    summary = json.loads((out / "train_summary.json").read_text())
    startup, phases = summary["startup_seconds"], summary["startup_phases"]
    assert 0.3 < startup < wall, (startup, wall)  # the imports alone take longer than 0.3 s
    assert set(phases) == {"interpreter, imports and config", "scene", "renderer (CUDA context, kernels)",
                           "images", "initial model", "optimizers, strategy and step engine", "step-0 evaluation",
                           "other"}, phases
    assert all(v >= 0 for v in phases.values()), phases
    # every phase is a part of the whole: the named ones leave a non-negative remainder ("other")
    assert abs(sum(phases.values()) - startup) < 0.05, (phases, startup)
    assert 0.3 < phases["interpreter, imports and config"] < startup  # torch's import alone takes > 0.3 s
    assert phases["step-0 evaluation"] > 0  # log.eval_steps lists 0 and the demo has test views
    # the closing line says it, to 0.1 s from the unrounded time (the summary keeps 0.01 s: 3.25
    # there may be 3.2 or 3.3 in the line)
    said = re.search(r"\(after (\d+\.\d)s of start-up\)", proc.stderr + proc.stdout)
    assert said is not None, proc.stderr
    assert abs(float(said.group(1)) - startup) <= 0.05 + 0.005 + 1e-9, (said.group(0), startup)


def test_the_initial_model_is_scored_only_when_eval_steps_lists_0(demo_scene, tmp_path):
    """By default the first step waits for no evaluation: no step-0 score, no step-0 phase."""
    from cli_util import call_cli

    out = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", out, "--steps", "4", "--set", "log.eval_steps=[4]")
    assert code == 0, err
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["initial_test_psnr"] is None
    assert [h["step"] for h in summary["test_history"]] == [4]
    assert "step-0 evaluation" not in summary["startup_phases"]
    assert "initial test PSNR" not in err
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "bad", "--steps", "4", "--set", "log.eval_steps=[-1]")
    assert code == 2 and "log.eval_steps" in err and err.count("\n") == 1, err
