"""Run a function on W local processes joined by a gloo process group (tests, CPU studies).

Each worker gets (rank, world, *args); its return value comes back through a file. A worker that
raises fails the whole run with its traceback; the others are stopped, never left hanging:
collectives time out after `timeout` seconds and the parent waits at most that long plus start-up.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_local"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, folder: str, timeout: float, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )  # fmt: skip
        result = fn(rank, world, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
    except BaseException:
        (Path(folder) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is on disk: leave without the interpreter's teardown, as cli.main does for a
    # torchrun rank. gloo's worker threads may still be finishing a collective and need the GIL that
    # teardown takes away (seen: std::terminate in a thread's forced unwind at exit, after the work
    # was done, in 3 of 11 runs of a two-rank test on one machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """fn(rank, world, *args) on `world` spawned processes; returns their results by rank.
    fn must be importable (defined at module level). Raises RuntimeError if any worker fails."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gstrain-dist-") as folder:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, folder, timeout, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout + 60.0  # start-up (imports) comes on top of the collectives
        failed: int | None = None
        while any(p.is_alive() for p in procs) and failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
            failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        errs = sorted(Path(folder).glob("rank*.err"), key=lambda e: e.stat().st_mtime_ns)
        bad = [(int(e.stem[4:]), e.read_text()) for e in errs]
        if not bad:
            bad = [(r, f"exit code {p.exitcode} (timed out?)\n") for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            # the first to fail is the cause; the others usually lost their peer
            text = "".join(f"--- rank {r}:\n{t}" for r, t in bad)
            raise RuntimeError(f"rank {bad[0][0]} of {world} failed first:\n{text}")
        # any object fn returns (tests hand back dataclasses), so not the weights-only reader: these
        # files were written moments ago by this call's own workers, in its private (0700) temp folder
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False) for r in range(world)]
