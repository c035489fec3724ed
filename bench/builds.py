"""One place that builds the CUDA extensions the studies use, so every script and gpu_env.sh build them alike.

    python -m bench.builds [gstrain|gsplat|all]    (from the repository root; gpu_env.sh runs the two in parallel)

gstrain's extensions (gstrain.extensions) are JIT-built into $TORCH_EXTENSIONS_DIR on first use (gstrain.cuda_build
caches them by a hash of their sources); gsplat 1.5.3 builds its own on first import of its backend, unless a prebuilt
module has been put in place (bench/gsplat_prebuilt.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from types import ModuleType


def build_all(only: Iterable[str] | None = None, gsplat: bool = False) -> dict[str, ModuleType]:
    """Build and load gstrain's CUDA extensions (all, or the names in `only`), and gsplat's when `gsplat`.

    Returns the loaded gstrain extensions by name; gsplat's is reached through gsplat itself.
    """
    from gstrain.extensions import BUILDERS  # imported here: `--help` needs no torch

    names = list(BUILDERS) if only is None else list(only)
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        raise ValueError(f"unknown extension(s) {unknown}; known: {list(BUILDERS)}")
    built = {name: BUILDERS[name]() for name in names}
    if gsplat:
        from gsplat.cuda._backend import _C  # the import itself builds (or loads) gsplat's module

        if _C is None:
            raise RuntimeError("gsplat's CUDA module did not build or load")
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="?", default="all", choices=["gstrain", "gsplat", "all"])
    args = ap.parse_args(argv)
    from gstrain.errors import UserError

    try:
        build_all(only=[] if args.which == "gsplat" else None, gsplat=args.which != "gstrain")
    except UserError as exc:  # no CUDA here: one line, as gstrain itself says it
        print(f"bench.builds: error: {exc}", file=sys.stderr)
        return 2
    print(f"bench.builds: {args.which} built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
