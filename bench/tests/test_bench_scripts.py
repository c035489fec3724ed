"""The benchmark scripts: bench_train's report from saved runs (bench_report), its paired runs on the CPU,
memory_step's replay."""

from __future__ import annotations

import json

import pytest

from bench import bench_report, bench_train, memory_step, step_divergence


def fake_run(mode: str, seed: int, seconds: float, psnr: float, gib: float) -> dict:
    return {
        "mode": mode, "seed": seed, "seconds": seconds, "wall_ms_per_step": seconds / 30.0,
        "final_test_psnr": psnr, "final_test_ssim": 0.9, "num_gaussians": 1000, "peak_gpu_memory_gib": gib,
        "phase_ms_per_step": {"loss": 1.0}, "host_ms_per_step": {"loss": 0.5},
        "test_history": [{"step": 0, "psnr": 8.0, "ssim": 0.1}, {"step": 7000, "psnr": psnr + 1, "ssim": 0.9}],
    }  # fmt: skip


def test_bench_train_report_medians_targets_and_repeats(tmp_path, capsys):
    first, second = tmp_path / "c1", tmp_path / "c2"
    first.mkdir()
    second.mkdir()
    runs = [("baseline", 0, 200.0, 21.0, 1.0), ("baseline", 1, 240.0, 20.0, 0.9), ("baseline", 2, 260.0, 22.0, 1.1),
            ("gstrain", 0, 100.0, 20.95, 0.8), ("gstrain", 1, 130.0, 19.0, 0.95), ("gstrain", 2, 90.0, 23.0, 0.7)]
    for mode, seed, *figures in runs:
        (first / f"{mode}_seed{seed}.json").write_text(json.dumps(fake_run(mode, seed, *figures)))
    # the same seed again in a later folder: listed, but not part of the medians
    (second / "gstrain_seed0.json").write_text(json.dumps(fake_run("gstrain", 0, 1000.0, 5.0, 9.0)))

    counted, repeats = bench_report.load_runs([first, second])
    assert len(counted) == 6 and [(r["mode"], r["seed"]) for r in repeats] == [("gstrain", 0)]
    bench_report.report(counted, repeats)
    out = capsys.readouterr().out
    # medians: time 100 / 240, PSNR 20.95 vs 21.0 (-0.05 dB), memory 0.8 vs 1.0 GiB
    assert "gstrain: time 0.417x (met for <= 0.5x), test PSNR -0.05 dB (met for >= -0.1 dB), " \
           "peak memory 0.800 vs 1.000 GiB (met)" in out
    assert "| gstrain, 0 (repeat) | 1000.0 |" in out
    assert "gstrain - baseline seed for seed: -0.05, -1.00, +1.00 dB; mean -0.02, median -0.05" in out
    interval = out.split("90% seed-bootstrap interval: [")[1].split("]")[0]
    lo, hi = (float(x) for x in interval.replace(" dB", "").split(", "))
    assert -4.0 <= lo <= -0.05 <= hi <= 3.0  # medians of resampled runs can differ by at most the ranges
    assert "| baseline, 1 | 240.0 | 8.00 | 21.00 → 20.00 |" in out  # the 7k point from the test curve

    # a worse seed 0 moves the medians past both bars
    (first / "gstrain_seed0.json").write_text(json.dumps(fake_run("gstrain", 0, 125.0, 20.5, 1.2)))
    bench_report.report(*bench_report.load_runs([first]))
    assert "gstrain: time 0.521x (not met for <= 0.5x), test PSNR -0.50 dB (not met for >= -0.1 dB), " \
           "peak memory 0.950 vs 1.000 GiB (met)" in capsys.readouterr().out

    # only seeds 1 and 2: time 110 / 250, PSNR 21.0 vs 21.0, memory 0.825 vs 1.0
    counted, repeats = bench_report.load_runs([first, second], seeds=[1, 2])
    assert sorted({r["seed"] for r in counted}) == [1, 2] and repeats == []
    bench_report.report(counted, repeats)
    assert "gstrain: time 0.440x (met for <= 0.5x), test PSNR +0.00 dB (met for >= -0.1 dB), " \
           "peak memory 0.825 vs 1.000 GiB (met)" in capsys.readouterr().out


