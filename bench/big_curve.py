"""The cost curve on a big_scene folder (issue 37): ms per step, peak memory and the data path's
images/s against the number of Gaussians N and the image size, for gstrain and the baseline
pipeline (bench_train's definitions); and the largest N that trains, optionally under a memory cap.

    python -m bench.big_curve SCENE --n 1e6,2e6,4e6,8e6,16e6 --factors 1,2 --pipelines gstrain,baseline \
        [--warmup 100] [--steps 200] [--cap-gib 24] [--largest 1e6:64e6] [--out DIR]
    python -m bench.big_curve --plot DIR          (DIR/curve.png from DIR/curve.jsonl; needs matplotlib)

Each point (pipeline, factor, N, cap) is one child process (`--child`), so an out-of-memory error
ends only that point: the child trains with gstrain's Trainer (the Python API of `gstrain fit`) on
every view of SCENE at data.factor F, from a model of N Gaussians (--init model: the city's own
flat Gaussians generated at N, as a trained scene looks; sfm: gstrain's initialisation from N of
its surface points), densification off (its statistics still kept, as in a run's first 15k steps)
so that N stays as asked; it times --steps steps after --warmup (the device synchronised at both
ends; the loop stops there, without the end-of-run checkpoint, export and evaluation). A record:
ms_per_step, peak_gib (the allocator's peak over the whole child, set-up included; on the CPU
the process's peak resident set), setup_gib (allocated once the trainer is built: model and
images), images_per_s (the scene's images decoded and resized at start-up: gstrain's data path as
it is today; decode_s, and load_s for the whole load with the SfM points), and
status ok | oom | error; for bytes per Gaussian (bench/memory_per_gaussian.py): setup_bytes (allocated
once the trainer is built), images_bytes (the training images the device holds), train_peak_bytes (the
allocator's peak over the steps alone: its peak statistic reset after set-up; CUDA only),
train_reserved_bytes (the same for the memory it reserved: with the cache, and the CUDA graphs'
pools, whose blocks are free between replays, so that max_memory_allocated leaves them out),
resident_per_gaussian (bytes per Gaussian of the tensors with one row per Gaussian: parameters, their
gradients, Adam's moments, the strategy's statistics, after the steps) and pairs_per_gaussian (tile
pairs per view per Gaussian, after the cull, over every step). --cap-gib C caps the allocator at C GiB
(torch.cuda.set_per_process_memory_fraction): a 24 GB card on the H200. Records go to
DIR/curve.jsonl as they come (a later call skips points already there) and DIR/curve.csv;
--largest LO:HI bisects N geometrically per pipeline and factor (probes of --probe-steps steps)
until the bracket is within --tolerance, into DIR/largest.json.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.bench_train import PIPELINES
from bench.big_curve_plot import try_plot
from gstrain.allocator import configure_allocator

CURVE_FILE, CSV_FILE, LARGEST_FILE, PLOT_FILE = "curve.jsonl", "curve.csv", "largest.json", "curve.png"
INITS = ("model", "sfm")
FIELDS = ("pipeline", "factor", "n", "cap_gib", "init", "warmup", "steps", "extra", "probe", "status", "ms_per_step",
          "peak_gib", "setup_gib", "images_per_s", "decode_s", "load_s",
          "views", "width", "height", "num_gaussians", "setup_bytes", "images_bytes", "train_peak_bytes",
          "train_reserved_bytes", "resident_per_gaussian", "pairs_per_gaussian",
          "device", "error")  # fmt: skip
# every point: all views train (no test renders), no checkpoints or exports, no densification
FIXED_SETS = ("data.test_every=0", "log.ckpt_every=0", "log.eval_steps=[]", "log.save_steps=[]",
              "strategy.refine_start=1000000000")  # fmt: skip
STDERR_LINES = 80  # of a failed child's stderr, kept in its record ("stderr"; not in the CSV)
FLAG_KEYS = {"--backend": "render.backend", "--atomic-mode": "render.atomic_mode", "--factor": "data.factor"}


def pipeline_sets(flags: list[str], device: str) -> list[str]:
    """`gstrain fit` flags (bench_train's pipelines, --extra) as config overrides. On the CPU the
    rasterizer flag is dropped: every pipeline renders with the reference there (as bench_train)."""
    sets = []
    if len(flags) % 2:
        raise ValueError(f"flags come in pairs (flag value): {flags}")
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        if flag == "--set":
            sets.append(value)
        elif flag in FLAG_KEYS:
            if not (device == "cpu" and flag == "--backend"):
                sets.append(f"{FLAG_KEYS[flag]}={value}")
        else:
            raise ValueError(f"unsupported flag {flag} (known: --set, {', '.join(FLAG_KEYS)})")
    return sets


def point_key(rec: dict[str, Any]) -> tuple:
    return tuple(rec.get(k) for k in ("pipeline", "factor", "n", "cap_gib", "init", "warmup", "steps", "extra"))


# ---------------------------------------------------------------------------------------------
# the child: one point


class _Measured(Exception):
    """Raised by the timing hook once the timed steps are done: the fit stops there."""


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def decode_seconds(said: list[tuple[float, str]]) -> float | None:
    """Seconds from load_scene's "loading N images" line to its "loaded N images" line: the images'
    decode and resize alone, without reading the model's points (a few seconds for a million)."""
    start = next((t for t, msg in said if msg.startswith("loading ")), None)
    end = next((t for t, msg in said if msg.startswith("loaded ")), None)
    return end - start if start is not None and end is not None else None


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one point as the module docstring says; the record's measured fields."""
    from bench.big_scene import SCENE_FILE
    from bench.city import city_gaussians
    from gstrain.config import build_config, parse_override
    from gstrain.data.inputs import load_scene
    from gstrain.model import SH_C0
    from gstrain.render import resolve_device
    from gstrain.threads import apply_threads
    from gstrain.train.memory_budget import resident_bytes_per_gaussian
    from gstrain.train.trainer import Trainer

    scene_dir = Path(spec["scene"])
    made = json.loads((scene_dir / SCENE_FILE).read_text())
    warmup, steps, n = spec["warmup"], spec["steps"], spec["n"]
    sets = [*FIXED_SETS, f"data.factor={spec['factor']}", f"train.device={spec['device']}",
            f"train.steps={warmup + steps + 1}", *spec["sets"]]  # fmt: skip
    cfg = build_config(overrides=[parse_override(s) for s in sets])
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and spec.get("cap_gib"):
        total = torch.cuda.get_device_properties(device).total_memory
        index = device.index if device.index is not None else torch.cuda.current_device()  # it takes no bare "cuda"
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * 2**30 / total), index)
    apply_threads(cfg.train.threads, device)
    t0 = time.perf_counter()
    said: list[tuple[float, str]] = []  # load_scene's lines with their times: the decode is between two
    scene = load_scene(scene_dir, factor=cfg.data.factor, test_every=0,
                       log=lambda msg: said.append((time.perf_counter(), msg)))  # fmt: skip
    load_s = time.perf_counter() - t0
    decode_s = decode_seconds(said)
    model = city_gaussians(n, made["seed"], made["blocks"], sh_degree=cfg.model.sh_degree)
    if spec["init"] == "sfm":  # gstrain's own initialisation from N surface points (kNN sizes, opacity 0.1)
        rgb = (model["sh0"][:, 0] * SH_C0 + 0.5).clamp(0, 1)
        scene.points, scene.point_colors = model["means"].numpy(), (rgb * 255).round().byte().numpy()
        model = None

    class CurveTrainer(Trainer):
        def _initial_params(self) -> torch.nn.ParameterDict:
            if model is None:
                return super()._initial_params()
            return torch.nn.ParameterDict({k: torch.nn.Parameter(v.to(self.device)) for k, v in model.items()})

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with tempfile.TemporaryDirectory(prefix="big_curve_run_") as run_dir:
        trainer = CurveTrainer(cfg, scene, Path(run_dir), device, log=lambda _msg: None)
        sync()
        on_gpu = device.type == "cuda"
        setup_bytes = torch.cuda.memory_allocated(device) if on_gpu else None
        setup_peak = _peak_gib(device)
        if on_gpu:  # the steps' own peaks from here (peak_gib still covers the set-up: setup_peak)
            torch.cuda.empty_cache()  # the set-up's cached blocks: reserved memory starts at what lives
            torch.cuda.reset_peak_memory_stats(device)
        shapes = trainer.ctx.views.shapes()
        images_bytes = sum(math.prod(s) for s in shapes) if trainer.image_store.where == "gpu" else 0
        marks: dict[str, float] = {}
        step_once = trainer.train_step

        def timed_step(step: int) -> Any:
            if step in (warmup, warmup + steps):
                sync()
                marks[f"t{step}"] = time.perf_counter()
                if step == warmup + steps:
                    raise _Measured
            return step_once(step)

        trainer.train_step = timed_step
        try:
            trainer.fit()
        except _Measured:
            pass
        finally:
            if trainer.writer is not None:  # its event files live in run_dir, which goes next
                trainer.writer.close()
        if len(marks) < 2:
            raise RuntimeError(f"the fit ended before step {warmup + steps}")
        train_peak = torch.cuda.max_memory_allocated(device) if on_gpu else None
        train_reserved = torch.cuda.max_memory_reserved(device) if on_gpu else None
        count = len(trainer.params["means"])
        trainer.record.add_pairs(trainer.engine.pair_totals())  # the graph steps' pairs (settled)
        rec = trainer.record
        pairs = rec.pairs_after / rec.pairs_views / count if rec.pairs_views else None
        held = [*trainer.params.values(), *(p.grad for p in trainer.params.values())]
        held += [t for opt in trainer.optimizers.values() for st in opt.state.values() for t in st.values()]
        held += list(getattr(trainer.strategy, "state", {}).values())
        view = scene.train[0]
        result = {
            "ms_per_step": round((marks[f"t{warmup + steps}"] - marks[f"t{warmup}"]) * 1e3 / steps, 3),
            "peak_gib": round(max(setup_peak, _peak_gib(device)), 3),
            "setup_gib": None if setup_bytes is None else round(setup_bytes / 2**30, 3),
            "setup_bytes": setup_bytes, "images_bytes": images_bytes, "train_peak_bytes": train_peak,
            "train_reserved_bytes": train_reserved,
            "resident_per_gaussian": round(resident_bytes_per_gaussian(held, count), 2),
            "pairs_per_gaussian": None if pairs is None else round(pairs, 4),
            "images_per_s": round(len(scene.train) / max(decode_s or load_s, 1e-9), 1),
            "load_s": round(load_s, 2), "decode_s": None if decode_s is None else round(decode_s, 2),
            "views": len(scene.train), "width": view.width, "height": view.height,
            "num_gaussians": len(trainer.params["means"]), "device": str(device),
        }  # fmt: skip
        del trainer.train_step  # the timing hook's cycle: trainer -> hook -> bound method -> trainer
    return result


