"""Bytes per Gaussian at the peak of training (issue 37 item 2), gstrain against the baseline
pipeline, measured and counted.

    python -m bench.memory_per_gaussian SCENE --n 0.5M,1M,2M,4M [--pipelines gstrain,baseline]
        [--factor 1] [--warmup 100] [--steps 20] [--out DIR] [--device cuda] [--in-process]
        [--extra "--set optim.moments=bf16"]
    python -m bench.memory_per_gaussian --report DIR     (the tables again from DIR/curve.jsonl)

SCENE is a bench/big_scene.py folder. Every (pipeline, N) is one point of bench/big_curve.py (a
child process each; its records go to DIR/curve.jsonl and are reused by a later call): every view
of SCENE at data.factor F, the city's own N Gaussians, densification off (its statistics kept) so
that N stays fixed, every SH band active from step 3 (as after step 3000 of a run), --warmup steps
then --steps more. --warmup 100 by default: the graph engine's
first eager timed step (98) allocates beside the graphs' pool, and that is part of the peak.
Pipelines are bench_train's: gstrain (defaults: the CUDA-graph engine on a GPU) and baseline (gsplat
projection and rasterize_to_pixels, conv SSIM, torch Adam fused per tensor, DefaultStrategy's
statistics).

Per point, from the allocator (torch.cuda.max_memory_allocated, reset once the trainer is built):
    per Gaussian at the peak = (train peak - images on the device - fixed) / N
where fixed is gstrain.train.memory_budget's per-step pixel buffers for the largest view. Between
consecutive N, the slope (peak difference / N difference) cancels every fixed cost: the honest
per-Gaussian figure; a least-squares line over all N gives one slope and the intercept (what does
not grow with N). Also measured: the bytes per Gaussian of the tensors with one row per Gaussian
after the steps (parameters, gradients, Adam moments, statistics) and the tile pairs per Gaussian.

The analytic breakdown (memory_budget.per_gaussian_breakdown, at the scene's SH degree, pairs per
Gaussian as measured where known): parameters by tensor, gradients, Adam moments, statistics, the
step's buffers, pairs; for the baseline gsplat's SH path (baseline_extra_bytes) on top; Adam's
moments in the dtype the pipeline's flags and --extra set (optim.moments). Both also as reserved memory
(max_memory_reserved: with the cache and the graphs' pools). Writes DIR/memory_per_gaussian.json and
DIR/memory_per_gaussian.md (the markdown tables, also printed).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from bench.bench_train import PIPELINES
from bench.big_curve import Curve, load_records, parse_count, pipeline_sets
from gstrain.config import OptimConfig
from gstrain.files import write_text_atomic
from gstrain.train.memory_budget import (
    FLOAT,
    PAIRS_PER_GAUSSIAN,
    PARAM_FLOATS_BASE,
    STEP_BYTES,
    per_gaussian_breakdown,
    shn_floats,
    step_pixel_bytes,
)

JSON_FILE, MD_FILE = "memory_per_gaussian.json", "memory_per_gaussian.md"
# every SH band trains from step 3 (the default raises the degree every 1000 steps: a short run
# would measure degree 0's step, whose shN has neither gradients nor, on the CPU, Adam moments)
FULL_DEGREE = "--set train.sh_degree_interval=1"
MIB = 2**20


def baseline_extra_bytes(sh_degree: int) -> dict[str, int]:
    """Per-Gaussian step buffers the baseline holds on top of gstrain's (render/cuda.splat_colors
    through gsplat, and gsplat's isect_tiles): the forward's concatenation of sh0 and shN (K = (d+1)^2
    coefficients x 3, saved for the backward), the directions [N, 3], the visibility mask (1 B), the
    colours before and after + 0.5 and the clamp (2 x 3); the backward's coefficient gradient, split
    and copied into sh0.grad and shN.grad, and the directions' gradient; isect_tiles' tiles per
    Gaussian (int32) and their cumulative sum (int64)."""
    coeffs = (PARAM_FLOATS_BASE["sh0"] + shn_floats(sh_degree)) * FLOAT
    return {
        "gsplat SH: coefficients, directions, mask, colours": coeffs + 12 + 1 + 24,
        "gsplat SH backward: coefficient and direction gradients": coeffs + 12,
        "gsplat isect_tiles: tiles per Gaussian and their sum": 12,
    }


def moments_mode(pipeline: str, extra: str = "") -> str:
    """optim.moments as `pipeline`'s flags and then `extra` (fit flags) set it (the last wins)."""
    mode = OptimConfig().moments
    for item in pipeline_sets(PIPELINES.get(pipeline, []) + extra.split(), "cpu"):
        key, _, value = item.partition("=")
        if key == "optim.moments":
            mode = value
    return mode


