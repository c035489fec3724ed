"""Uneven row exchange between ranks, differentiable: one all_to_all_single each way.

Rows of `payload` are grouped by destination rank (send_splits[r] rows for rank r); the result
holds the rows received, grouped by source rank. The backward sends the gradients of the
received rows back through the reverse exchange. Non-differentiable columns (`meta`, any dtype)
can ride in the same collective: payload and meta are packed as bytes into one message.
compress='fp16' sends part of the payload as float16 and its gradient as bfloat16, for the wire
only (layout.wire_segments says which columns).

A CommCounter records the exact bytes of every collective, from the split sizes alone: the
uneven split already needs them on the host, so counting costs no further sync.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gstrain.distributed.layout import COUNT_DTYPE, grad_wire_dtype, wire_segments

__all__ = ["CommCounter", "CommRecord", "exchange", "exchange_counts", "exchange_objects", "rank_and_world"]


@dataclass
class CommRecord:
    """One collective as seen by this rank. sent/received: bytes to/from OTHER ranks (the wire);
    local: bytes this rank sent to itself (a copy, not communication)."""

    op: str
    sent: int
    received: int
    local: int


@dataclass
class CommCounter:
    records: list[CommRecord] = field(default_factory=list)

    def add(self, op: str, send_rows: list[int], recv_rows: list[int], row_bytes: int, rank: int) -> None:
        sent = sum(n for r, n in enumerate(send_rows) if r != rank) * row_bytes
        received = sum(n for r, n in enumerate(recv_rows) if r != rank) * row_bytes
        local = send_rows[rank] * row_bytes if send_rows else 0
        self.records.append(CommRecord(op, sent, received, local))

    def total(self, op: str | None = None) -> tuple[int, int]:
        """(bytes sent, bytes received) over the recorded collectives, or those named op."""
        recs = [r for r in self.records if op is None or r.op == op]
        return sum(r.sent for r in recs), sum(r.received for r in recs)

    def reset(self) -> None:
        self.records.clear()


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size); (0, 1) when no process group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> Tensor:
    if rank_and_world(group)[1] == 1:
        return x.clone()
    staged = x.is_cuda and dist.get_backend(group) == "gloo"  # gloo's all_to_all is host-only
    src = x.cpu() if staged else x.contiguous()
    out = src.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, src.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.to(x.device) if staged else out


def exchange_counts(
    counts: Tensor,
    send_groups: list[int],
    recv_groups: list[int],
    counter: CommCounter | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Send counts[...] grouped by destination (send_groups[r] entries for rank r); returns the
    entries received, grouped by source (recv_groups[s] from rank s). Both sides must agree on the
    group sizes (e.g. from the batch's view homes, known to every rank)."""
    rank, world = rank_and_world(group)
    counts = counts.to(COUNT_DTYPE)
    if counter is not None:
        counter.add("counts", send_groups, recv_groups, counts.element_size(), rank)
    return _all_to_all_rows(counts, send_groups, recv_groups, group)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, payload, meta, send, recv, compress, counter, group):  # type: ignore[override]
        rank, _ = rank_and_world(group)
        segments = [(n, dt) for n, dt in wire_segments(payload.dtype, compress, payload.shape[1]) if n > 0]
        parts, col = [], 0
        for n, dt in segments:
            parts.append(payload[:, col : col + n].detach().to(dt).contiguous().view(torch.uint8))
            col += n
        n_pay = sum(p.shape[1] for p in parts)
        if meta is not None:
            parts.append(meta.detach().contiguous().view(torch.uint8))
        msg = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        if counter is not None:
            counter.add("records_fwd", send, recv, msg.shape[1], rank)
        got = _all_to_all_rows(msg, send, recv, group)
        cols, byte = [], 0
        for n, dt in segments:
            width = n * dt.itemsize
            cols.append(got[:, byte : byte + width].contiguous().view(dt).to(payload.dtype))
            byte += width
        out = torch.cat(cols, 1) if len(cols) > 1 else cols[0]
        out_meta = got[:, n_pay:].contiguous().view(meta.dtype) if meta is not None else None
        ctx.send, ctx.recv, ctx.group, ctx.counter = send, recv, group, counter
        ctx.wire_dtype, ctx.dtype = grad_wire_dtype(payload.dtype, compress), payload.dtype
        if out_meta is not None:
            ctx.mark_non_differentiable(out_meta)
        return out, out_meta

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out, _g_meta):  # type: ignore[override]
        rank, _ = rank_and_world(ctx.group)
        wire = g_out.to(ctx.wire_dtype).contiguous()
        if ctx.counter is not None:
            ctx.counter.add("records_bwd", ctx.recv, ctx.send, wire.shape[1] * wire.element_size(), rank)
        g_in = _all_to_all_rows(wire, ctx.recv, ctx.send, ctx.group).to(ctx.dtype)
        return g_in, None, None, None, None, None, None


def exchange(
    payload: Tensor,
    send_splits: list[int],
    recv_splits: list[int] | None = None,
    meta: Tensor | None = None,
    compress: str = "none",
    counter: CommCounter | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor | None, list[int]]:
    """Send payload rows [n, k] (float, differentiable) to their ranks; returns (received payload,
    received meta or None, recv_splits). meta [n, m] rides along, not differentiable. When
    recv_splits is None, the split sizes are exchanged first (one count per rank pair).
    Every rank must call this, and (if the payload needs grad) later run the backward through it.
    """
    rank, world = rank_and_world(group)
    if payload.dim() != 2 or not payload.is_floating_point():
        raise ValueError(f"payload must be a float [n, k] tensor, got {payload.dtype} {list(payload.shape)}")
    if len(send_splits) != world or sum(send_splits) != payload.shape[0]:
        raise ValueError(f"send_splits {send_splits} must have {world} entries summing to {payload.shape[0]}")
    if meta is not None and (meta.dim() != 2 or meta.shape[0] != payload.shape[0]):
        raise ValueError(f"meta must be [{payload.shape[0]}, m], got {list(meta.shape)}")
    if recv_splits is None:
        ones = [1] * world
        sizes = torch.tensor(send_splits, device=payload.device)
        recv_splits = exchange_counts(sizes, ones, ones, counter, group).tolist()
    grad_wire_dtype(payload.dtype, compress)  # validates compress
    if world == 1 and compress == "none":
        # nothing leaves the process: no copy, so W=1 is the plain single-process graph
        if counter is not None:
            counter.add("records_fwd", send_splits, recv_splits, 0, rank)
        return payload, meta, list(recv_splits)
    out, out_meta = _Exchange.apply(payload, meta, list(send_splits), list(recv_splits), compress, counter, group)
    return out, out_meta, list(recv_splits)


def exchange_objects(objs: list[Any], device: torch.device, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Send objs[r] to rank r (torch.save'd bytes, one uneven all_to_all_single on `device`);
    returns what every rank sent this one, by source rank. Collective. objs hold plain data
    (tensors, numbers, strings, lists, dicts): they are read back with the weights-only reader."""
    blobs = []
    for obj in objs:
        buf = io.BytesIO()
        torch.save(obj, buf)
        blobs.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    world = len(objs)
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=device)
    got = exchange_counts(sizes, [1] * world, [1] * world, group=group).tolist()
    payload = torch.cat(blobs).to(device)
    received = _all_to_all_rows(payload, [len(b) for b in blobs], got, group).cpu()
    out, at = [], 0
    for n in got:
        out.append(torch.load(io.BytesIO(received[at : at + n].numpy().tobytes()), weights_only=True))
        at += n
    return out
