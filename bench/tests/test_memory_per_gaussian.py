"""bench/memory_per_gaussian.py: the per-Gaussian arithmetic on made-up allocator peaks (known
answers), the analytic tables, and a CPU dry run through big_curve's points (the tensors a run
holds per Gaussian, counted by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import big_scene
from bench import memory_per_gaussian as mpg

MIB = 2**20


def _record(pipeline: str, n: int, per: int, fixed_extra: int) -> dict:
    # a 100 x 50 view: memory_budget's pixel buffers are 5000 x 64 B = 320000 B; 1 MiB of images
    return {"pipeline": pipeline, "n": n, "status": "ok", "width": 100, "height": 50, "images_bytes": MIB,
            "train_peak_bytes": MIB + 320_000 + fixed_extra + per * n, "train_reserved_bytes": 2 * per * n,
            "resident_per_gaussian": 716.0,
            "pairs_per_gaussian": 2.0, "ms_per_step": 1.0, "device": "cuda"}  # fmt: skip


def test_per_gaussian_slopes_and_line_known_answers():
    records = [_record("gstrain", n, 1500, 8_000_000) for n in (1000, 3000)]
    records += [_record("baseline", n, 2500, 0) for n in (1000, 2000, 4000)]
    records.append({"pipeline": "baseline", "n": 8000, "status": "oom", "error": "CUDA out of memory"})
    s = mpg.summarize(records, 3)
    g, b = s["gstrain"], s["baseline"]
    # (peak - images - fixed) / N: 1500 + 8e6 / 1000 = 9500 at N=1000, 1500 + 8e6 / 3000 = 4166.7 at 3000
    assert [p["per_gaussian"] for p in g["points"]] == [9500.0, 4166.7]
    # the slope cancels the 8 MB that does not grow with N
    assert [p["slope"] for p in g["points"]] == [None, 1500.0]
    assert g["slope"] == 1500.0 and g["intercept_bytes"] == MIB + 320_000 + 8_000_000
    assert [p["slope"] for p in b["points"]] == [None, 2500.0, 2500.0] and b["slope"] == 2500.0
    assert [p["reserved_slope"] for p in b["points"]] == [None, 5000.0, 5000.0] and b["reserved_slope"] == 5000.0
    assert b["failed"] == [{"n": 8000, "status": "oom", "error": "CUDA out of memory"}]
    # the analytic rows at 2 pairs per Gaussian (48 B): gstrain 1172 - 96 + 48 (no graph pool: the
    # engine drops its graphs before the eager steps of a run without masks)
    assert g["analytic"]["step: tile pairs"] == 48 and g["analytic_total"] == 1124
    # the baseline: gsplat's SH path, coefficients 48 floats = 192 B: forward 192 + 12 + 1 + 24,
    # backward 192 + 12, isect_tiles 12; no graph pool
    assert b["analytic_total"] == 1124 + 229 + 204 + 12
    text = mpg.markdown(s, 3)
    assert "| gstrain | 3,000 |" in text and "| baseline | 8,000 | oom |" in text
    assert "measured slope: 0.600" in text and "| **total** | **1124** | **1569** |" in text


@pytest.fixture(scope="module")
def small_scene(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mpg") / "scene"
    big_scene.write_scene(out, views=4, width=48, height=32, n=3000, points=100, device="cpu", batch=4, workers=1,
                          log=lambda _msg: None)  # fmt: skip
    return out


def test_cpu_dry_run_counts_the_tensors_held(small_scene, tmp_path, capsys):
    out = tmp_path / "out"
    mpg.main([str(small_scene), "--n", "200,500", "--warmup", "4", "--steps", "1", "--device", "cpu",
              "--in-process", "--out", str(out)])  # fmt: skip
    data = json.loads((out / mpg.JSON_FILE).read_text())
    assert data["sh_degree"] == 3 and list(data["pipelines"]) == ["gstrain", "baseline"]
    for summary in data["pipelines"].values():
        assert [p["n"] for p in summary["points"]] == [200, 500]
        for p in summary["points"]:
            # between steps on the CPU: 59 parameter floats, Adam's two moments of each, grad2d and
            # count; the gradients are gone (set to None after each step), 4 B each: (59 x 3 + 2) x 4
            assert p["resident_per_gaussian"] == 716.0
            assert p["train_peak_bytes"] is None and p["per_gaussian"] is None  # no allocator on the CPU
            assert p["images_bytes"] == 4 * 48 * 32 * 3 and p["fixed_bytes"] == 48 * 32 * 64
    text = (out / mpg.MD_FILE).read_text()
    assert text in capsys.readouterr().out and "| parameter shN | 180 | 180 |" in text
    mpg.main(["--report", str(out)])  # the tables again from the records, nothing trains
    assert (out / mpg.MD_FILE).read_text() == text


def test_cpu_dry_run_with_bf16_moments(small_scene, tmp_path):
    """--extra "--set optim.moments=bf16" reaches every point (big_curve's --extra), as does
    bench_train's bf16-moments pipeline, and the analytic rows: the moments take 2 bytes a float
    instead of 4."""
    for pipeline, extra in (("gstrain", ["--extra", "--set optim.moments=bf16"]), ("bf16-moments", [])):
        out = tmp_path / pipeline
        mpg.main([str(small_scene), "--n", "200", "--warmup", "2", "--steps", "1", "--device", "cpu",
                  "--in-process", "--pipelines", pipeline, "--out", str(out), *extra])  # fmt: skip
        summary = json.loads((out / mpg.JSON_FILE).read_text())["pipelines"][pipeline]
        # 59 parameter floats (4 B), two bfloat16 moments of each (2 B), grad2d and count: 236 + 236 + 8
        assert [p["resident_per_gaussian"] for p in summary["points"]] == [480.0], pipeline
        assert summary["analytic"]["Adam moments"] == 236, pipeline
    assert mpg.analytic("gstrain", 3, None)["Adam moments"] == 472
    assert mpg.analytic("bf16-moments", 3, None)["Adam moments"] == 236
    assert mpg.moments_mode("bf16-moments", "--set optim.moments=fp32") == "fp32"  # the last word wins
