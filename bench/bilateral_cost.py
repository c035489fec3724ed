"""Where train.appearance=bilateral's time goes: the fused kernels, grid_sample, and the whole
correction's per-step work, at beer's size, in one short GPU call.

Times (CUDA events after warm-up, median of the repetitions, ms):
  - the fused forward, and the fused backward in every variant (fused_bilateral.BACKWARD_VARIANTS),
    called on the extension directly;
  - grid_sample's forward and backward (bilateral_grid.apply_grid with fused=False);
  - the correction's step as the trainer runs it, through the real BilateralAppearance built from
    the config defaults: `image` (the view's row, the slice) plus its backward, then `after_step`
    (the total-variation gradient of the whole table, the table's Adam step), for each fused
    backward variant and for grid_sample; `after_step` alone, `regulariser_grad` alone, and Adam
    on a table-sized parameter (torch's default and fused=True) too;
    and the host's wall time a step (a launch-bound step shows wall above the device's time).
Then a torch.profiler table (top CUDA kernels by self time) of a few of those steps.

    python -m bench.bilateral_cost [--size 701x1248] [--grid 8x16x16] [--views 71] [--reps 50]
                                   [--warmup 10] [--image PHOTO_OR_FOLDER] [--json PATH]
    python -m bench.bilateral_cost --sanitize-case   # every variant on awkward sizes, for compute-sanitizer

The image is a smooth synthetic photo (low-frequency colour field plus faint texture: luminance
changes level every few tens of pixels, as in a real view) unless --image names a photo (or a
folder: its first image), resized to --size. Prints markdown tables; writes JSON to
$OUT/bilateral_cost.json when OUT is set (or --json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")


def _size(text: str, parts: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != parts or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected {parts} positive integers joined by 'x', got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=lambda t: _size(t, 2), default=(701, 1248), help="HxW of the view")
    ap.add_argument("--grid", type=lambda t: _size(t, 3), default=(8, 16, 16), help="LxYxX cells")
    ap.add_argument("--views", type=int, default=71, help="rows of the table (training views)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--image", type=Path, default=None, help="a photo, or a folder whose first photo is used")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sanitize-case", action="store_true", help="run small cases of every variant, no timing")
    args = ap.parse_args(argv)
    if args.views < 1 or args.reps < 1 or args.warmup < 0:
        ap.error("--views and --reps must be >= 1, --warmup >= 0")
    return args


def _median_ms(pairs: list) -> float:
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def time_calls(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median ms of fn on the device, one CUDA-event pair a call."""
    import torch

    pairs = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if i >= warmup:
            pairs.append((start, end))
    torch.cuda.synchronize()
    return _median_ms(pairs)


def load_image(path: Path | None, size: tuple[int, int], device):  # -> Tensor [H, W, 3]
    import torch
    import torch.nn.functional as F

    height, width = size
    if path is None:  # smooth colour field + faint texture, values in about [0.05, 0.95]
        gen = torch.Generator(device="cpu").manual_seed(0)
        coarse = torch.rand(1, 3, 9, 15, generator=gen)
        field = F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)[0]
        texture = 0.015 * torch.randn(3, height, width, generator=gen)
        return (0.05 + 0.9 * field + texture).clamp(0.0, 1.0).permute(1, 2, 0).contiguous().to(device)
    from PIL import Image

    if path.is_dir():
        photos = sorted(p for p in path.rglob("*") if p.suffix in IMAGE_SUFFIXES)
        if not photos:
            raise SystemExit(f"bilateral_cost: no photo under {path}")
        path = photos[0]
    with Image.open(path) as im:
        rgb = torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8)
        rgb = rgb.reshape(im.height, im.width, 3)
    chw = rgb.permute(2, 0, 1)[None].float() / 255.0
    return F.interpolate(chw, size=(height, width), mode="area")[0].permute(1, 2, 0).contiguous().to(device)