def analytic(pipeline: str, sh_degree: int, pairs: float | None, extra: str = "") -> dict[str, int]:
    """The breakdown per Gaussian of `pipeline` (see the module docstring), with `extra` fit flags.
    No graph-pool row: the city has no masks, and for every other eager step the graph engine drops
    its graphs first (graph_step.DROP_GRAPHS_FOR)."""
    step = dict(STEP_BYTES)
    if pipeline == "baseline":
        step.update(baseline_extra_bytes(sh_degree))
    return per_gaussian_breakdown(sh_degree, "default", step_bytes=step,
                                  pairs_per_gaussian=PAIRS_PER_GAUSSIAN if pairs is None else pairs,
                                  moments=moments_mode(pipeline, extra))  # fmt: skip


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of ys against xs; None under two distinct xs."""
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def summarize(records: list[dict[str, Any]], sh_degree: int) -> dict[str, Any]:
    """Per pipeline: the points (per Gaussian at the peak, slopes between consecutive N), the
    line over all N, and the analytic breakdown."""
    out: dict[str, Any] = {}
    for pipeline in dict.fromkeys(r["pipeline"] for r in records):
        ok = sorted((r for r in records if r["pipeline"] == pipeline and r["status"] == "ok"), key=lambda r: r["n"])
        points, prev = [], None
        for r in ok:
            peak, n = r.get("train_peak_bytes"), r["n"]
            fixed = step_pixel_bytes(r["width"] * r["height"])
            row = {"n": n, "train_peak_bytes": peak, "train_reserved_bytes": r.get("train_reserved_bytes"),
                   "images_bytes": r.get("images_bytes"), "fixed_bytes": fixed, "per_gaussian": None, "slope": None,
                   "reserved_slope": None, "resident_per_gaussian": r.get("resident_per_gaussian"),
                   "pairs_per_gaussian": r.get("pairs_per_gaussian"), "ms_per_step": r.get("ms_per_step")}  # fmt: skip
            if peak is not None:
                row["per_gaussian"] = round((peak - (r.get("images_bytes") or 0) - fixed) / n, 1)
            if prev is not None and n != prev["n"]:
                for key, of in (("slope", "train_peak_bytes"), ("reserved_slope", "train_reserved_bytes")):
                    if row[of] is not None and prev[of] is not None:
                        row[key] = round((row[of] - prev[of]) / (n - prev["n"]), 1)
            points.append(row)
            prev = row
        lines = {}
        for key, of in (("slope", "train_peak_bytes"), ("reserved_slope", "train_reserved_bytes")):
            measured = [p for p in points if p[of] is not None]
            lines[key] = fit_line([p["n"] for p in measured], [p[of] for p in measured])
        pairs = [p["pairs_per_gaussian"] for p in points if p["pairs_per_gaussian"] is not None]
        extra = next((r.get("extra") or "" for r in records if r["pipeline"] == pipeline), "")
        rows = analytic(pipeline, sh_degree, pairs[-1] if pairs else None, extra)
        out[pipeline] = {
            "points": points, "failed": [{"n": r["n"], "status": r["status"], "error": r.get("error")}
                                         for r in records if r["pipeline"] == pipeline and r["status"] != "ok"],
            "slope": None if lines["slope"] is None else round(lines["slope"][0], 1),
            "intercept_bytes": None if lines["slope"] is None else round(lines["slope"][1]),
            "reserved_slope": None if lines["reserved_slope"] is None else round(lines["reserved_slope"][0], 1),
            "analytic": rows, "analytic_total": sum(rows.values()),
        }  # fmt: skip
    return out


def _num(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value / scale:,.{digits}f}"


def markdown(summary: dict[str, Any], sh_degree: int) -> str:
    lines = [f"Bytes per Gaussian at the training peak (SH degree {sh_degree}); peaks from "
             "torch.cuda.max_memory_allocated after set-up.", "",
             "| pipeline | N | peak MiB | images MiB | fixed MiB | B/G at peak | slope B/G | reserved slope B/G "
             "| resident B/G | pairs/G | ms/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for pipeline, s in summary.items():
        for p in s["points"]:
            cells = [_num(p["train_peak_bytes"], MIB), _num(p["images_bytes"], MIB), _num(p["fixed_bytes"], MIB),
                     _num(p["per_gaussian"]), _num(p["slope"]), _num(p["reserved_slope"]),
                     _num(p["resident_per_gaussian"]),
                     _num(p["pairs_per_gaussian"], digits=2), _num(p["ms_per_step"], digits=2)]  # fmt: skip
            lines.append(f"| {pipeline} | {p['n']:,} | " + " | ".join(cells) + " |")
        for f in s["failed"]:
            lines.append(f"| {pipeline} | {f['n']:,} | {f['status']} | | | | | | | | |")
    lines += ["", "| pipeline | slope over all N (B/G) | intercept MiB | reserved slope (B/G) | analytic B/G |",
              "|---|---|---|---|---|"]  # fmt: skip
    for pipeline, s in summary.items():
        lines.append(f"| {pipeline} | {_num(s['slope'])} | {_num(s['intercept_bytes'], MIB)} | "
                     f"{_num(s['reserved_slope'])} | {s['analytic_total']} |")  # fmt: skip
    lines += ["", "Reserved memory holds the allocator's cache and the CUDA graphs' pools, which max_memory_allocated "
              "leaves out (their blocks are free between replays); an ended epoch's pool is given back only under "
              "memory pressure (a cap, a smaller card)."]  # fmt: skip
    if "gstrain" in summary and "baseline" in summary:
        a, b = summary["gstrain"]["slope"], summary["baseline"]["slope"]
        ratio = f"{a / b:.3f}" if a is not None and b else "–"
        lines += ["", f"gstrain / baseline, measured slope: {ratio} (issue 37's target: <= 0.6); analytic: "
                      f"{summary['gstrain']['analytic_total'] / summary['baseline']['analytic_total']:.3f}"]
    names = list(summary)
    keys = list(dict.fromkeys(k for s in summary.values() for k in s["analytic"]))
    lines += ["", "Analytic breakdown, bytes per Gaussian:", "", "| held by | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]  # fmt: skip
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(str(summary[n]["analytic"].get(k, "–")) for n in names) + " |")
    lines.append("| **total** | " + " | ".join(f"**{summary[n]['analytic_total']}**" for n in names) + " |")
    return "\n".join(lines) + "\n"


def write_report(out: Path, records: list[dict[str, Any]], sh_degree: int) -> dict[str, Any]:
    summary = summarize(records, sh_degree)
    write_text_atomic(out / JSON_FILE, json.dumps({"sh_degree": sh_degree, "pipelines": summary}, indent=1))
    text = markdown(summary, sh_degree)
    write_text_atomic(out / MD_FILE, text)
    print(text, end="")
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path, nargs="?")
    ap.add_argument("--n", default="0.5M,1M,2M,4M", help="Gaussian counts, comma-separated (2e6, 500k, 4M)")
    ap.add_argument("--pipelines", default="gstrain,baseline", help=", ".join(PIPELINES))
    ap.add_argument("--factor", type=int, default=1, help="the image size as data.factor")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sh-degree", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: a dry run; no allocator peaks there)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs")) / "memory_per_gaussian")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    ap.add_argument("--in-process", action="store_true", help="run the points here (no OOM isolation)")
    ap.add_argument("--extra", default="", help='more fit flags for every point, e.g. "--set optim.moments=bf16"')
    ap.add_argument("--report", type=Path, default=None, metavar="DIR", help="only the tables from DIR/curve.jsonl")
    args = ap.parse_args(argv)
    if args.report is not None:
        write_report(args.report, [r for r in load_records(args.report) if not r.get("probe")], args.sh_degree)
        return
    if args.scene is None:
        ap.error("a scene written by bench.big_scene is needed (or --report DIR)")
    pipelines = args.pipelines.split(",")
    unknown = [p for p in pipelines if p not in PIPELINES]
    if unknown:
        ap.error(f"unknown pipeline(s) {unknown}; choose from {', '.join(PIPELINES)}")
    if args.warmup < 1 or args.steps < 1 or args.factor < 1:
        ap.error("--warmup, --steps and --factor must be >= 1")
    # big_curve's points, as its own command line would ask them
    curve = Curve(argparse.Namespace(
        scene=args.scene, out=args.out, warmup=args.warmup, steps=args.steps, probe_warmup=args.warmup,
        probe_steps=args.steps, cap_gib=None, init="model", device=args.device, timeout=args.timeout,
        in_process=args.in_process,
        extra=f"--set model.sh_degree={args.sh_degree} {FULL_DEGREE} {args.extra}".strip()))  # fmt: skip
    for n in (parse_count(x) for x in args.n.split(",") if x.strip()):
        for pipeline in pipelines:
            curve.point(pipeline, args.factor, n)
    mine = [r for r in curve.records if r["factor"] == args.factor and r["pipeline"] in pipelines
            and not r.get("probe") and r.get("extra") == curve.args.extra]  # fmt: skip
    write_report(args.out, mine, args.sh_degree)


if __name__ == "__main__":
    main()
