"""End-to-end training benchmark: `gstrain fit` as pipelines that differ only in the speed
features, on one scene, several seeds. Prints a markdown table; writes bench_train.json.

  baseline   what a gsplat user runs: gsplat's projection and rasterize_to_pixels (forward and
             backward), L1 + SSIM as PyTorch convolutions, torch.optim.Adam(fused=True) per tensor,
             gsplat's DefaultStrategy (with the opacity reset that gsplat 1.5.3 skips, as 1.5.2
             and gsplat's main do it; both pipelines), checkpoints only at the end
  gstrain    `gstrain fit` defaults, every speed feature on (ARC rasterizer, fused SSIM, one-launch
             Adam, sync-free densification statistics), checkpoints every 1000 steps
  gsplat-raster, conv-ssim, torch-adam, gsplat-stats   gstrain with that one feature off
  sparse-adam   gstrain plus Adam over the visible Gaussians only

    python3 scripts/bench_train.py SCENE --steps 7000 --seeds 0,1,2 --pipelines baseline,gstrain
    python3 scripts/bench_train.py --report DIR[:P1+P2] [DIR ...] [--seeds 0,1,2]
        (the tables again, from the per-run JSONs; only those seeds' runs with --seeds, only
        pipelines P1 and P2 from a DIR:P1+P2; speed figures only from runs that had the GPU alone)
    python3 scripts/bench_train.py SCENE --steps 7000 --seeds 0-7 --pipelines gstrain,conv-ssim --jobs 4
        (quality only: several runs share the GPU at once, so their times are not speed figures)
    python3 scripts/bench_train.py SCENE --steps 30000 --extra "--set train.stop_at=7000" ...
        (the 7k point of 30k runs, at a quarter of their cost: the schedules still span 30k)

Float atomics make runs diverge (densification differs), hence several seeds and medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Every speed switch off, and checkpoints only at the end as gsplat's example trainer does.
BASELINE = ["--atomic-mode", "gsplat", "--set", "train.fused_ssim=false", "--set", "optim.fused_adam=false",
            "--set", "strategy.fast_stats=false", "--set", "log.ckpt_every=0"]
PIPELINES = {
    "baseline": BASELINE,
    "gstrain": ["--atomic-mode", "arc"],  # the defaults: every switch on, checkpoints every 1000 steps
    # one switch off at a time: what each feature buys end to end
    "gsplat-raster": ["--atomic-mode", "gsplat"],
    "conv-ssim": ["--set", "train.fused_ssim=false"],
    "torch-adam": ["--set", "optim.fused_adam=false"],
    "gsplat-stats": ["--set", "strategy.fast_stats=false"],
    "sparse-adam": ["--set", "optim.sparse_adam=true"],
}


STEP_PHASES = ("data", "forward", "loss", "backward", "optimizer", "densify")  # top-level phases


# Every pipeline scores all training views after its loop (outside the timed part): a view the
# model never fitted tells a failed run from an overfitted one.
COMMON = ["--set", "log.eval_train_views=true"]


def run_one(scene: Path, mode: str, seed: int, steps: int, out: Path, extra: list[str], commit: str | None,
            jobs: int = 1) -> dict:
    run_dir = out / f"{mode}_seed{seed}"
    cmd = [sys.executable, "-m", "gstrain", "fit", str(scene), "--out", str(run_dir), "--steps", str(steps),
           "--seed", str(seed), "--device", "cuda", *COMMON, *PIPELINES[mode], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "train_summary.json").read_text())
    # concurrent_jobs > 1: the GPU was shared, so the run's times are no speed figure
    summary.update(mode=mode, seed=seed, process_wall_s=round(wall, 2), commit=commit, concurrent_jobs=jobs)
    (out / f"{mode}_seed{seed}.json").write_text(json.dumps(summary, indent=2))  # kept if a later run dies
    return summary


def build_extensions() -> None:
    """Compile (or load from the cache) gstrain's CUDA extensions in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gstrain.render.cuda import ensure_built as raster
    from gstrain.train.fused_ssim import ensure_built as ssim
    from gstrain.train.step_ops import ensure_built as step_ops

    for build in (raster, ssim, step_ops):
        build()