def kernel_rows(image, grid, grad_out, reps: int, warmup: int) -> list[tuple[str, float]]:
    import torch

    from gstrain import extensions
    from gstrain.train.bilateral_grid import LUMA_B, LUMA_G, LUMA_R, apply_grid
    from gstrain.train.fused_bilateral import BACKWARD_VARIANTS

    ext = extensions.bilateral()
    luma = (LUMA_R, LUMA_G, LUMA_B)
    rows = [("fused forward", time_calls(lambda: ext.bilateral_fwd(image, grid, None, *luma), reps, warmup))]
    for index, name in enumerate(BACKWARD_VARIANTS):
        ms = time_calls(lambda i=index: ext.bilateral_bwd(image, grid, None, grad_out, *luma, i), reps, warmup)
        rows.append((f"fused backward, {name}", ms))
    x, g = image.clone().requires_grad_(), grid.clone().requires_grad_()
    with torch.no_grad():
        rows.append(("grid_sample forward", time_calls(lambda: apply_grid(image, grid), reps, warmup)))
    fwd, bwd = [], []
    for i in range(warmup + reps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        out = apply_grid(x, g)
        events[1].record()
        torch.autograd.grad(out, (x, g), grad_out)
        events[2].record()
        if i >= warmup:
            fwd.append((events[0], events[1]))
            bwd.append((events[1], events[2]))
    torch.cuda.synchronize()
    rows.append(("grid_sample forward (recording autograd)", _median_ms(fwd)))
    rows.append(("grid_sample backward (autograd)", _median_ms(bwd)))
    return rows


def build_model(args: argparse.Namespace, fused: bool, backward: str, device):
    """The trainer's BilateralAppearance for these sizes with the config's defaults (lr, TV weight)."""
    from gstrain.config import build_config
    from gstrain.train.bilateral_grid import BilateralAppearance

    levels, cells_y, cells_x = args.grid
    cfg = build_config(None, [{"train": {"appearance": "bilateral", "bilateral_grid_luma": levels,
                                         "bilateral_grid_y": cells_y, "bilateral_grid_x": cells_x}}])  # fmt: skip
    t = cfg.train
    return BilateralAppearance(args.views, tuple(args.grid), device, t.appearance_lr, t.appearance_decay,
                               t.appearance_start, t.bilateral_tv, fused, backward)  # fmt: skip


def step_rows(args, model, image, grad_out, label: str) -> list[tuple[str, float]]:
    """The correction's step as the eager trainer runs it: image() + backward, after_step()."""
    import torch

    from gstrain.train.step import StepView

    eye4, eye3 = torch.eye(4, device=image.device), torch.eye(3, device=image.device)
    render = image.clone().requires_grad_()
    apply, after, whole = [], [], []
    torch.cuda.synchronize()
    wall_start = 0.0
    for i in range(args.warmup + args.reps):
        if i == args.warmup:
            torch.cuda.synchronize()
            wall_start = time.perf_counter()
        view = StepView(eye4, eye3, image, index=i % args.views)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        render.grad = None
        model.image(render, view).backward(grad_out)
        events[1].record()
        model.after_step(i)
        events[2].record()
        if i >= args.warmup:
            apply.append((events[0], events[1]))
            after.append((events[1], events[2]))
            whole.append((events[0], events[2]))
    torch.cuda.synchronize()
    wall = (time.perf_counter() - wall_start) * 1e3 / args.reps
    return [
        (f"step, {label}: image + backward", _median_ms(apply)),
        (f"step, {label}: after_step (TV grad + Adam)", _median_ms(after)),
        (f"step, {label}: whole", _median_ms(whole)),
        (f"step, {label}: host wall a step", wall),
    ]


def table_rows(args, model) -> list[tuple[str, float]]:
    """The whole-table work alone: the TV gradient, and after_step with a gradient in place."""
    import torch

    rows = [("regulariser_grad (TV of the whole table)", time_calls(model.regulariser_grad, args.reps, args.warmup))]
    grad = torch.randn_like(model.table) * 1e-3
    pairs = []
    for i in range(args.warmup + args.reps):
        model.table.grad = grad.clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model.after_step(i)
        end.record()
        if i >= args.warmup:
            pairs.append((start, end))
    torch.cuda.synchronize()
    rows.append(("after_step alone (TV grad + Adam step)", _median_ms(pairs)))
    # Adam on a table-sized parameter: torch's default implementation (what the table uses) beside
    # fused=True (one kernel), to tell what a switch would save
    for label, options in (("default", {}), ("fused=True", {"fused": True})):
        if options and not model.table.is_cuda:
            continue
        param = torch.nn.Parameter(model.table.detach().clone())
        param.grad = grad.clone()
        adam = torch.optim.Adam([param], lr=model.lr, eps=1e-15, **options)
        rows.append((f"Adam step on the table alone, {label}", time_calls(adam.step, args.reps, args.warmup)))
    return rows


def profile_table(args, model, image, grad_out) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gstrain.train.step import StepView

    eye4, eye3 = torch.eye(4, device=image.device), torch.eye(3, device=image.device)
    render = image.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.profile_steps):
            render.grad = None
            model.image(render, StepView(eye4, eye3, image, index=i % args.views)).backward(grad_out)
            model.after_step(i)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=20)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=20)


