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


def torchrun_world(always: bool = False) -> int:
    """The number of ranks when `gstrain fit` takes the distributed path, else 0: WORLD_SIZE as
    torchrun set it when above 1, or 1 with `always` (dev.always_distributed) under a one-process torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0
    try:
        world = int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise UserError(f"WORLD_SIZE must be an integer; got {os.environ['WORLD_SIZE']!r}") from None
    return world if world > 1 or always else 0


def init_from_env(device: torch.device, timeout_s: float, backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join torchrun's process group: NCCL on CUDA (one GPU per LOCAL_RANK), gloo on the CPU;
    backend=gloo on CUDA puts ranks on the GPUs round robin (several may share one).
    Returns (rank, world, this rank's device)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl" and device.type != "cuda":
        raise UserError("dist.backend=nccl needs CUDA GPUs; use gloo (or auto) on the CPU")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        if local >= gpus and backend == "nccl":
            raise UserError(f"LOCAL_RANK {local} but only {gpus} GPU(s): start at most one process per GPU "
                            "(--nproc-per-node), or share GPUs with --set dist.backend=gloo")
        device = torch.device("cuda", local % gpus)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    except (dist.DistError, RuntimeError, ValueError) as exc:  # the rendezvous: peers, store, address
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UserError(f"rank {rank}: cannot set up the {backend} process group of {world} ranks at {where} "
                        f"within dist.timeout_s={timeout_s:g}s ({type(exc).__name__}: {_first_line(exc)})") from None
    return rank, world, device


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["no message"])[0][:200]


@contextlib.contextmanager
def collective_errors(rank: int, timeout_s: float) -> Iterator[None]:
    """A collective that fails (a peer died, or waited past dist.timeout_s) becomes one line."""
    try:
        yield
    except (dist.DistError, RuntimeError) as exc:
        raise UserError(f"rank {rank}: distributed training stopped: another rank died or a collective "
                        f"waited past dist.timeout_s={timeout_s:g}s ({type(exc).__name__}: {_first_line(exc)})"
                        ) from None


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