def test_bench_train_scatter_test_and_train_views(tmp_path, capsys):
    narrow = [21.0, 21.1, 20.9, 21.05, 20.95, 21.0]
    wide = [22.5, 19.5, 21.0, 23.0, 19.0, 21.5]
    assert bench_report.scatter_test(wide, narrow, resamples=4000) < 0.05
    assert bench_report.scatter_test(narrow, wide, resamples=4000) > 0.9
    assert bench_train.parse_seeds("0-3,9") == [0, 1, 2, 3, 9]

    runs = [fake_run("baseline", s, 200.0, v, 1.0) for s, v in enumerate(narrow)]
    runs += [fake_run("gstrain", s, 90.0, v, 0.8) for s, v in enumerate(wide)]
    runs[-1].update(final_train_views={"psnr": 38.5, "min_psnr": 18.25}, concurrent_jobs=4)
    bench_report.report(runs)
    out = capsys.readouterr().out
    assert "| gstrain, 5 (GPU shared by 4) | 90.0 | 3.00 | 22.50 → 21.50 | 38.50 (18.25) |" in out  # mean (worst)
    assert "runs made with --jobs 4 shared the GPU" in out
    line = next(x for x in out.splitlines() if "final test PSNR scatter, gstrain vs baseline over 6 and 6" in x)
    assert float(line.split("p = ")[1].split()[0]) < 0.05


def test_bench_train_shared_runs_time_nothing_and_folders_filter_pipelines(tmp_path, capsys):
    solo, shared, old = tmp_path / "solo", tmp_path / "shared", tmp_path / "old"
    for d in (solo, shared, old):
        d.mkdir()
    for mode, seed, secs, psnr in [("baseline", 0, 200.0, 21.0), ("gstrain", 0, 80.0, 21.0)]:
        (solo / f"{mode}_seed{seed}.json").write_text(json.dumps(fake_run(mode, seed, secs, psnr, 1.0)))
    for mode, seed, secs, psnr in [("baseline", 1, 900.0, 20.0), ("gstrain", 1, 900.0, 20.0),
                                   ("gstrain", 2, 900.0, 22.0)]:
        run = dict(fake_run(mode, seed, secs, psnr, 1.0), concurrent_jobs=6)
        run["phase_ms_per_step"] = {"loss": 99.0}
        (shared / f"{mode}_seed{seed}.json").write_text(json.dumps(run))
    # an older folder whose gstrain runs came from other code: only its baseline runs are read
    (old / "baseline_seed2.json").write_text(json.dumps(fake_run("baseline", 2, 210.0, 22.0, 1.0)))
    (old / "gstrain_seed3.json").write_text(json.dumps(fake_run("gstrain", 3, 10.0, 5.0, 1.0)))
    assert bench_report.parse_source(f"{old}:baseline") == (old, {"baseline"})
    assert bench_report.parse_source(str(old)) == (old, None)

    counted, repeats = bench_report.load_runs([solo, shared, f"{old}:baseline"])
    assert sorted((r["mode"], r["seed"]) for r in counted) == [
        ("baseline", 0), ("baseline", 1), ("baseline", 2), ("gstrain", 0), ("gstrain", 1), ("gstrain", 2)]
    bench_report.report(counted, repeats)
    out = capsys.readouterr().out
    # times only from the runs that had the GPU alone: 80 / median(200, 210) = 0.390, not 900 s
    assert "| baseline | 0,1,2 | 205.0 (200.0–210.0) |" in out
    assert "| gstrain | 0,1,2 | 80.0 |" in out
    assert "gstrain: time 0.390x (met for <= 0.5x), test PSNR +0.00 dB" in out
    assert "| gstrain, 1 (GPU shared by 6) | 900.0 |" in out
    assert "| loss | 1.00 (0.50) | 1.00 (0.50) |" in out  # the shared runs' 99 ms left out
    line = next(x for x in out.splitlines() if "final test PSNR over every run, gstrain vs baseline" in x)
    assert "(3 and 3 runs): mean 21.00 vs 21.00 dB (+0.00, 90% interval [" in line
    assert float(line.split("p = ")[1].split()[0]) > 0.9

    # with no solo run of a pipeline there is no time ratio
    bench_report.report(*bench_report.load_runs([shared]))
    assert "gstrain: time: no runs that had the GPU alone, test PSNR" in capsys.readouterr().out

    # against another pipeline: the same figures, without the verdicts
    bench_report.report(counted, repeats, reference="gstrain")
    out = capsys.readouterr().out
    assert "figures (medians against gstrain's):" in out
    assert "- baseline: time 2.562x, test PSNR +0.00 dB, peak memory 1.000 vs 1.000 GiB\n" in out
    assert "baseline - gstrain seed for seed: +0.00, +0.00, +0.00 dB" in out


