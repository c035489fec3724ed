"""The run record's tile-pair counts: summed per step (render.common.sum_pairs), averaged per view."""

from __future__ import annotations

import json

import torch

from gstrain.render.common import sum_pairs
from gstrain.train.run_record import FitResult, RunRecord, write_run_record


def test_pairs_sum_over_reporting_renders_and_average_per_view(tmp_path) -> None:
    assert sum_pairs([None, None]) is None  # the reference renderer reports none
    assert sum_pairs([(300, 120), None, (100, 40)]) == (400, 160, 2)
    record = RunRecord()
    record.add_pairs(sum_pairs([(300, 120), (100, 40)]))  # a step of two views
    record.add_pairs(None)
    record.add_pairs(sum_pairs([(200, 200)]))  # a step of one view
    result = FitResult("done", 3, 1.0, 10, None, None, None)
    summary = write_run_record(tmp_path, record, result, None, None, "cuda", "arc", 8, torch.device("cpu"))
    # by hand: (300 + 100 + 200) / 3 views = 200 before; (120 + 40 + 200) / 3 = 120 after
    assert summary["isect_pairs_per_view"] == {"before_cull": 200, "after_cull": 120}
    assert json.loads((tmp_path / "train_summary.json").read_text())["isect_pairs_per_view"]["after_cull"] == 120
    empty = write_run_record(tmp_path, RunRecord(), result, None, None, "reference", None, None, torch.device("cpu"))
    assert "isect_pairs_per_view" not in empty