def median_spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}–{fmt.format(hi)})"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def psnr_at(run: dict, step: int) -> float | None:
    for point in run.get("test_history") or []:
        if point["step"] == step:
            return point["psnr"]
    return None


def parse_source(text: str) -> tuple[Path, set[str] | None]:
    """'DIR' (every pipeline's runs in it) or 'DIR:P1+P2' (only those pipelines' runs): a folder
    from an older commit can add the runs of a pipeline whose code has not changed since."""
    head, sep, tail = text.rpartition(":")
    if sep and tail and all(name in PIPELINES for name in tail.split("+")):
        return Path(head), set(tail.split("+"))
    return Path(text), None


def load_runs(dirs: list[Path | str], seeds: list[int] | None = None) -> tuple[list[dict], list[dict]]:
    """The per-run JSONs under `dirs` (only those of `seeds`, if given; see parse_source). The
    first run of each (pipeline, seed) counts towards the medians; later ones (the same seed
    again) are repeats: they show the run-to-run spread."""
    runs, repeats, seen = [], [], set()
    for source in dirs:
        d, only = parse_source(str(source))
        for path in sorted(d.glob("*_seed*.json")):
            run = json.loads(path.read_text())
            if (seeds is not None and run["seed"] not in seeds) or (only is not None and run["mode"] not in only):
                continue
            run.setdefault("source", d.name)
            key = (run["mode"], run["seed"])
            (repeats if key in seen else runs).append(run)
            seen.add(key)
    return runs, repeats