def test_bench_train_location_test_separates_shifted_samples():
    base = [21.0, 21.2, 20.8, 21.1, 20.9, 21.0]
    assert bench_report.location_test([x - 1.0 for x in base], base, resamples=4000) < 0.01
    assert bench_report.location_test(base, list(reversed(base)), resamples=4000) > 0.99


def test_bench_train_runs_paused_early_get_figures_at_their_step_not_verdicts(tmp_path, capsys):
    base = [21.0, 21.4, 20.6, 21.2, 20.8, 21.0]
    runs = []
    for seed, value in enumerate(base):
        for mode, psnr in (("baseline", value), ("gstrain", value - 1.0)):
            run = fake_run(mode, seed, 50.0, psnr, 1.0)
            # paused by train.stop_at: the last test point is the 7k one
            run.update(status="stopped", steps=7000, concurrent_jobs=8,
                       test_history=[{"step": 0, "psnr": 8.0, "ssim": 0.1}, {"step": 7000, "psnr": psnr, "ssim": 0.9}])
            runs.append(run)
    bench_report.report(runs)
    out = capsys.readouterr().out
    assert "figures (medians against baseline's, runs paused at step 7000):" in out
    assert "- gstrain: time: no runs that had the GPU alone, test PSNR -1.00 dB, peak memory" in out
    assert "not met" not in out and "(met" not in out
    # the final point is the 7k point, so each test prints once, for 7k
    assert "final test PSNR" not in out
    line = next(x for x in out.splitlines() if "7k test PSNR over every run" in x)
    assert "mean 20.00 vs 21.00 dB (-1.00, 90% interval [" in line
    lo, hi = (float(x) for x in line.split("90% interval [")[1].split("]")[0].split(", "))
    assert lo <= -1.0 <= hi < 0.0  # a 1 dB shift over a 0.28 dB SD: the interval leaves zero out
    assert float(line.split("p = ")[1].split()[0]) < 0.01
    assert sum("7k test PSNR scatter" in x for x in out.splitlines()) == 1
    assert "per held-out view" not in out  # these runs carry no per-view scores


def test_bench_train_per_view_table(capsys):
    runs = []
    for seed, (a, b) in enumerate([(20.0, 25.0), (22.0, 25.0), (24.0, 25.0)]):
        for mode, shift in (("baseline", 0.0), ("gstrain", 1.0)):
            run = fake_run(mode, seed, 50.0, 21.0, 1.0)
            run["final_test_views_psnr"] = {"0008.jpg": a + shift, "0000.jpg": b}
            runs.append(run)
    bench_report.report(runs)
    out = capsys.readouterr().out
    assert "| view | baseline | gstrain |" in out
    assert "| 0000.jpg | 25.0 (0.0) | 25.0 (0.0) |" in out  # sorted by view name
    assert "| 0008.jpg | 22.0 (2.0) | 23.0 (2.0) |" in out