def release_memory() -> None:
    """What a measured trainer held goes now (child_record calls it once measure has returned):
    its CUDA graphs and their pool are freed here, not in the interpreter's teardown, and an
    in-process next point starts from an empty cache."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def child_record(spec: dict[str, Any]) -> dict[str, Any]:
    """The point's record: what measure() returns, or status oom (with the first line of the error)."""
    record = {k: spec.get(k) for k in FIELDS if k in spec}
    try:
        record.update(measure(spec), status="ok")
    except BaseException as exc:  # noqa: BLE001 - an OOM is a result here, anything else is not
        if not _is_oom(exc):
            raise
        record.update(status="oom", error=str(exc).splitlines()[0][:300])
        if torch.cuda.is_available():
            record["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    finally:
        release_memory()
    return record


# ---------------------------------------------------------------------------------------------
# the parent: points, the bisection, the files


def run_point(spec: dict[str, Any], in_process: bool = False, timeout: float = 1800) -> dict[str, Any]:
    """One point in a child process (or here, for tests and CPU dry runs: an OOM is then final)."""
    if in_process:
        return child_record(spec)
    with tempfile.TemporaryDirectory(prefix="big_curve_") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        env = dict(os.environ, TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "bench.big_curve", "--child", str(spec_file)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {**{k: spec.get(k) for k in FIELDS if k in spec}, "status": "error", "error": f"timeout {timeout}s"}
        out = spec_file.with_suffix(".out.json")
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        lines = proc.stderr.strip().splitlines()
        # a record written before a non-zero exit: the point was measured, the interpreter's
        # teardown (CUDA graphs and pools freed at exit, say) failed after it
        when = "after writing its record" if out.exists() else "before writing its record"
        return {**{k: spec.get(k) for k in FIELDS if k in spec}, "status": "error",
                "error": f"exit {proc.returncode} {when}: {' | '.join(lines[-3:])[-600:]}",
                "stderr": "\n".join(lines[-STDERR_LINES:])}  # fmt: skip


def largest_n(fits: Callable[[int], bool], lo: int, hi: int, tolerance: float) -> tuple[int | None, int | None]:
    """(the largest N seen to fit, the smallest seen not to), bisecting [lo, hi] geometrically until
    hi / lo <= 1 + tolerance. (None, lo) if lo does not fit; (hi, None) if hi does."""
    if not fits(lo):
        return None, lo
    if fits(hi):
        return hi, None
    while hi > lo * (1 + tolerance):
        mid = max(lo + 1, min(hi - 1, round(math.sqrt(lo * hi))))
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def load_records(out: Path) -> list[dict[str, Any]]:
    path = out / CURVE_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_csv(out: Path, records: list[dict[str, Any]]) -> None:
    with open(out / CSV_FILE, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)


class Curve:
    """The points of one call, each recorded once in OUT/curve.jsonl (an earlier call's are reused)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.records = load_records(self.out)
        self.done = {point_key(r): r for r in self.records}

    def spec(self, pipeline: str, factor: int, n: int, probe: bool) -> dict[str, Any]:
        a = self.args
        warmup, steps = (a.probe_warmup, a.probe_steps) if probe else (a.warmup, a.steps)
        sets = pipeline_sets(PIPELINES[pipeline], a.device) + pipeline_sets(a.extra.split(), a.device)
        return {"scene": str(a.scene), "pipeline": pipeline, "factor": factor, "n": n, "cap_gib": a.cap_gib,
                "init": a.init, "warmup": warmup, "steps": steps, "extra": a.extra, "probe": probe,
                "device": a.device, "sets": sets}  # fmt: skip

    def point(self, pipeline: str, factor: int, n: int, probe: bool = False) -> dict[str, Any]:
        spec = self.spec(pipeline, factor, n, probe)
        key = point_key(spec)
        if key in self.done:
            return self.done[key]
        rec = run_point(spec, self.args.in_process, self.args.timeout)
        print(f"{pipeline} x{factor} N={n}{' (probe)' if probe else ''}: {rec['status']}, "
              f"{rec.get('ms_per_step')} ms/step, peak {rec.get('peak_gib')} GiB, {rec.get('images_per_s')} images/s"
              + (f" ({rec['error']})" if rec.get("error") else ""), flush=True)  # fmt: skip
        with open(self.out / CURVE_FILE, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        self.records.append(rec)
        self.done[key] = rec
        return rec

    def fits(self, pipeline: str, factor: int) -> Callable[[int], bool]:
        def probe(n: int) -> bool:
            rec = self.point(pipeline, factor, n, probe=True)
            if rec["status"] == "error":
                raise SystemExit(f"big_curve: {pipeline} x{factor} N={n} failed (not an OOM): {rec.get('error')}")
            return rec["status"] == "ok"

        return probe


def parse_count(text: str) -> int:
    """'2e6', '2000000', '2M' or '500k' -> int."""
    t = text.strip().lower()
    scale = {"k": 1e3, "m": 1e6}.get(t[-1:], 1)
    return int(float(t[:-1] if scale != 1 else t) * scale)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path, nargs="?")
    ap.add_argument("--n", default="1e6,2e6,4e6,8e6", help="Gaussian counts, comma-separated (2e6, 500k, 4M)")
    ap.add_argument("--factors", default="1", help="image sizes as data.factor values, comma-separated")
    ap.add_argument("--pipelines", default="gstrain,baseline", help=", ".join(PIPELINES))
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=200, help="timed steps after the warm-up")
    ap.add_argument("--cap-gib", type=float, default=None, help="cap the allocator at this many GiB")
    ap.add_argument("--largest", default=None, metavar="LO:HI", help="bisect the largest N that trains in [LO, HI]")
    ap.add_argument("--tolerance", type=float, default=0.1, help="bisection stops at HI/LO <= 1 + this")
    # 100: a probe passes step 98, the first eager timed step (log.time_every 197), which allocates
    # beside the CUDA graphs' pools: a probe that ended before it would miss that part of the peak
    ap.add_argument("--probe-warmup", type=int, default=100)
    ap.add_argument("--probe-steps", type=int, default=10)
    ap.add_argument("--init", default="model", choices=INITS)
    ap.add_argument("--extra", default="", help="more fit flags for every point (--set k=v ...)")
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: the script's own tests)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs")) / "big_curve")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per point")
    ap.add_argument("--in-process", action="store_true", help="run the points here (no OOM isolation)")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR", help="only draw DIR/curve.png")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        configure_allocator()  # as `gstrain fit` does, before the child's first CUDA allocation
        record = child_record(json.loads(args.child.read_text()))
        args.child.with_suffix(".out.json").write_text(json.dumps(record))
        return
    if args.plot is not None:
        try_plot(args.plot / PLOT_FILE, load_records(args.plot))
        return
    if args.scene is None:
        ap.error("a scene written by bench.big_scene is needed (or --plot DIR)")
    unknown = [p for p in args.pipelines.split(",") if p not in PIPELINES]
    if unknown:
        ap.error(f"unknown pipeline(s) {unknown}; choose from {', '.join(PIPELINES)}")
    if args.warmup < 1 or args.steps < 1 or args.probe_warmup < 1 or args.probe_steps < 1:
        ap.error("--warmup, --steps, --probe-warmup and --probe-steps must be >= 1")
    curve = Curve(args)
    factors = [int(f) for f in args.factors.split(",")]
    for factor in factors:
        for n in (parse_count(x) for x in args.n.split(",") if x.strip()):
            for pipeline in args.pipelines.split(","):
                curve.point(pipeline, factor, n)
    if args.largest:
        lo, hi = (parse_count(x) for x in args.largest.split(":"))
        found = json.loads((args.out / LARGEST_FILE).read_text()) if (args.out / LARGEST_FILE).exists() else []
        for factor in factors:
            for pipeline in args.pipelines.split(","):
                fit_n, fail_n = largest_n(curve.fits(pipeline, factor), lo, hi, args.tolerance)
                row = {"pipeline": pipeline, "factor": factor, "cap_gib": args.cap_gib, "init": args.init,
                       "extra": args.extra, "largest_fit": fit_n, "smallest_oom": fail_n,
                       "range": [lo, hi]}  # fmt: skip
                print(f"largest N: {row}", flush=True)
                found.append(row)
        (args.out / LARGEST_FILE).write_text(json.dumps(found, indent=1))
    write_csv(args.out, curve.records)
    try_plot(args.out / PLOT_FILE, curve.records)


if __name__ == "__main__":
    main()
