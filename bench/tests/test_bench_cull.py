"""bench_cull's table on made-up medians (the timings themselves need a GPU)."""

from __future__ import annotations

from bench import bench_cull


def test_table_ratios_and_totals() -> None:
    common = {"max_image_diff_torch": 0.0, "max_grad_rel_err_torch": 2e-7, "max_image_diff_kernel": 0.0,
              "max_grad_rel_err_kernel": 3e-7, "kernel_pairs_equal_torch": True,
              "compiled_mask_equal": True}  # fmt: skip
    views = [
        {"pairs_off": 100, "pairs_torch": 40, "pairs_kernel": 40, "cull_only_ms": 0.25,
         "proj_isect_ms_off": 1.0, "proj_isect_ms_torch": 1.5, "proj_isect_ms_kernel": 0.8,
         "raster_fwd_ms_off": 2.0, "raster_fwd_ms_torch": 1.0, "raster_fwd_ms_kernel": 1.0,
         "raster_bwd_ms_off": 3.0, "raster_bwd_ms_torch": 1.5, "raster_bwd_ms_kernel": 1.5, **common},
        {"pairs_off": 300, "pairs_torch": 60, "pairs_kernel": 60, "cull_only_ms": 0.75,
         "proj_isect_ms_off": 3.0, "proj_isect_ms_torch": 3.5, "proj_isect_ms_kernel": 2.2,
         "raster_fwd_ms_off": 4.0, "raster_fwd_ms_torch": 2.0, "raster_fwd_ms_kernel": 2.0,
         "raster_bwd_ms_off": 5.0, "raster_bwd_ms_torch": 2.5, "raster_bwd_ms_kernel": 2.5, **common},
    ]  # fmt: skip
    views[1]["max_image_diff_torch"] = 1e-7
    views[1]["max_grad_rel_err_torch"] = 1e-6
    med = bench_cull.summarise(views)
    assert med["pairs_off"] == 200 and med["raster_bwd_ms_kernel"] == 2.0
    assert "compiled_mask_equal" not in med and "kernel_pairs_equal_torch" not in med
    table = bench_cull.markdown({"w": {"gaussians": 1234, "views": views, "median": med}})
    off, torch_row, kernel = table.splitlines()[2:5]
    # medians: pairs 200 / 50 / 50; proj 2 / 2.5 / 1.5; fwd 3 / 1.5 / 1.5; bwd 4 / 2 / 2; whole 9 / 6 / 5
    assert off == ("| w | 1,234 | off | 200 | 100.0% | 2.000 | 1.00x | - | 3.000 | 1.00x | 4.000 | 1.00x | "
                   "9.000 | 1.00x | - | - |")  # fmt: skip
    assert torch_row == ("| w | 1,234 | PyTorch cull | 50 | 25.0% | 2.500 | 0.80x | 0.500 | 1.500 | 2.00x | 2.000 | "
                         "2.00x | 6.000 | 1.50x | 1.00e-07 | 1.00e-06 |")  # fmt: skip
    assert kernel == ("| w | 1,234 | kernel cull | 50 | 25.0% | 1.500 | 1.33x | - | 1.500 | 2.00x | 2.000 | "
                      "2.00x | 5.000 | 1.80x | 0.00e+00 | 3.00e-07 |")  # fmt: skip