def report(runs: list[dict], repeats: list[dict] = (), reference: str = "baseline") -> None:
    """Markdown tables: medians (spread) per pipeline, every run, per-phase time, and the targets
    and noise tests of every other pipeline against `reference` (the baseline by default)."""
    modes = list(dict.fromkeys(r["mode"] for r in runs))

    def of(mode: str, key, rows=runs) -> list[float]:
        vals = [key(r) if callable(key) else r.get(key) for r in rows if r["mode"] == mode]
        return [float(v) for v in vals if v is not None]

    # Times count only from runs that had the GPU to themselves; quality and memory from all.
    solo = [r for r in runs if (r.get("concurrent_jobs") or 1) == 1]

    print("| pipeline | seeds | train loop s | wall ms / step | test PSNR | test SSIM | Gaussians | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        seeds = ",".join(str(r["seed"]) for r in runs if r["mode"] == mode)
        print(f"| {mode} | {seeds} | {median_spread(of(mode, 'seconds', solo), '{:.1f}')} | "
              f"{median_spread(of(mode, 'wall_ms_per_step', solo))} | {median_spread(of(mode, 'final_test_psnr'))} | "
              f"{median_spread(of(mode, 'final_test_ssim'), '{:.3f}')} | "
              f"{median_spread(of(mode, 'num_gaussians'), '{:,.0f}')} | "
              f"{median_spread(of(mode, 'peak_gpu_memory_gib'), '{:.3f}')} |")

    print("\n| pipeline, seed | train loop s | wall ms / step | test PSNR 7k → final | train PSNR | SSIM "
          "| Gaussians (most) | peak GiB | commit |")
    print("|---|---|---|---|---|---|---|---|---|")
    # train PSNR: all training views' mean (worst view) where scored, else the last logged view
    for r in sorted([*runs, *repeats], key=lambda r: (r["seed"], modes.index(r["mode"]) if r["mode"] in modes else 0)):
        tag = " (repeat)" if any(r is x for x in repeats) else ""
        if (r.get("concurrent_jobs") or 1) > 1:
            tag += f" (GPU shared by {r['concurrent_jobs']})"
        at7k = psnr_at(r, 7000)
        views = r.get("final_train_views")
        train = r.get("final_train_psnr")
        train_cell = (f"{views['psnr']:.2f} ({views['min_psnr']:.2f})" if views
                      else '–' if train is None else f"{train:.2f}")
        print(f"| {r['mode']}, {r['seed']}{tag} | {r['seconds']:.1f} | {r['wall_ms_per_step']:.2f} | "
              f"{'–' if at7k is None else f'{at7k:.2f}'} → {r['final_test_psnr']:.2f} | "
              f"{train_cell} | {r['final_test_ssim']:.3f} | "
              f"{r['num_gaussians']:,}{f' ({most:,})' if (most := r.get('max_gaussians')) else ''} | "
              f"{r['peak_gpu_memory_gib']:.3f} | {r.get('commit') or r.get('source') or '–'} |")

    print("\nper-phase ms per step, GPU events (host ms), median over the runs that had the GPU alone:")
    print("| phase | " + " | ".join(modes) + " |\n|---" + "|---" * len(modes) + "|")
    phases = list(dict.fromkeys(k for r in solo for k in (r.get("phase_ms_per_step") or {})))
    for ph in phases:
        cells = []
        for mode in modes:
            gpu = of(mode, lambda r, ph=ph: (r.get("phase_ms_per_step") or {}).get(ph), solo)
            host = of(mode, lambda r, ph=ph: (r.get("host_ms_per_step") or {}).get(ph), solo)
            cell = f"{statistics.median(gpu):.2f}" if gpu else "–"
            cells.append(cell + (f" ({statistics.median(host):.2f})" if host else ""))
        print(f"| {ph} | " + " | ".join(cells) + " |")

    print_per_view(runs, modes)

    shared = sorted({r.get("concurrent_jobs") or 1 for r in [*runs, *repeats]} - {1})
    if shared:
        print(f"\nnote: runs made with --jobs {'/'.join(map(str, shared))} shared the GPU; "
              "their times are not speed figures and count in no time median")
    if reference not in modes:
        return
    base_times = of(reference, "seconds", solo)
    base_psnr = statistics.median(of(reference, "final_test_psnr"))
    base_mem = statistics.median(of(reference, "peak_gpu_memory_gib"))
    # The targets are against the baseline, at the end of full runs. Against another
    # pipeline, or for runs paused early (train.stop_at), only the figures.
    stopped = sorted({r["steps"] for r in runs if r.get("status") == "stopped"})
    targets = reference == "baseline" and not stopped

    def verdict(ok: bool, bar: str = "") -> str:
        return f" ({'met' if ok else 'not met'}{' for ' + bar if bar else ''})" if targets else ""

    paused = f", runs paused at step {'/'.join(map(str, stopped))}" if stopped else ""
    print(f"\n{'targets' if targets else 'figures'} (medians against {reference}'s{paused}):")
    for mode in modes:
        if mode == reference:
            continue
        times = of(mode, "seconds", solo)
        if times and base_times:
            ratio = statistics.median(times) / statistics.median(base_times)
            time_cell = f"time {ratio:.3f}x{verdict(ratio <= 0.5, '<= 0.5x')}"
        else:
            time_cell = "time: no runs that had the GPU alone"
        dpsnr = statistics.median(of(mode, "final_test_psnr")) - base_psnr
        mem = statistics.median(of(mode, "peak_gpu_memory_gib"))
        print(f"- {mode}: {time_cell}, test PSNR {dpsnr:+.2f} dB{verdict(dpsnr >= -0.1, '>= -0.1 dB')}, "
              f"peak memory {mem:.3f} vs {base_mem:.3f} GiB{verdict(mem <= base_mem)}")
        print_psnr_spread(runs, mode, reference)
        print_location_test([*runs, *repeats], mode, reference)
        print_scatter_test([*runs, *repeats], mode, reference)


def print_per_view(runs: list[dict], modes: list[str]) -> None:
    """Mean (SD) of each held-out view's final test PSNR over every pipeline's runs: where the
    run-to-run noise sits, and whether any one view tells the pipelines apart."""
    scored = [r for r in runs if r.get("final_test_views_psnr")]
    views = sorted({v for r in scored for v in r["final_test_views_psnr"]})
    if not views:
        return
    print("\nfinal test PSNR per held-out view, mean (SD) over the runs that scored it:")
    print("| view | " + " | ".join(modes) + " |\n|---" + "|---" * len(modes) + "|")
    for view in views:
        cells = []
        for mode in modes:
            vals = [r["final_test_views_psnr"][view] for r in scored
                    if r["mode"] == mode and view in r["final_test_views_psnr"]]  # fmt: skip
            sd = f" ({statistics.stdev(vals):.1f})" if len(vals) > 1 else ""
            cells.append(f"{statistics.mean(vals):.1f}{sd}" if vals else "–")
        print(f"| {view} | " + " | ".join(cells) + " |")


def bootstrap_interval(ours: list[float], base: list[float], center=statistics.mean,
                       resamples: int = 10_000) -> tuple[float, float]:  # fmt: skip
    """90% bootstrap interval of center(ours) - center(base), each sample resampled with replacement."""
    rng = random.Random(0)
    boot = sorted(
        center(rng.choices(ours, k=len(ours))) - center(rng.choices(base, k=len(base))) for _ in range(resamples)
    )
    return boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]


