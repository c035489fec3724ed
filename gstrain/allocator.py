"""The CUDA caching allocator's settings for a gstrain process.

Expandable segments, unless the user set the allocator's configuration: each memory pool grows
as one mapped range instead of separate cudaMalloc segments, so blocks freed by one kind of step
(an eager step's buffers, a graph's pool) are not stranded as unusable fragments beside the next
allocation. Without it, a 24 GiB cap on the H200 held up to 9 GiB reserved but unallocated at the
largest Gaussian count that fit (bench/big_curve.py's probes; bench/NOTES.md). The setting is
read when CUDA's allocator starts, so it is made before the first CUDA allocation: at the
command's entry (gstrain/cli.py) and at the start of the benchmark children that build trainers.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# the variable torch reads (PYTORCH_ALLOC_CONF is its newer, device-neutral name; either is the user's choice)
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def configure_allocator(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Ask for expandable segments unless the allocator is already configured; the setting made
    (None: the user's stays). Has no effect once this process has allocated CUDA memory."""
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in ALLOC_CONF_VARS):
        return None
    env[ALLOC_CONF_VARS[0]] = EXPANDABLE
    return EXPANDABLE