def sanitize_case() -> None:
    """Forward and backward of every variant on sizes that are not multiples of the 32 x 8 block,
    grids whose blocks take the shared tile and ones that add to global memory, with and without a
    canvas `valid`: for compute-sanitizer's memcheck and racecheck."""
    import torch

    from gstrain.train.bilateral_grid import LUMA_B, LUMA_G, LUMA_R, identity_grids
    from gstrain.train.fused_bilateral import BACKWARD_VARIANTS, fused_apply_grid

    gen = torch.Generator(device="cpu").manual_seed(0)
    for (height, width), cells in (((37, 65), (8, 16, 16)), ((9, 11), (4, 64, 64)), ((50, 71), (64, 4, 4))):
        image = (torch.rand(height, width, 3, generator=gen) * 1.4 - 0.2).cuda()
        grid = (identity_grids(1, cells)[0] + 0.3 * torch.randn(12, *cells, generator=gen)).cuda()
        for valid in (None, torch.tensor([width - 5, height - 3], dtype=torch.int32, device="cuda")):
            for backward in BACKWARD_VARIANTS:
                x, g = image.clone().requires_grad_(), grid.clone().requires_grad_()
                out = fused_apply_grid(x, g, valid, (LUMA_R, LUMA_G, LUMA_B), backward)
                torch.autograd.grad(out, (x, g), torch.randn_like(out))
    torch.cuda.synchronize()
    print("bilateral_cost: sanitize case done")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bilateral_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.builds import build_all
    from gstrain.train.bilateral_grid import identity_grids
    from gstrain.train.fused_bilateral import BACKWARD_VARIANTS, DEFAULT_BACKWARD

    build_all(["bilateral"])  # compile outside any timing
    if args.sanitize_case:
        sanitize_case()
        return 0
    device = torch.device("cuda")
    image = load_image(args.image, args.size, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    grid = (identity_grids(1, tuple(args.grid))[0] + 0.05 * torch.randn(12, *args.grid, generator=gen)).to(device)
    grad_out = (torch.randn(image.shape, generator=gen) * 1e-6).to(device)  # an L1 loss's gradient, about

    rows = kernel_rows(image, grid, grad_out, args.reps, args.warmup)
    for name in BACKWARD_VARIANTS:
        rows += step_rows(args, build_model(args, True, name, device), image, grad_out, f"fused {name}")
    rows += step_rows(args, build_model(args, False, DEFAULT_BACKWARD, device), image, grad_out, "grid_sample")
    model = build_model(args, True, DEFAULT_BACKWARD, device)
    rows += table_rows(args, model)
    profile = profile_table(args, model, image, grad_out)

    height, width = args.size
    print(f"bilateral_cost: {height}x{width} view, grid {'x'.join(map(str, args.grid))} (LxYxX), "
          f"{args.views} views, median of {args.reps} after {args.warmup} warm-up, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("\n| what | ms |\n|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} |")
    print(f"\ntop CUDA kernels over {args.profile_steps} steps of the fused ({DEFAULT_BACKWARD}) correction:\n")
    print(profile)

    out_dir = os.environ.get("OUT")
    path = args.json or (Path(out_dir) / "bilateral_cost.json" if out_dir else None)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "size": list(args.size), "grid": list(args.grid), "views": args.views, "reps": args.reps,
            "warmup": args.warmup, "image": str(args.image) if args.image else "synthetic",
            "device": torch.cuda.get_device_name(), "ms": dict(rows), "profile": profile,
        }, indent=2))  # fmt: skip
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