def print_psnr_spread(runs: list[dict], mode: str, reference: str = "baseline", resamples: int = 10_000) -> None:
    """How far seed noise goes: seed-for-seed PSNR differences, and a bootstrap over seeds of the
    difference of medians (each pipeline's runs resampled with replacement)."""
    base = {r["seed"]: r["final_test_psnr"] for r in runs if r["mode"] == reference}
    ours = {r["seed"]: r["final_test_psnr"] for r in runs if r["mode"] == mode}
    diffs = [ours[seed] - base[seed] for seed in sorted(base.keys() & ours.keys())]
    if diffs:
        print(f"  test PSNR, {mode} - {reference} seed for seed: {', '.join(f'{d:+.2f}' for d in diffs)} dB; "
              f"mean {statistics.mean(diffs):+.2f}, median {statistics.median(diffs):+.2f}")
    if len(base) < 3 or len(ours) < 3:
        return
    lo, hi = bootstrap_interval(list(ours.values()), list(base.values()), statistics.median, resamples)
    print(f"  difference of median test PSNR, 90% seed-bootstrap interval: [{lo:+.2f}, {hi:+.2f}] dB")


def permutation_p(ours: list[float], base: list[float], statistic, resamples: int = 20_000) -> float:
    """How often `statistic(a, b)` of the pooled values, labels shuffled, reaches its observed value."""
    observed = statistic(ours, base)
    pooled, n = list(ours) + list(base), len(ours)
    rng = random.Random(0)
    hits = 0
    for _ in range(resamples):
        rng.shuffle(pooled)
        hits += statistic(pooled[:n], pooled[n:]) >= observed - 1e-12
    return hits / resamples


def location_test(ours: list[float], base: list[float], resamples: int = 20_000) -> float:
    """Two-sided permutation p-value for a difference of means between `ours` and `base`."""
    return permutation_p(ours, base, lambda a, b: abs(statistics.mean(a) - statistics.mean(b)), resamples)


def psnr_samples(runs: list[dict], mode: str, reference: str) -> list[tuple[str, list[float], list[float]]]:
    """(label, mode's values, reference's values) for the 7k and the final test PSNR of every run.
    The final line is left out where it repeats the 7k one (runs that ended or paused at 7k)."""
    out = []
    for label, value in (("7k", lambda r: psnr_at(r, 7000)), ("final", lambda r: r["final_test_psnr"])):
        ours = [v for r in runs if r["mode"] == mode and (v := value(r)) is not None]
        base = [v for r in runs if r["mode"] == reference and (v := value(r)) is not None]
        if len(ours) >= 3 and len(base) >= 3 and not (out and out[0][1:] == (ours, base)):
            out.append((label, ours, base))
    return out


