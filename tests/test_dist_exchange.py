"""The record exchange over real gloo processes: forward and backward equal a plain gather."""

from __future__ import annotations

import pytest
import torch

from gstrain.distributed.exchange import CommCounter, exchange
from gstrain.distributed.local import run_local

N, K = 57, 9


def _data(dtype: torch.dtype, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(N, K, generator=g, dtype=torch.float64).to(dtype)
    owner = torch.randint(0, world, (N,), generator=g)
    dest = torch.randint(0, world, (N,), generator=g)
    dest[owner == 0] = world - 1  # rank 0 keeps none of its rows: an empty self-split
    return x, grad, owner, dest


CASES = [(torch.float32, "none"), (torch.float64, "none"), (torch.float32, "fp16")]


def _worker(rank: int, world: int) -> list[dict]:
    return [_one(rank, world, dtype, compress) for dtype, compress in CASES]


def _one(rank: int, world: int, dtype: torch.dtype, compress: str) -> dict:
    x, grad, owner, dest = _data(dtype, world)
    mine = torch.nonzero(owner == rank).squeeze(1)
    mine = mine[torch.argsort(dest[mine], stable=True)]  # rows grouped by destination
    payload = x[mine].clone().requires_grad_(True)
    meta = mine[:, None].to(torch.int64)  # global ids ride along as meta
    send = torch.bincount(dest[mine], minlength=world).tolist()
    counter = CommCounter()
    out, out_meta, recv = exchange(payload, send, meta=meta, compress=compress, counter=counter)
    ids = out_meta[:, 0]
    (out * grad[ids]).sum().backward()
    return {"out": out.detach(), "ids": ids, "recv": recv, "sent_ids": mine, "grad": payload.grad,
            "counter": counter.records}


def test_exchange_equals_gather() -> None:
    world = 3
    runs = run_local(_worker, world, timeout=30)  # one spawn for all cases: start-up dominates
    for case, (dtype, compress) in enumerate(CASES):
        _check(world, dtype, compress, [run[case] for run in runs])


def _check(world: int, dtype: torch.dtype, compress: str, results: list[dict]) -> None:
    x, grad, owner, dest = _data(dtype, world)
    # fp16: the first 5 columns (means2d, conics) exact, the other 4 as float16; gradients bfloat16
    wire = (lambda t: torch.cat([t[:, :5], t[:, 5:].half().to(dtype)], 1)) if compress == "fp16" else (lambda t: t)
    grad_wire = (lambda t: t.bfloat16().to(dtype)) if compress == "fp16" else (lambda t: t)
    for r, res in enumerate(results):
        # rows arrive grouped by source rank, each source's rows in the order it sent them
        expect_ids = torch.cat([res_s["sent_ids"][dest[res_s["sent_ids"]] == r] for res_s in results])
        assert torch.equal(res["ids"], expect_ids)
        assert torch.equal(res["out"], wire(x[expect_ids]))
        assert res["recv"] == [int(((owner == s) & (dest == r)).sum()) for s in range(world)]
        # backward: each sent row gets exactly the gradient its receiver applied to it
        assert torch.equal(res["grad"], grad_wire(grad[res["sent_ids"]]))
        # bytes on the wire: rows that leave for another rank
        fwd = [c for c in res["counter"] if c.op == "records_fwd"]
        bwd = [c for c in res["counter"] if c.op == "records_bwd"]
        fwd_bytes = 5 * x.element_size() + 4 * 2 if compress == "fp16" else K * x.element_size()
        bwd_bytes = K * (2 if compress == "fp16" else x.element_size())
        n_out = int(((owner == r) & (dest != r)).sum())
        n_in = int(((owner != r) & (dest == r)).sum())
        assert (fwd[0].sent, fwd[0].received) == (n_out * (fwd_bytes + 8), n_in * (fwd_bytes + 8))
        assert (bwd[0].sent, bwd[0].received) == (n_in * bwd_bytes, n_out * bwd_bytes)


def _failing(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one breaks")
    torch.distributed.barrier()  # would wait forever for rank 1


def test_worker_exception_fails_not_hangs() -> None:
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed first.*rank one breaks"):
        run_local(_failing, 2, timeout=20)


def test_single_process_is_identity() -> None:
    x = torch.randn(5, K, requires_grad=True)
    out, meta, recv = exchange(x, [5])
    assert out is x and meta is None and recv == [5]
    half, _, _ = exchange(x, [5], compress="fp16")
    assert torch.equal(half[:, :5], x.detach()[:, :5])
    assert torch.equal(half[:, 5:], x.detach()[:, 5:].half().float())
    with pytest.raises(ValueError, match="compress"):
        exchange(x, [5], compress="int8")


SIZES = [5, 0, 9]  # rows each rank holds before the migration (one holds none)


def _state(rows: torch.Tensor) -> dict:
    """A trainer-shaped state whose row-aligned tensors hold their global row id, and scalars."""
    ids = rows.double()
    return {"step": 7, "params": {"means": ids[:, None].repeat(1, 3), "opacities": ids},
            "optimizers": {"means": {"param_groups": [{"lr": 1.0}],
                                     "state": {0: {"step": torch.tensor(3.0), "exp_avg": -ids[:, None].repeat(1, 3)}}}},
            "strategy": {"grad2d": ids * 10, "count": None}}  # fmt: skip


def _migrate(rank: int, world: int) -> dict:
    from gstrain.distributed.migrate import move_rows

    order = torch.randperm(sum(SIZES), generator=torch.Generator().manual_seed(1))  # every rank: same plan
    rows = [6, 2, 6]
    offset = sum(SIZES[:rank])
    state = _state(torch.arange(offset, offset + SIZES[rank]))
    return move_rows(state, order, rows, SIZES, rank, torch.device("cpu"))


def test_migration_moves_rows_with_their_state() -> None:
    """Each rank ends with the rows the plan gives it, in the plan's order, each row carrying
    its own Adam moments and statistics; the scalars stay."""
    order = torch.randperm(sum(SIZES), generator=torch.Generator().manual_seed(1))
    results = run_local(_migrate, 3, timeout=60)
    start = 0
    for rank, (state, n) in enumerate(zip(results, [6, 2, 6], strict=True)):
        want = order[start : start + n].double()
        start += n
        assert torch.equal(state["params"]["opacities"], want), rank
        assert torch.equal(state["params"]["means"], want[:, None].repeat(1, 3))
        assert torch.equal(state["optimizers"]["means"]["state"][0]["exp_avg"], -want[:, None].repeat(1, 3))
        assert torch.equal(state["strategy"]["grad2d"], want * 10)
        assert state["step"] == 7 and float(state["optimizers"]["means"]["state"][0]["step"]) == 3.0