def test_memory_step_replay_counts_frees_of_older_blocks():
    ours = [{"filename": "/usr/lib/torch/autograd.py", "line": 1, "name": "apply"},
            {"filename": "/repo/gstrain/train/step.py", "line": 75, "name": "run"}]
    other = [{"filename": "/repo/gstrain/render/cuda.py", "line": 271, "name": "splat_colors"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "free_requested", "addr": 50, "size": 60},  # a block from before the recording
        {"action": "free_completed", "addr": 50, "size": 60},
        {"action": "alloc", "addr": 2, "size": 30, "frames": other},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 20, "frames": other},
    ]
    peak, groups = memory_step.peak_blocks(trace)
    assert peak == 100  # 100 at the first alloc; then 100 - 60 + 30 = 70, then 70 - 100 + 20
    # the innermost frame of ours names the block, not torch's own frame
    assert groups == {"/repo/gstrain/train/step.py:75 run": 100}


def test_step_divergence_floor_is_zero_on_cpu_and_a_real_change_shows(demo_scene, monkeypatch, capsys):
    # On the CPU the reference renderer is deterministic, so a pipeline paired with itself does
    # not drift at all; a pipeline whose arithmetic differs (another SSIM weight) drifts from step 1.
    monkeypatch.setattr(step_divergence, "PIPELINES", {"plain": [], "ssim-half": ["--set", "train.ssim_lambda=0.5"]})
    results = dict(step_divergence.main([str(demo_scene), "--device", "cpu", "--warmup", "4", "--steps", "1,3",
                                         "--pairs", "plain:plain,plain:ssim-half", "--warmup-pipeline", "plain",
                                         "--set", "model.sh_degree=1"]))
    same, changed = results["plain:plain"], results["plain:ssim-half"]
    assert same["stopped"] is None and changed["stopped"] is None
    assert same["loss"] == 0.0 and all(r["params"] == 0.0 and r["stats"] == 0.0 for r in same["at"].values())
    assert changed["loss"] > 1e-3  # the loss itself is weighted differently
    assert 0.0 < changed["at"][1]["params"] < changed["at"][3]["params"]
    assert changed["at"][3]["stats"] > 0.0
    assert "| plain : ssim-half |" in capsys.readouterr().out


def forked_run(mode: str, seed: int, psnr: float, twin: int = 0) -> dict:
    run = fake_run(mode, seed, 60.0, psnr, 1.0)
    run.update(fork={"at": 7000, "trunk": "gstrain"}, twin=twin, concurrent_jobs=1,
               test_history=[{"step": 0, "psnr": 8.0, "ssim": 0.1}, {"step": 7000, "psnr": 22.0, "ssim": 0.9},
                             {"step": 30000, "psnr": psnr, "ssim": 0.9}])  # fmt: skip
    return run


