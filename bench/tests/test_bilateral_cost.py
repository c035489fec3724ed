"""bench/bilateral_cost.py on the CPU: its arguments, the refusal without a GPU, and that its
synthetic view is photo-like for the kernels (runs of one luminance level tens of pixels long)."""

from __future__ import annotations

import time

import pytest
import torch

from bench import bilateral_cost


def test_defaults_are_beers_size_and_bad_sizes_are_refused(capsys):
    args = bilateral_cost.parse_args([])
    assert (args.size, args.grid, args.views) == ((701, 1248), (8, 16, 16), 71)
    assert bilateral_cost.parse_args(["--size", "20x30", "--grid", "2x3x4"]).grid == (2, 3, 4)
    for bad in (["--size", "20"], ["--grid", "8x16"], ["--size", "0x5"], ["--views", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            bilateral_cost.parse_args(bad)
        assert exit_info.value.code == 2
    capsys.readouterr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert bilateral_cost.main(["--reps", "1"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_synthetic_view_changes_luminance_level_rarely_along_a_row():
    image = bilateral_cost.load_image(None, (701, 1248), torch.device("cpu"))
    assert image.shape == (701, 1248, 3) and 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    luma = image[..., 0] * 0.299 + image[..., 1] * 0.587 + image[..., 2] * 0.114
    level = (luma * 7).floor()  # the default grid's 8 levels
    changes = float((level[:, 1:] != level[:, :-1]).float().mean())
    assert 0.001 < changes < 0.1  # neither flat nor noise: runs of about 10 to 1000 pixels


class _HostEvent:
    """A stand-in for torch.cuda.Event on the CPU: the host clock at record()."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, later: _HostEvent) -> float:
        return (later.at - self.at) * 1e3


def test_the_step_timing_drives_the_real_correction(monkeypatch):
    """The grid_sample path of the step timing on the CPU with host-clock events: the real
    BilateralAppearance learns (its table leaves identity) and every row is a positive time."""
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = bilateral_cost.parse_args(["--size", "20x36", "--grid", "3x4x5", "--views", "3", "--reps", "2",
                                      "--warmup", "1", "--profile-steps", "1"])  # fmt: skip
    cpu = torch.device("cpu")
    image = bilateral_cost.load_image(None, args.size, cpu)
    grad_out = torch.randn(image.shape, generator=torch.Generator().manual_seed(0))
    model = bilateral_cost.build_model(args, False, "shared", cpu)
    before = model.table.detach().clone()
    assert tuple(model.table.shape) == (3, 12, 3, 4, 5) and model.tv > 0
    rows = bilateral_cost.step_rows(args, model, image, grad_out, "grid_sample")
    rows += bilateral_cost.table_rows(args, model)
    assert len(rows) == 7 and all(ms > 0 for _, ms in rows)
    assert not torch.equal(model.table.detach(), before)
    assert "Name" in bilateral_cost.profile_table(args, model, image, grad_out)
