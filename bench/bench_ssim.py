"""SSIM benchmark: forward + backward of the conv SSIM (metrics.ssim_conv) against the fused kernels.

Images [H,W,3] float32 on the GPU (a render that needs a gradient, a fixed ground truth), at
720x1280 and 1080x1920 by default. Each repetition is one forward and one backward, timed with
CUDA events after warm-up; the table gives the median of the repetitions and conv / fused.

    python -m bench.bench_ssim [--reps 50] [--warmup 10] [--sizes 720x1280 1080x1920]
    python -m bench.bench_ssim --sanitize-case   # one small fwd+bwd, for compute-sanitizer

Prints a markdown table; writes JSON to $OUT/bench_ssim.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bench.builds import build_all
from gstrain.metrics import ssim_conv
from gstrain.train.fused_ssim import fused_photometric_loss, fused_ssim

REPO = Path(__file__).resolve().parents[1]

SsimFn = Callable[[Tensor, Tensor], Tensor]


def make_pair(h: int, w: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    img = torch.rand(h, w, 3, device="cuda", generator=gen)
    gt = (img + 0.1 * torch.randn(h, w, 3, device="cuda", generator=gen)).clamp(0, 1)
    return img, gt


def time_fwd_bwd(fn: SsimFn, img: Tensor, gt: Tensor, reps: int, warmup: int) -> list[float]:
    """Milliseconds per forward + backward, one CUDA-event pair per repetition."""
    x = img.clone().requires_grad_(True)
    times = []
    for i in range(warmup + reps):
        x.grad = None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x, gt).backward()
        end.record()
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in times]


def check_agreement(img: Tensor, gt: Tensor) -> tuple[float, float]:
    """(|value difference|, relative L2 gradient difference) of fused against conv in float32
    (cuDNN's TF32 off for this check; the timings run with PyTorch's defaults, as training does)."""
    out = []
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        for fn in (ssim_conv, fused_ssim):
            x = img.clone().requires_grad_(True)
            v = fn(x, gt)
            v.backward()
            out.append((v.detach(), x.grad))
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
    (cv, cg), (fv, fg) = out
    assert cg is not None and fg is not None
    return abs((fv - cv).item()), ((fg - cg).norm() / cg.norm()).item()


def sanitize_case() -> None:
    """Awkward sizes (tile edges, batch, one and four channels) through forward and backward."""
    for shape in [(37, 45, 3), (2, 20, 70, 1), (1, 1, 3), (17, 33, 4)]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        img = torch.rand(shape, device="cuda", generator=gen).requires_grad_(True)
        gt = torch.rand(shape, device="cuda", generator=gen)
        fused_ssim(img, gt).backward()
        img.grad = None
        fused_photometric_loss(img, gt, 0.2)[0].backward()  # the fused L1 + SSIM loss
    torch.cuda.synchronize()
    print("bench_ssim: sanitize case done")


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sizes", nargs="+", default=["720x1280", "1080x1920"], help="HxW, 3 channels")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sanitize-case", action="store_true", help="run one small case, no timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_ssim: needs a CUDA GPU", file=sys.stderr)
        return 2
    build_all(["ssim"])  # compile outside any timing
    if args.sanitize_case:
        sanitize_case()
        return 0

    rows = []
    for size in args.sizes:
        h, w = (int(v) for v in size.lower().split("x"))
        img, gt = make_pair(h, w)
        value_diff, grad_diff = check_agreement(img, gt)
        conv = statistics.median(time_fwd_bwd(ssim_conv, img, gt, args.reps, args.warmup))
        fused = statistics.median(time_fwd_bwd(fused_ssim, img, gt, args.reps, args.warmup))
        rows.append({
            "size": f"{h}x{w}x3", "conv_ms": conv, "fused_ms": fused, "speedup": conv / fused,
            "value_abs_diff": value_diff, "grad_rel_diff": grad_diff,
        })  # fmt: skip

    print(f"SSIM forward + backward, median of {args.reps} after {args.warmup} warm-up "
          f"({torch.cuda.get_device_name()}, commit {git_commit()})")  # fmt: skip
    print("| image | conv ms | fused ms | conv / fused | value diff | grad rel diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['conv_ms']:.3f} | {r['fused_ms']:.3f} | {r['speedup']:.1f}x | "
              f"{r['value_abs_diff']:.1e} | {r['grad_rel_diff']:.1e} |")  # fmt: skip

    out = args.json
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "bench_ssim.json"
    if out is not None:
        meta = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "commit": git_commit()}
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