def test_bench_train_forked_runs_are_compared_fork_by_fork(tmp_path, capsys):
    # forks that land far apart (SD 1.5 dB), gstrain 0.3 dB above the baseline on every one
    baseline = [19.0, 23.0, 21.0, 18.5, 22.5, 20.0]
    noise = [0.05, -0.05, 0.1, -0.1, 0.0, 0.02]
    for seed, (b, e) in enumerate(zip(baseline, noise, strict=True)):
        runs = [forked_run("baseline", seed, b), forked_run("gstrain", seed, b + 0.3 + e),
                forked_run("gstrain", seed, b + 0.3 - e, twin=1)]  # fmt: skip
        for run in runs:
            name = f"{run['mode']}{'_twin1' if run['twin'] else ''}_seed{seed}"
            (tmp_path / f"{name}.json").write_text(json.dumps(run))
    counted, repeats = bench_report.load_runs([tmp_path])
    assert len(counted) == 12 and len(repeats) == 6 and all(r["twin"] == 1 for r in repeats)
    bench_report.report(counted, repeats)
    out = capsys.readouterr().out
    # no verdicts for forked runs, no time figure from their partial legs, no shared 7k sample
    assert "figures (medians against baseline's, runs forked at step 7000 from gstrain's checkpoint):" in out
    assert "(met" not in out and "not met" not in out
    assert "gstrain: time: no runs that had the GPU alone" in out
    assert "7k test PSNR over every run" not in out
    assert "| gstrain, 0 (twin) | 60.0 |" in out
    # unpaired, the 0.3 dB hides in the fork-to-fork spread; paired, it stands out
    unpaired = next(x for x in out.splitlines() if "final test PSNR over every run" in x)
    assert "(6 and 6 runs)" in unpaired and float(unpaired.split("p = ")[1].split()[0]) > 0.5
    paired = next(x for x in out.splitlines() if "paired over 6 forks, gstrain - baseline" in x)
    assert "mean +0.30 dB" in paired
    lo, hi = (float(x) for x in paired.split("90% interval [")[1].split("]")[0].split(", "))
    assert 0.2 < lo <= 0.3 <= hi < 0.4
    assert float(paired.split("p = ")[1]) < 0.05  # 6 of 6 the same sign: 2/64 under the null
    twins = next(x for x in out.splitlines() if "gstrain twice from each of 6 forks" in x)
    assert "SD of the difference 0.14 dB (mean -0.01); correlation of the two 1.00" in twins

    # no pairs without a shared fork: the same runs from two folders do not pair across them
    assert bench_report.paired_differences(counted, "gstrain", "baseline") == pytest.approx(
        [0.35, 0.25, 0.4, 0.2, 0.3, 0.32])
    assert bench_report.sign_flip_p([0.3, -0.3, 0.2, -0.2], resamples=4000) > 0.9


@pytest.mark.slow
def test_bench_train_forks_on_the_cpu(demo_scene, tmp_path, capsys):
    """Every pipeline resumes its own copy of one trunk checkpoint; on the CPU (one deterministic
    renderer, the switches being GPU-only) all continuations must land on the same figures."""
    out = tmp_path / "bt"
    bench_train.main([str(demo_scene), "--steps", "6", "--fork-at", "3", "--seeds", "0", "--device", "cpu",
                      "--pipelines", "baseline,gstrain,gstrain", "--jobs", "2", "--out", str(out),
                      "--extra", "--set log.eval_steps=[0,3,6] --set log.progress_every=1"])  # fmt: skip
    trunk = json.loads((out / "trunks" / "seed0.json").read_text())
    assert trunk["status"] == "stopped" and trunk["steps"] == 3 and trunk["mode"] == "gstrain"
    finals = []
    for name in ("baseline_seed0", "gstrain_seed0", "gstrain_twin1_seed0"):
        run = json.loads((out / f"{name}.json").read_text())
        assert run["status"] == "done" and run["steps"] == 6 and run["first_step"] == 3
        assert run["fork"] == {"at": 3, "trunk": "gstrain"} and run["twin"] == (1 if "twin" in name else 0)
        assert [p["step"] for p in run["test_history"]] == [0, 3, 6]
        assert run["test_history"][:2] == trunk["test_history"]
        assert (out / name / "ckpt" / "step_3.pt").is_file()  # the trunk's checkpoint it went on from
        finals.append(run["final_test_psnr"])
    assert finals[0] == finals[1] == finals[2] != trunk["final_test_psnr"]
    report = capsys.readouterr().out
    assert "| gstrain, 0 (twin) (GPU shared by 2) |" in report
    assert "runs forked at step 3 from gstrain's checkpoint" in report


