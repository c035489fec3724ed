"""bench.scaling: the commands it runs and the table it prints (no training here; the dry run is
`python -m bench.scaling DEMO_SCENE --device cpu --world 1,2 --steps 5`)."""

from __future__ import annotations

from pathlib import Path

from bench import scaling


def test_commands_take_the_distributed_path_with_the_global_batch():
    plain = scaling.fit_command(Path("s"), Path("o"), 4, None, 8, 100, 0, "cuda", ["--set", "a.b=1"])
    assert plain[1:4] == ["-m", "gstrain", "fit"] and "--set" in plain and "train.batch_size=8" in plain
    assert not any("dist." in a for a in plain)
    four = scaling.fit_command(Path("s"), Path("o"), 4, "locality", 8, 100, 0, "cuda", [])
    assert Path(four[0]).name == "torchrun" and four[1] == "--nproc-per-node=4" and four[2:4] == ["-m", "gstrain"]
    assert "dist.partition=locality" in four and "train.batch_size=8" in four
    assert "dev.always_distributed=true" not in four
    one = scaling.fit_command(Path("s"), Path("o"), 1, "random", 1, 100, 0, "cpu", [])
    assert "dev.always_distributed=true" in one  # one process still takes the sharded path


def test_table_compares_each_run_with_one_process_at_the_same_batch():
    base = {"seconds": 100.0, "steps": 10, "final_test_psnr": 20.0, "num_gaussians": 5, "peak_gpu_memory_gib": None}
    rows = [
        {"world": 1, "partition": None, "batch": 2, "seed": 0, **base},
        {"world": 2, "partition": "locality", "batch": 2, "seed": 0, **base, "seconds": 50.0,
         "comm_bytes_per_step": {"sent": 1_000_000, "received": 500_000}},
        {"world": 2, "partition": "random", "batch": 2, "seed": 0, "failed": True, "error": "boom"},
    ]
    text = scaling.table(rows)
    line = next(x for x in text.splitlines() if "| locality |" in x)
    assert "| 50.0 | 0.4 | 2.00x |" in line and "| 1.500 |" in line  # 10 steps x 2 views / 50 s; 1 + 0.5 MB
    assert "failed: boom" in text
