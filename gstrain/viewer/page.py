"""The viewer page on a viser server: splats, camera frustums, an info panel and a "render" toggle.

Used by `gstrain view` (a finished run) and by the live viewer of `gstrain fit --viewer`. All viser
calls happen here; the callers hand over CPU copies of the parameters.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from gstrain.config import Config
from gstrain.data.scene import Scene, View
from gstrain.model import sh_degree_of
from gstrain.viewer.convert import fit_size, intrinsics, pose_of, splat_arrays, thumbnail, viewmat_of, wxyz_of

RENDER_SIDE_CPU = 256  # longest side of our renderer's image on the CPU (the reference renderer is slow)
RENDER_SIDE_GPU = 1024


def config_summary(cfg: Config) -> str:
    return (
        f"strategy {cfg.strategy.name}, SH degree {cfg.model.sh_degree}, {cfg.train.steps} steps, "
        f"factor {cfg.data.factor}, backend {cfg.render.backend}"
    )


class ViewerPage:
    """One page per server. `set_splats` may be called from any thread; the newest call wins."""

    def __init__(self, server, cfg: Config, scene: Scene | None, device: torch.device) -> None:
        self.server = server
        self.cfg = cfg
        self.scene = scene
        self.device = device
        self._params: dict[str, Tensor] | None = None
        self._lock = threading.Lock()
        self._render_wanted = threading.Event()
        self._render_clients: dict[int, object] = {}
        self._renderer = None
        self._start_view: View | None = None
        self._at: str | None = None  # name of the camera the view was last moved to (its frustum is hidden)
        gui = server.gui
        self.info = gui.add_markdown("loading...")
        self.show_splats = gui.add_checkbox("Show Gaussians", initial_value=True)
        self.show_cameras = gui.add_checkbox("Show cameras", initial_value=True)
        self.render_toggle = gui.add_checkbox("Render (gstrain)", initial_value=False)
        self.show_splats.on_update(lambda _e: self._apply_visibility())
        self.show_cameras.on_update(lambda _e: self._apply_visibility())
        self.render_toggle.on_update(lambda _e: self._toggle_render())
        self._splats = None
        self._frustums: dict[str, object] = {}
        if scene is not None:
            self._add_cameras(scene)
        server.on_client_connect(self._on_connect)
        self._worker = threading.Thread(target=self._render_loop, name="gstrain-view-render", daemon=True)
        self._worker.start()

    # --------------------------------------------------------------- content
    def set_info(self, lines: list[str]) -> None:
        self.info.content = "\n\n".join(lines)

    def set_splats(self, params: Mapping[str, Tensor]) -> None:
        arrays = splat_arrays(params)
        with self._lock:
            self._params = {k: v for k, v in params.items()}
        self._splats = self.server.scene.add_gaussian_splats(
            "/gaussians", **arrays, visible=self.show_splats.value and not self.render_toggle.value
        )
        self._render_wanted.set()

    def _add_cameras(self, scene: Scene) -> None:
        centres = np.stack([pose_of(v.viewmat)[1] for v in scene.train + scene.test])
        size = 0.05 * float(np.linalg.norm(centres - centres.mean(0), axis=1).max() or 1.0)
        for kind, views, colour in (("train", scene.train, (90, 90, 90)), ("test", scene.test, (230, 60, 40))):
            for view in views:
                R, c = pose_of(view.viewmat)
                fy = float(view.K[1, 1])
                frustum = self.server.scene.add_camera_frustum(
                    f"/cameras/{kind}/{view.name}", fov=2 * math.atan(0.5 * view.height / fy),
                    aspect=view.width / view.height, scale=size, color=colour, image=thumbnail(view.image),
                    wxyz=wxyz_of(R), position=c,
                )
                frustum.on_click(lambda event, v=view: self.move_to(event.client, v))
                self._frustums[view.name] = frustum
        self._start_view = (scene.test or scene.train)[0]
        # world "up": the cameras' mean -y axis (COLMAP scenes have no fixed up)
        up = -np.mean([pose_of(v.viewmat)[0][:, 1] for v in scene.train], axis=0)
        self._up = up / max(float(np.linalg.norm(up)), 1e-9)

    def _apply_visibility(self) -> None:
        if self._splats is not None:
            self._splats.visible = self.show_splats.value and not self.render_toggle.value
        for name, frustum in self._frustums.items():
            # sitting on a dataset camera, its own frustum image would fill the whole view
            frustum.visible = self.show_cameras.value and name != self._at

    # --------------------------------------------------------------- cameras
    def move_to(self, client, view: View) -> None:
        """Put a browser's camera where a dataset camera is, looking the same way."""
        R, c = pose_of(view.viewmat)
        fwd = R[:, 2]
        self._at = view.name
        self._apply_visibility()
        with client.atomic():
            client.camera.fov = 2 * math.atan(0.5 * view.height / float(view.K[1, 1]))
            client.camera.up_direction = -R[:, 1]
            client.camera.position = c
            client.camera.look_at = c + fwd * max(float(np.linalg.norm(c)), 1e-3)

    def _on_connect(self, client) -> None:
        if self._start_view is not None:
            client.camera.up_direction = self._up
            self.move_to(client, self._start_view)
        client.camera.on_update(lambda _cam: self._render_wanted.set())

    # --------------------------------------------------------------- our renderer
    def _toggle_render(self) -> None:
        self._apply_visibility()
        if self.render_toggle.value:
            self._render_wanted.set()
        else:
            for client in self.server.get_clients().values():
                client.scene.set_background_image(None)

    def _render_loop(self) -> None:
        while True:
            self._render_wanted.wait()
            self._render_wanted.clear()
            if not self.render_toggle.value:
                continue
            for client in list(self.server.get_clients().values()):
                try:
                    client.scene.set_background_image(self.render_for(client.camera), format="jpeg")
                except Exception as exc:  # noqa: BLE001 - a failed frame must not end the viewer
                    self.set_info([f"render failed: {exc}"])

    @torch.no_grad()
    def render_for(self, camera) -> np.ndarray:
        """Our renderer's image [H,W,3] uint8 for a browser camera, at reduced resolution."""
        from gstrain.render import Renderer

        with self._lock:
            params = self._params
        if params is None:
            raise RuntimeError("no Gaussians yet")
        if self._renderer is None:
            self._renderer = Renderer(self.cfg.render, self.device, dev=self.cfg.dev)
            if self.scene is not None:
                self._renderer.set_training_views(self.scene.train)  # render.filter_3d's sampling rates
        side = RENDER_SIDE_GPU if self.device.type == "cuda" else RENDER_SIDE_CPU
        w, h = fit_size(camera.image_width, camera.image_height, side)
        p = {k: v.to(self.device) for k, v in params.items()}
        degree = sh_degree_of(p)
        image, _, _ = self._renderer(
            p, viewmat_of(camera.wxyz, camera.position).to(self.device), intrinsics(camera.fov, w, h).to(self.device),
            w, h, degree, torch.tensor(self.cfg.data.background, device=self.device),
        )
        return (image.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