def print_location_test(runs: list[dict], mode: str, reference: str = "baseline") -> None:
    """Is `mode`'s test PSNR different from `reference`'s beyond seed noise? Every run counts."""
    for label, ours, base in psnr_samples(runs, mode, reference):
        lo, hi = bootstrap_interval(ours, base)
        print(f"  {label} test PSNR over every run, {mode} vs {reference} ({len(ours)} and {len(base)} runs): "
              f"mean {statistics.mean(ours):.2f} vs {statistics.mean(base):.2f} dB "
              f"({statistics.mean(ours) - statistics.mean(base):+.2f}, 90% interval [{lo:+.2f}, {hi:+.2f}]), "
              f"median {statistics.median(ours):.2f} vs {statistics.median(base):.2f} dB; "
              f"two-sided permutation p = {location_test(ours, base):.3f} for a difference of means")


def scatter_test(ours: list[float], base: list[float], resamples: int = 20_000) -> float:
    """One-sided permutation p-value that `ours` scatters more than `base` (Brown-Forsythe: the
    mean absolute deviation from each sample's own median, labels shuffled)."""
    dev_ours = [abs(v - statistics.median(ours)) for v in ours]
    dev_base = [abs(v - statistics.median(base)) for v in base]
    return permutation_p(dev_ours, dev_base, lambda a, b: statistics.mean(a) - statistics.mean(b), resamples)


def print_scatter_test(runs: list[dict], mode: str, reference: str = "baseline") -> None:
    """Does `mode` scatter more than `reference` from run to run? Every run counts, repeats too."""
    for label, ours, base in psnr_samples(runs, mode, reference):
        print(f"  {label} test PSNR scatter, {mode} vs {reference} over {len(ours)} and {len(base)} runs: "
              f"SD {statistics.stdev(ours):.2f} vs {statistics.stdev(base):.2f} dB, "
              f"one-sided permutation p = {scatter_test(ours, base):.4f} for a wider scatter")


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' or '0-7' or a mix ('0-3,9')."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path, nargs="?")
    ap.add_argument("--steps", type=int, default=7000)
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; with --report, all)")
    ap.add_argument("--pipelines", default="baseline,gstrain", help=", ".join(PIPELINES))
    ap.add_argument("--reference", default="baseline",
                    help="with --report: the pipeline the targets and noise tests compare against")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs")) / "bench_train")
    ap.add_argument("--extra", default="", help="extra flags for gstrain fit, space-separated")
    ap.add_argument("--commit", default=None, help="recorded in each run's JSON (default: git HEAD)")
    ap.add_argument("--report", nargs="+", metavar="DIR",
                    help="print the tables from the per-run JSONs in these folders; runs nothing")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once on the one GPU (quality studies only: shared runs time nothing)")
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds) if args.seeds else None
    if args.report:
        report(*load_runs(args.report, seeds), reference=args.reference)
        return
    if args.scene is None:
        ap.error("a scene is needed (or --report DIR ...)")
    seeds = seeds or [0, 1, 2]
    modes = args.pipelines.split(",")
    unknown = [m for m in modes if m not in PIPELINES]
    if unknown:
        raise SystemExit(f"unknown pipeline(s) {unknown}; choose from {', '.join(PIPELINES)}")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    commit = args.commit or git_commit()
    # interleaved, so drift of the machine hits every mode alike
    order = [(mode, seed) for seed in seeds for mode in modes]

    def run(mode: str, seed: int, jobs: int) -> dict:
        r = run_one(args.scene, mode, seed, args.steps, args.out, args.extra.split(), commit, jobs)
        print(f"{mode} seed {seed}: {r['seconds']:.1f}s train loop, PSNR {r['final_test_psnr']:.2f}, "
              f"{r['num_gaussians']} Gaussians, peak {r['peak_gpu_memory_gib']} GiB", flush=True)
        return r

    if args.jobs == 1:
        rows = [run(mode, seed, 1) for mode, seed in order]
    else:
        build_extensions()  # here, once: parallel first builds would race on the cache
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = [f.result() for f in [pool.submit(run, mode, seed, args.jobs) for mode, seed in order]]
    (args.out / "bench_train.json").write_text(json.dumps(rows, indent=2))
    report(rows)


if __name__ == "__main__":
    main()
