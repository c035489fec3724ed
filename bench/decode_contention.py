"""JPEG decodes per second on threads beside a training thread that runs Python, against the same
threads beside an idle one: how much a host-bound step starves data.images_on=disk's decoders of
the GIL (bench/NOTES.md, "Why disk on beer is still data-bound").

    python -m bench.decode_contention SCENE_DIR [--threads 1,2] [--seconds 3] [--switch-ms 0.5] [--processes 1,2]

SCENE_DIR/images holds the photos. The busy thread runs a plain Python loop, the worst case of a
training loop's host time; --switch-ms also measures with sys.setswitchinterval at that value;
--processes measures decoding in worker processes that write into shared memory, a collecting
thread copying each photo out with one torch copy (the design that leaves the GIL to the loop).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from gstrain.data.images import decode

_SHARED: dict = {}  # in a worker process: the shared block it writes into


def _attach(name: str) -> None:
    from multiprocessing import shared_memory

    _SHARED["block"] = shared_memory.SharedMemory(name=name)


def _decode_into(file: str, offset: int) -> tuple[int, ...]:
    """In a worker process: decode `file` into the shared block at `offset`; its shape."""
    pixels = np.asarray(decode(Path(file))[0])
    _SHARED["block"].buf[offset : offset + pixels.nbytes] = pixels.tobytes()
    return pixels.shape


def measure_processes(files: list[Path], processes: int, busy: bool, seconds: float) -> tuple[float, float]:
    """(photos a second decoded by `processes` worker processes and copied out by a collecting
    thread, the busy loop's rate or 0 when idle)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import shared_memory

    first = np.asarray(decode(files[0])[0])
    slots = 2 * processes
    block = shared_memory.SharedMemory(create=True, size=slots * first.nbytes * 2)
    stop = threading.Event()
    count = [0]
    try:
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"), initializer=_attach,
                                 initargs=(block.name,)) as pool:  # fmt: skip
            pool.submit(_decode_into, str(files[0]), 0).result()  # workers started and warm

            def collect() -> None:
                flight, i = {}, 0
                while not stop.is_set():
                    while len(flight) < slots:
                        slot = next(k for k in range(slots) if k not in flight)
                        flight[slot] = pool.submit(_decode_into, str(files[i % len(files)]), slot * first.nbytes * 2)
                        i += 1
                    done = next((k for k, f in flight.items() if f.done()), None)
                    if done is None:
                        time.sleep(0.0002)
                        continue
                    shape = flight.pop(done).result()
                    n = int(np.prod(shape))
                    torch.frombuffer(block.buf, dtype=torch.uint8, count=n, offset=done * first.nbytes * 2).clone()
                    count[0] += 1
                for f in flight.values():
                    f.result()

            collector = threading.Thread(target=collect)
            collector.start()
            time.sleep(0.3)
            before, start = count[0], time.perf_counter()
            rate = _python_loop(seconds) if busy else (time.sleep(seconds) or 0.0)
            done_count = count[0] - before
            elapsed = time.perf_counter() - start
            stop.set()
            collector.join()
    finally:
        block.close()
        block.unlink()
    return done_count / elapsed, rate


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
    ap.add_argument("--processes", default="", help="worker process counts, comma-separated (none: skipped)")
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
    for processes in (int(p) for p in args.processes.split(",") if p):
        idle, _ = measure_processes(files, processes, False, args.seconds)
        busy, rate = measure_processes(files, processes, True, args.seconds)
        print(f"switch interval {default_switch * 1e3:.1f} ms, {processes} decode processes: {idle:.0f} photos/s "
              f"beside an idle thread, {busy:.0f} beside a busy one (its Python at {rate / alone:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
