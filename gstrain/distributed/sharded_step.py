"""The sharded step engine (train/engine.py): one step of the global batch on one rank.

Every rank draws the same batch of train.batch_size views (one sampler, the same seed); each view
renders on its home rank (ShardInfo.homes) from the records every owner sends it
(sharded_render.py); each renderer divides its views' losses by B, so the summed gradient is that
of the mean loss; each owner steps Adam on its rows and densifies with the statistics its
Gaussians received. Only for more than one rank: one rank owns everything, and runs the plain
engines.
"""

from __future__ import annotations

import torch

from gstrain.distributed.exchange import CommCounter
from gstrain.distributed.sharded_render import ViewBatch, render_sharded
from gstrain.train.context import StepContext
from gstrain.train.engine import UncapturedEngine
from gstrain.train.step import StepResult


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, but one tensor becomes a view (no copy launched for a batch of one)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


class ShardedEngine(UncapturedEngine):
    name = "sharded"

    def __init__(self, ctx: StepContext) -> None:
        if ctx.shard is None:
            raise ValueError("the sharded engine needs the context's ShardInfo")
        self.ctx = ctx
        self.comm = CommCounter()  # this rank's exchange bytes, reported with each step

    def step(self, step: int) -> StepResult:
        """Returns this rank's share of the loss and terms, its first rendered view and target
        (None and None when it rendered none), the records its Gaussians sent and its bytes."""
        ctx, b, world = self.ctx, self.ctx.batch_size, self.ctx.shard.world
        runner, views = ctx.runner, ctx.views
        with ctx.timer.phase("data"):
            idx = views.draw(ctx.sampler, b)
            cams = [views.cams[i] for i in idx]
            shapes = views.shapes()
            sizes = [tuple(shapes[i][:2]) for i in idx]
            batch = ViewBatch(_stacked([c[0] for c in cams]), _stacked([c[1] for c in cams]),
                              [w for _, w in sizes], [h for h, _ in sizes], ctx.shard.homes(idx))  # fmt: skip
        with ctx.timer.phase("forward"):
            # render.filter_3d: each owner filters its own Gaussians (rates over every training view)
            out = render_sharded(ctx.renderer.filtered(ctx.params), batch, ctx.sh_degree(step), ctx.background,
                                 ctx.cfg.dist.compress, counter=self.comm, backend=ctx.renderer.backend,
                                 options=ctx.renderer.options)  # fmt: skip
        ctx.strategy.step_pre_backward(ctx.params, ctx.optimizers, step, out.owner_info)
        # one rank exchanged nothing (no zero term to tie in); one view has no mean to take
        loss, terms, gts = (out.zero_term if world > 1 else None), {}, []
        with ctx.timer.phase("loss"):
            for j, i in enumerate(out.views):
                view = views.step_view(idx[i])
                gts.append(view.gt)
                part, parts = runner.view_loss(out.images[j], view, ctx.background)
                share = part / b if b > 1 else part
                loss = share if loss is None else loss + share
                for k, t in parts.items():
                    t = t.detach() / b if b > 1 else t.detach()
                    terms[k] = terms[k] + t if k in terms else t
        loss = out.zero_term if loss is None else loss
        reg = ctx.strategy.loss_term(ctx.params)  # on this rank's own Gaussians (MCMC's regularisers)
        if reg is not None:
            loss = loss + reg
        changed = runner.finish(ctx.params, ctx.optimizers, step, loss, lambda: out.owner_info, ctx.scheduler)
        sent, received = self.comm.total()  # both exchanges of the step, counts known on the host
        self.comm.reset()
        image = out.images[0].detach() if out.views else None
        return StepResult(loss.detach(), terms, image, changed, out.pairs, target=gts[0] if gts else None,
                          comm=(sent, received), records=out.owner_records)  # fmt: skip
