"""bench_cull's table on made-up medians (the timings themselves need a GPU)."""

from __future__ import annotations

from bench import bench_cull


def test_table_ratios_and_totals() -> None:
    views = [
        {"pairs_off": 100, "pairs_on": 40, "proj_isect_ms_off": 1.0, "proj_isect_ms_on": 1.5, "cull_only_ms": 0.25,
         "raster_fwd_ms_off": 2.0, "raster_fwd_ms_on": 1.0, "raster_bwd_ms_off": 3.0, "raster_bwd_ms_on": 1.5,
         "max_image_diff": 0.0, "max_grad_rel_err": 2e-7, "compiled_mask_equal": True},
        {"pairs_off": 300, "pairs_on": 60, "proj_isect_ms_off": 3.0, "proj_isect_ms_on": 3.5, "cull_only_ms": 0.75,
         "raster_fwd_ms_off": 4.0, "raster_fwd_ms_on": 2.0, "raster_bwd_ms_off": 5.0, "raster_bwd_ms_on": 2.5,
         "max_image_diff": 1e-7, "max_grad_rel_err": 1e-6, "compiled_mask_equal": True},
    ]  # fmt: skip
    med = bench_cull.summarise(views)
    assert med["pairs_off"] == 200 and med["raster_bwd_ms_on"] == 2.0 and "compiled_mask_equal" not in med
    table = bench_cull.markdown({"w": {"gaussians": 1234, "views": views, "median": med}})
    row = table.splitlines()[2]
    # kept 50 / 200; fwd 3 / 1.5; bwd 4 / 2; proj + fwd + bwd: 9 / 6
    assert row.startswith("| w | 1,234 | 200 | 50 | 25.0% | 2.000 | 2.500 | 0.500 | 3.000 | 1.500 | 2.00x |")
    assert "| 4.000 | 2.000 | 2.00x | 9.000 | 6.000 | 1.50x | 1.00e-07 | 1.00e-06 |" in row
