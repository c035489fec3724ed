"""bench_train's tables and noise tests, from the per-run JSONs it writes (one per pipeline and
seed): medians and spread per pipeline, every run, per-phase time, per-held-out-view PSNR, the
issue's targets against the baseline, and permutation and bootstrap tests of the seed noise.

    python -m bench.bench_train --report DIR[:P1+P2] [DIR ...] [--seeds 0,1,2] [--reference P]
"""

from __future__ import annotations

import json
import random
import re
import statistics
from pathlib import Path

PIPELINE_NAME = re.compile(r"[a-z0-9-]+")


def median_spread(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)}–{fmt.format(hi)})"


def psnr_at(run: dict, step: int) -> float | None:
    for point in run.get("test_history") or []:
        if point["step"] == step:
            return point["psnr"]
    return None


def parse_source(text: str) -> tuple[Path, set[str] | None]:
    """'DIR' (every pipeline's runs in it) or 'DIR:P1+P2' (only those pipelines' runs): a folder
    from an older commit can add the runs of a pipeline whose code has not changed since."""
    head, sep, tail = text.rpartition(":")
    names = tail.split("+")
    if sep and Path(head).is_dir() and not Path(text).is_dir() and all(PIPELINE_NAME.fullmatch(n) for n in names):
        return Path(head), set(names)
    return Path(text), None


def load_runs(dirs: list[Path | str], seeds: list[int] | None = None) -> tuple[list[dict], list[dict]]:
    """The per-run JSONs under `dirs` (only those of `seeds`, if given; see parse_source). The
    first run of each (pipeline, seed) counts towards the medians; later ones (the same seed
    again) are repeats: they show the run-to-run spread."""
    loaded = []
    for source in dirs:
        d, only = parse_source(str(source))
        for path in sorted(d.glob("*_seed*.json")):
            run = json.loads(path.read_text())
            if (seeds is not None and run["seed"] not in seeds) or (only is not None and run["mode"] not in only):
                continue
            run.setdefault("source", d.name)
            loaded.append(run)
    return split_repeats(loaded)


