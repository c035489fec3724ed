"""The live viewer of `gstrain fit --viewer`: the training page, refreshed every N steps.

Training never waits on it: `on_step` returns at once except on refresh steps, where it copies
the splats to host memory and leaves the conversion and sending to a worker thread (the newest
copy wins). Pause is a flag the trainer checks between steps; with no browser connected a pause
is lifted, so closing the browser never holds up training.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from gstrain.config import Config
from gstrain.data.scene import Scene
from gstrain.viewer.page import ViewerPage, config_summary
from gstrain.viewer.serve import page_url, start_server, stop_quietly


def _value(x: Tensor | float | None) -> float | None:
    return None if x is None else float(x)


class LiveViewer:
    def __init__(self, cfg: Config, scene: Scene, log: Callable[[str], None] = print) -> None:
        vc = cfg.viewer
        self.refresh_every = vc.refresh_every
        self.log = log
        self.server = start_server(vc.host, vc.port, log=log, key="viewer.host")
        # our renderer runs on the CPU here, so the "render" toggle never competes with training for the GPU
        self.page = ViewerPage(self.server, cfg, scene, torch.device("cpu"))
        self._summary = config_summary(cfg)
        self._running = threading.Event()
        self._running.set()
        self.pause_button = self.server.gui.add_button("Pause training")
        self.pause_button.on_click(lambda _e: self._toggle_pause())
        self._steps: list[float] = []
        self._loss: list[float] = []
        self._psnr: list[float] = []
        self._curves = None
        self._lock = threading.Lock()  # the curves' lists: appended by training, read by the worker
        self._pending: tuple[int, dict[str, Tensor]] | None = None
        self._wake = threading.Event()
        self._closed = False
        self._worker = threading.Thread(target=self._publish_loop, name="gstrain-live-viewer", daemon=True)
        self._worker.start()
        log(f"gstrain: live viewer at {page_url(vc.host, vc.port)} (refreshed every {self.refresh_every} steps)")

    # ------------------------------------------------------------ trainer side
    def on_step(self, step: int, params: Mapping[str, Tensor], loss: Tensor | float | None,
                psnr: Tensor | float | None) -> None:
        """Called after every step; does work only every `refresh_every` steps."""
        if step % self.refresh_every != 0:
            return
        # without the SH rest (3/4 of the bytes): the browser draws DC colour only, and the render
        # toggle then renders degree 0
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in params.items() if k != "shN"}
        snapshot["shN"] = torch.zeros(len(snapshot["means"]), 0, 3)
        row = (float(step), _value(loss), _value(psnr))
        with self._lock:
            for values, x in zip((self._steps, self._loss, self._psnr), row, strict=True):
                values.append(float("nan") if x is None else x)
        self._pending = (step, snapshot)
        self._wake.set()

    def wait_if_paused(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Block while paused; returns when resumed, when no browser is left, or when should_stop() says so."""
        while self.still_paused(should_stop):
            pass

    def still_paused(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """Wait up to a quarter second for a resume; whether the pause goes on. It ends when no
        browser is left or when should_stop() says so."""
        if self._running.wait(0.25):
            return False
        if (should_stop is not None and should_stop()) or not self.server.get_clients():
            self._set_running(True)
            return False
        return True

    def close(self) -> None:
        self._closed = True
        self._running.set()
        self._wake.set()
        self._worker.join(timeout=10)
        stop_quietly(self.server)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    # ------------------------------------------------------------ viewer side
    def _toggle_pause(self) -> None:
        self._set_running(self.paused)

    def _set_running(self, running: bool) -> None:
        if running:
            self._running.set()
        else:
            self._running.clear()
        self.pause_button.label = "Pause training" if running else "Resume training"

    def _publish_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            pending, self._pending = self._pending, None
            if pending is None:
                continue
            step, params = pending
            try:
                self.page.set_splats(params)
                self._publish_info(step, len(params["means"]))
            except Exception as exc:  # noqa: BLE001 - the viewer must never end training
                self.log(f"gstrain: live viewer update failed: {exc}")

    def _publish_info(self, step: int, n: int) -> None:
        with self._lock:
            data = (np.array(self._steps), np.array(self._loss), np.array(self._psnr))
        loss, psnr = data[1][-1], data[2][-1]
        lines = [self._summary, f"step {step}", f"{n} Gaussians", f"train loss {loss:.4f}"]
        if np.isfinite(psnr):
            lines.append(f"train PSNR {psnr:.2f} dB")
        self.page.set_info(lines)
        if len(data[0]) < 2:  # uPlot needs two points
            return
        if self._curves is None:
            from viser import uplot

            series = (uplot.Series(label="step"), uplot.Series(label="loss", stroke="red", scale="loss"),
                      uplot.Series(label="PSNR", stroke="blue", scale="psnr"))
            self._curves = self.server.gui.add_uplot(data, series, title="training", aspect=1.5)
        else:
            self._curves.data = data
