"""JPEG decodes per second on threads beside a training thread that runs Python, against the same
threads beside an idle one: how much a host-bound step starves data.images_on=disk's decoders of
the GIL (bench/NOTES.md, "Why disk on beer is still data-bound").

    python -m bench.decode_contention SCENE_DIR [--threads 1,2] [--seconds 3] [--switch-ms 0.5]

SCENE_DIR/images holds the photos. The busy thread runs a plain Python loop, the worst case of a
training loop's host time; --switch-ms also measures with sys.setswitchinterval at that value.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from gstrain.data.images import decode


def _python_loop(seconds: float) -> float:
    """Iterations a second of a pure-Python loop (the busy training thread)."""
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(1000):
            pass
        n += 1
    return n / seconds


def measure(files: list[Path], threads: int, busy: bool, seconds: float) -> tuple[float, float]:
    """(decodes a second on `threads` threads, the busy loop's rate or 0 when idle)."""
    stop = threading.Event()
    count = [0]

    def work(offset: int) -> None:
        i = offset
        while not stop.is_set():
            decode(files[i % len(files)])
            count[0] += 1
            i += threads

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    time.sleep(0.3)  # past the first files' cold reads
    before, start = count[0], time.perf_counter()
    rate = _python_loop(seconds) if busy else (time.sleep(seconds) or 0.0)
    done = count[0] - before
    elapsed = time.perf_counter() - start
    stop.set()
    for t in pool:
        t.join()
    return done / elapsed, rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--switch-ms", type=float, default=0.5)
    args = ap.parse_args(argv)
    files = sorted(p for p in (args.scene / "images").iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if not files:
        print(f"no images in {args.scene / 'images'}", file=sys.stderr)
        return 2
    alone = _python_loop(args.seconds)
    default_switch = sys.getswitchinterval()
    for switch in (default_switch, args.switch_ms / 1000.0):
        sys.setswitchinterval(switch)
        for threads in (int(t) for t in args.threads.split(",")):
            idle, _ = measure(files, threads, False, args.seconds)
            busy, rate = measure(files, threads, True, args.seconds)
            print(f"switch interval {switch * 1e3:.1f} ms, {threads} decode threads: {idle:.0f} photos/s beside an "
                  f"idle thread, {busy:.0f} beside a busy one (its Python at {rate / alone:.2f}x)")
    sys.setswitchinterval(default_switch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