def split_repeats(all_runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(runs, repeats): the first run of each (pipeline, seed) counts; a later one, or a fork's
    twin, is a repeat."""
    runs, repeats, seen = [], [], set()
    for run in all_runs:
        key = (run["mode"], run["seed"])
        (repeats if key in seen or run.get("twin") else runs).append(run)
        if not run.get("twin"):
            seen.add(key)
    return runs, repeats


def report(runs: list[dict], repeats: list[dict] = (), reference: str = "baseline") -> None:
    """Markdown tables: medians (spread) per pipeline, every run, per-phase time, and the targets
    and noise tests of every other pipeline against `reference` (the baseline by default)."""
    modes = list(dict.fromkeys(r["mode"] for r in runs))

    def of(mode: str, key, rows=runs) -> list[float]:
        vals = [key(r) if callable(key) else r.get(key) for r in rows if r["mode"] == mode]
        return [float(v) for v in vals if v is not None]

    # Times count only from whole runs that had the GPU to themselves; quality and memory from all.
    solo = [r for r in runs if (r.get("concurrent_jobs") or 1) == 1 and not r.get("fork")]

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
        tag = " (twin)" if r.get("twin") else " (repeat)" if any(r is x for x in repeats) else ""
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
              f"{gib(r.get('peak_gpu_memory_gib'))} | {r.get('commit') or r.get('source') or '–'} |")

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
    base_mem = median_or_none(of(reference, "peak_gpu_memory_gib"))
    # The targets are against the baseline, at the end of full runs. Against another
    # pipeline, or for runs paused early (train.stop_at), only the figures.
    stopped = sorted({r["steps"] for r in runs if r.get("status") == "stopped"})
    forks = sorted({(r["fork"]["at"], r["fork"]["trunk"]) for r in runs if r.get("fork")})
    targets = reference == "baseline" and not stopped and not forks

    def verdict(ok: bool, bar: str = "") -> str:
        return f" ({'met' if ok else 'not met'}{' for ' + bar if bar else ''})" if targets else ""

    paused = f", runs paused at step {'/'.join(map(str, stopped))}" if stopped else ""
    paused += "".join(f", runs forked at step {at} from {trunk}'s checkpoint" for at, trunk in forks)
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
        mem = median_or_none(of(mode, "peak_gpu_memory_gib"))
        memory = "–" if None in (mem, base_mem) else f"{mem:.3f} vs {base_mem:.3f} GiB{verdict(mem <= base_mem)}"
        print(f"- {mode}: {time_cell}, test PSNR {dpsnr:+.2f} dB{verdict(dpsnr >= -0.1, '>= -0.1 dB')}, "
              f"peak memory {memory}")
        print_psnr_spread(runs, mode, reference)
        independent = [r for r in [*runs, *repeats] if not r.get("twin")]  # a twin shares its fork
        print_location_test(independent, mode, reference)
        print_scatter_test(independent, mode, reference)
        print_fork_pairs([*runs, *repeats], mode, reference)
    print_fork_twins([*runs, *repeats])


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
    # a forked run's 7k point is its trunk's (shared with the other pipelines): no sample
    seven_k = lambda r: None if r.get("fork") else psnr_at(r, 7000)  # noqa: E731
    for label, value in (("7k", seven_k), ("final", lambda r: r["final_test_psnr"])):
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


def gib(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fork_label(run: dict) -> str:
    return run["mode"] + (f" twin{run['twin']}" if run.get("twin") else "")


def fork_pairs(runs: list[dict], ours: str, base: str) -> list[tuple[float, float]]:
    """(final test PSNR of `ours`, of `base`) (fork labels), for each fork that both continued.
    A fork is one trunk checkpoint: one seed in one results folder."""
    forks: dict[tuple, dict[str, float]] = {}
    for r in runs:
        if r.get("fork"):
            forks.setdefault((r.get("source"), r["seed"]), {})[fork_label(r)] = r["final_test_psnr"]
    return [(f[ours], f[base]) for f in forks.values() if ours in f and base in f]


def paired_differences(runs: list[dict], ours: str, base: str) -> list[float]:
    return [a - b for a, b in fork_pairs(runs, ours, base)]


def sign_flip_p(diffs: list[float], resamples: int = 20_000) -> float:
    """Two-sided p-value that paired differences centre on zero: how often flipping each one's
    sign at random gives a mean at least as far from zero as the observed one."""
    observed = abs(statistics.mean(diffs))
    rng = random.Random(0)
    hits = 0
    for _ in range(resamples):
        flipped = sum(d if rng.random() < 0.5 else -d for d in diffs) / len(diffs)
        hits += abs(flipped) >= observed - 1e-12
    return hits / resamples


def print_fork_pairs(runs: list[dict], mode: str, reference: str = "baseline") -> None:
    """`mode` against `reference` where both continued the same checkpoints: the noise of the
    steps before the fork cancels in each difference."""
    diffs = paired_differences(runs, mode, reference)
    if len(diffs) < 2:
        return
    lo, hi = bootstrap_interval(diffs, [0.0])  # the mean of resampled differences
    print(f"  final test PSNR paired over {len(diffs)} forks, {mode} - {reference}: mean {statistics.mean(diffs):+.2f} "
          f"dB, SD {statistics.stdev(diffs):.2f}, 90% interval [{lo:+.2f}, {hi:+.2f}]; "
          f"two-sided sign-flip p = {sign_flip_p(diffs):.3f}")  # fmt: skip


def print_fork_twins(runs: list[dict]) -> None:
    """A pipeline run twice from each fork: how far its two continuations land apart (the noise
    left in a paired difference), and how much they still share."""
    for twin in sorted({fork_label(r) for r in runs if r.get("fork") and r.get("twin")}):
        mode = twin.split(" twin")[0]
        pairs = fork_pairs(runs, twin, mode)
        if len(pairs) < 2:
            continue
        diffs = [a - b for a, b in pairs]
        second, first = zip(*pairs, strict=True)
        spread = statistics.stdev(first) > 0 and statistics.stdev(second) > 0
        corr = f"; correlation of the two {statistics.correlation(first, second):.2f}" if spread else ""
        print(f"- {mode} twice from each of {len(diffs)} forks: SD of the difference {statistics.stdev(diffs):.2f} dB "
              f"(mean {statistics.mean(diffs):+.2f}){corr}")  # fmt: skip
