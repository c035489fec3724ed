"""The CUDA allocator's settings (gstrain/allocator.py) and the graph engine's cache check
(memory_budget.cache_crowds_headroom)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gstrain.allocator import configure_allocator
from gstrain.train.memory_budget import cache_crowds_headroom


def test_expandable_segments_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert configure_allocator(env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:128"}
        assert configure_allocator(mine) is None
        assert mine == {name: "max_split_size_mb:128"}  # the user's setting, untouched and alone


def test_the_command_sets_it_before_anything_runs() -> None:
    code = ("import os, sys\nsys.argv = ['gstrain', '--help']\nfrom gstrain.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('CONF=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "CONF=expandable_segments:True" in out


def test_no_cache_check_on_the_cpu() -> None:
    assert cache_crowds_headroom(torch.device("cpu")) is False


@pytest.mark.cuda
def test_cache_check_sees_idle_blocks_that_crowd_a_cap() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    base = torch.cuda.memory_reserved(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    try:
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base + 3 * 2**30) / total), device)  # 3 GiB left
        block = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
        assert not cache_crowds_headroom(device)  # allocated, not idle
        del block  # 2 GiB idle in the cache, 1 GiB left to allocate
        assert cache_crowds_headroom(device)
        assert cache_crowds_headroom(torch.device("cuda"))  # as the trainer names it: no index
        torch.cuda.empty_cache()
        assert not cache_crowds_headroom(device)
    finally:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        torch.cuda.empty_cache()