@pytest.mark.cuda
def test_bench_train_forks_on_the_gpu(demo_scene, tmp_path, capsys):
    """On the GPU each continuation must run with its own pipeline's switches: the baseline resumes
    a gstrain checkpoint on gsplat's rasterizer, torch Adam and gsplat's statistics."""
    out = tmp_path / "bt"
    bench_train.main([str(demo_scene), "--steps", "300", "--fork-at", "150", "--seeds", "0", "--device", "cuda",
                      "--pipelines", "baseline,gstrain,gstrain", "--jobs", "3", "--out", str(out),
                      "--extra", "--set strategy.refine_start=50 --set strategy.refine_every=50 "
                                 "--set log.eval_steps=[150,300]"])  # fmt: skip
    trunk = json.loads((out / "trunks" / "seed0.json").read_text())
    assert trunk["status"] == "stopped" and trunk["steps"] == 150 and trunk["atomic_mode"] == "arc"
    for name, backend, mode in (("baseline_seed0", "gsplat", None), ("gstrain_seed0", "cuda", "arc"),
                                ("gstrain_twin1_seed0", "cuda", "arc")):
        run = json.loads((out / f"{name}.json").read_text())
        assert run["status"] == "done" and run["steps"] == 300 and run["first_step"] == 150, run
        assert run["atomic_mode"] == mode and run["backend"] == backend
        config = (out / name / "config.yaml").read_text()
        switch = "false" if name.startswith("baseline") else "true"
        assert all(f"{key}: {switch}" in config for key in ("fused_adam", "fused_ssim", "fast_stats"))
    assert "paired over" not in capsys.readouterr().out  # one fork: no paired statistics yet


def test_builds_without_cuda_is_one_line(capsys):
    """build_all() goes through gstrain's own builders; where they cannot build, the CLI says so in one line."""
    import torch

    from bench import builds

    if torch.cuda.is_available():
        pytest.skip("this machine can build the extensions")
    with pytest.raises(ValueError, match="unknown extension"):
        builds.build_all(["raster", "nope"])
    assert builds.main(["gstrain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench.builds: error: ") and "CUDA" in err[0]


def test_graph_study_sets_a_module_constant_in_its_own_type(monkeypatch):
    """--const module.NAME=value: the value is parsed as the constant's type (a float from '1e9',
    an int from '3'), and an unknown name is an error, not a new attribute."""
    from bench import graph_study
    from gstrain import render
    from gstrain.train import graph_step

    monkeypatch.setattr(render, "RETUNE_CHANGE", render.RETUNE_CHANGE)  # restored after the test
    monkeypatch.setattr(graph_step, "MAX_UNSETTLED", graph_step.MAX_UNSETTLED)
    graph_study.set_constant("gstrain.render.RETUNE_CHANGE=1e9")
    graph_study.set_constant("gstrain.train.graph_step.MAX_UNSETTLED=3")
    assert render.RETUNE_CHANGE == 1e9 and isinstance(render.RETUNE_CHANGE, float)
    assert graph_step.MAX_UNSETTLED == 3 and isinstance(graph_step.MAX_UNSETTLED, int)
    with pytest.raises(AttributeError):
        graph_study.set_constant("gstrain.render.NO_SUCH_CONSTANT=1")


def test_feature_cost_takes_bench_train_pipelines_as_variants():
    import argparse

    from bench.feature_cost import pipeline_variant

    # the real-capture pipelines time against the defaults with their config keys, and only those
    assert pipeline_variant("bilateral") == ("bilateral", ["render.atomic_mode=arc", "train.appearance=bilateral"])
    assert pipeline_variant("appearance") == ("appearance", ["render.atomic_mode=arc", "train.appearance=affine"])
    assert pipeline_variant("gsplat-raster") == ("gsplat-raster", ["render.backend=gsplat"])
    with pytest.raises(argparse.ArgumentTypeError, match="unknown pipeline 'grid'"):
        pipeline_variant("grid")
