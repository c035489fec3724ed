"""Process-group set-up under torchrun, and collective failures as one-line user errors.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and MASTER_ADDR/PORT) for every worker. With no
torchrun, or WORLD_SIZE=1, `gstrain fit` runs the plain single-process trainer, untouched.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from gstrain.errors import UserError

__all__ = ["collective_errors", "finish_process_group", "init_from_env", "on_rank_zero", "torchrun_world"]


def torchrun_world() -> int:
    """WORLD_SIZE as torchrun set it; 1 without torchrun."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UserError(f"WORLD_SIZE must be an integer; got {os.environ['WORLD_SIZE']!r}") from None


def init_from_env(device: torch.device, timeout_s: float) -> tuple[int, int, torch.device]:
    """Join torchrun's process group: NCCL on CUDA (one GPU per LOCAL_RANK), gloo on the CPU.
    Returns (rank, world, this rank's device)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s): "
                            "start at most one process per GPU (--nproc-per-node)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return rank, world, device


@contextlib.contextmanager
def collective_errors(rank: int, timeout_s: float) -> Iterator[None]:
    """A collective that fails (a peer died, or waited past dist.timeout_s) becomes one line."""
    try:
        yield
    except (dist.DistError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or ["no message"])[0][:200]
        raise UserError(f"rank {rank}: distributed training stopped: another rank died or a collective "
                        f"waited past dist.timeout_s={timeout_s:g}s ({type(exc).__name__}: {first})") from None


def on_rank_zero(fn: Callable[[], None]) -> None:
    """fn() on rank 0 only (e.g. creating the run folder); its UserError is raised on every rank.
    Without a process group, just fn()."""
    if not dist.is_initialized():
        fn()
        return
    message: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except UserError as exc:
            message[0] = str(exc)
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise UserError(message[0])


def finish_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
