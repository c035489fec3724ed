"""The input-format registry: which loader reads a scene folder, decided by what the folder holds.

Every command that reads a scene (fit, eval, render, view, profile) comes through load_scene here.
A format is a module with recognise(root) -> bool and load_scene(root, factor, test_every, log,
background, max_side, lazy) -> Scene; adding one is a module and a line in FORMATS. The first format that
recognises the folder reads it (COLMAP first, as graphdeco's loader does).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from pathlib import Path

from gstrain.data import colmap, transforms
from gstrain.data.scene import Scene
from gstrain.errors import UserError

# (name for messages, module)
FORMATS = (
    ("COLMAP (sparse/0 or sparse/)", colmap),
    ("transforms.json or transforms_train.json (NeRF/Blender, nerfstudio)", transforms),
)


def load_scene(
    path: str | Path,
    factor: int = 1,
    test_every: int = 8,
    log: Callable[[str], None] | None = None,
    background: Sequence[float] = (0.0, 0.0, 0.0),
    max_side: int = 0,
    lazy: bool = False,
) -> Scene:
    """Read the scene folder in whichever format it is; UserError (one line) for any bad input.

    background: RGB in 0..1 that transparent pixels are composited over where the format does that
    (transforms.json); COLMAP scenes keep alpha as a mask (data/masks.py).
    max_side: cap the longer side of every image (after factor) at this many pixels (0: no limit).
    lazy: read image headers only; the views decode on demand (data.images_on = host | disk).
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"scene path does not exist: {root}")
    if not root.is_dir():
        raise UserError(f"scene path is not a directory: {root}")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Integral) or factor < 1:
        raise UserError(f"factor must be an integer >= 1, got {factor!r}")
    if isinstance(max_side, bool) or not isinstance(max_side, numbers.Integral) or max_side < 0:
        raise UserError(f"max_side must be an integer >= 0 (0: no limit), got {max_side!r}")
    found = [module for _, module in FORMATS if module.recognise(root)]
    if not found:
        raise UserError(
            f"no scene found in {root}: no COLMAP sparse model (cameras/images/points3D .bin or .txt) in "
            f"{root / 'sparse' / '0'} or {root / 'sparse'}, and no {transforms.SINGLE_FILE} or "
            f"{transforms.SPLIT_FILES['train']}"
        )
    scene = found[0].load_scene(root, factor=int(factor), test_every=test_every, log=log, background=background,
                                max_side=int(max_side), lazy=lazy)
    if len(found) > 1:
        scene.notes.append(f"{root} holds more than one scene format; read it as {FORMATS[0][0]}")
    return scene
