"""render.filter_3d and render.antialiased on the sharded step: two gloo ranks train as one process
with the same global batch (each owner filters its own Gaussians with rates over every training view)."""

from __future__ import annotations

from test_dist_trainer import CKPT, _assert_equal_rows, _dist_fit, _plain

from gstrain.distributed.local import run_local

FILTERED = {**CKPT, "render": {"filter_3d": 0.2, "antialiased": True}}


def _run(rank: int, world: int, scene: str, root: str) -> dict:
    return _dist_fit(rank, world, scene, f"{root}/filtered", FILTERED)


def test_two_ranks_with_the_3d_filter_equal_one_process(demo_scene, tmp_path):
    (tmp_path / "filtered").mkdir()
    runs = run_local(_run, 2, str(demo_scene), str(tmp_path), timeout=120)
    filtered = _plain(demo_scene, tmp_path / "plain_filtered", FILTERED)
    _assert_equal_rows(runs, filtered)
    unfiltered = _plain(demo_scene, tmp_path / "plain", CKPT)
    # the filter changed the training: the equality above is not the unfiltered run's
    assert any(float((filtered[k] - unfiltered[k]).abs().max()) > 1e-3 for k in ("scales", "opacities"))
