"""dev.adam_in_backward on the CPU: shN stepped inside the backward trains exactly as the plain
optimizer step (the switch off is the reference), in every moments layout, through densification
and a resume; and it really ran there (counted).

The GPU's sliced path (fused SH colours, FusedAdam's kernel on row slices) is
tests/test_backward_adam_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from moments_util import moments_trainer

from gstrain.data.colmap import load_scene
from gstrain.train import backward_adam


@pytest.fixture(scope="module")
def scene(demo_scene):
    return load_scene(demo_scene, factor=2, test_every=8)


def _same_state(a, b) -> None:
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
        sa, sb = a.optimizers[k].state[a.params[k]], b.optimizers[k].state[b.params[k]]
        assert sa.keys() == sb.keys(), k
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (k, key)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_stepping_shn_in_the_backward_trains_as_the_plain_step(scene, tmp_path, moments, monkeypatch):
    calls = []
    whole = backward_adam.ShnInBackward.whole
    monkeypatch.setattr(backward_adam.ShnInBackward, "whole",
                        lambda self, grad: (calls.append(grad.shape[0]), whole(self, grad))[1])
    strategy = {"grow_grad2d": 1e-6}  # grows and prunes: the state is rewritten between steps
    # SH degree 1 from step 4: before it no SH path reads shN (the reference renderer's) and
    # shN has no gradient either way
    plain = moments_trainer(scene, tmp_path / "plain", moments, steps=20, strategy=strategy,
                            dev={"adam_in_backward": False}, sh_degree_interval=4)
    assert plain.fit().status == "done"
    assert not calls
    inside = moments_trainer(scene, tmp_path / "inside", moments, steps=20, strategy=strategy, sh_degree_interval=4)
    assert inside.fit().status == "done"
    assert len(calls) == 16  # once a step from step 4, with the whole gradient
    assert len(set(calls)) > 1  # the number of Gaussians changed on the way
    _same_state(plain, inside)


def test_resume_with_shn_stepped_in_the_backward_is_exact(scene, tmp_path):
    whole = moments_trainer(scene, tmp_path / "whole", "int8", steps=16, sh_degree_interval=4)
    assert whole.fit().status == "done"
    paused = moments_trainer(scene, tmp_path / "paused", "int8", steps=16, stop_at=8,
                             dev={"adam_in_backward": False}, sh_degree_interval=4)
    assert paused.fit().status == "stopped"
    paused.save(wait=True)
    resumed = moments_trainer(scene, tmp_path / "paused", "int8", steps=16, sh_degree_interval=4)
    assert resumed.fit(resume=True).status == "done"
    _same_state(whole, resumed)


def test_batch_steps_keep_the_plain_step(scene, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(backward_adam.ShnInBackward, "whole", lambda self, grad: calls.append(1))
    trainer = moments_trainer(scene, tmp_path / "batch", "fp32", steps=4, batch_size=2, sh_degree_interval=1)
    assert trainer.fit().status == "done"
    assert not calls  # two SH backwards a step would step shN twice: not armed
