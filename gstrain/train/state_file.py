"""Trainer state on disk holds only plain data, and is read without running anything in it.

A checkpoint or shard is a torch.save'd tree of tensors, numbers, strings, None, lists, tuples
and dicts. `save_state` refuses anything else before it writes; `load_state` reads with torch's
weights-only unpickler, so a file that names any other Python object (a crafted __reduce__
payload in someone's shared run folder) is refused instead of executed.

Checkpoints written before the numpy random state was stored as plain numbers hold one numpy
array (numpy.random.get_state()). Rebuilding an ndarray from its bytes calls no code of the
file's choosing, so numpy's array reconstructor is the one addition to torch's allowlist: such
runs stay readable as they are.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from gstrain.files import write_atomic

__all__ = ["UnsafeStateFile", "atomic_torch_save", "check_plain", "load_state", "save_state"]

_LEAF_TYPES = (torch.Tensor, bool, int, float, str, type(None))

# numpy's array reconstructor (under its numpy 2 name, and the one numpy 1.x pickled), and the
# dtype of the random state's key: what the older checkpoints' one array needs, nothing more
_numpy_core = getattr(np, "_core", None) or np.core
_LEGACY_NUMPY: list[Any] = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    _numpy_core.multiarray._reconstruct,
    (_numpy_core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
]


class UnsafeStateFile(ValueError):
    """A state file that needs Python objects a gstrain checkpoint never holds; it was not opened."""


def check_plain(obj: Any, where: str = "state") -> None:
    """Raise TypeError naming the first value that is not plain data (see the module doc)."""
    if isinstance(obj, _LEAF_TYPES):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not a str or int")
            check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds "
                    "only tensors, numbers, strings, lists and dicts")  # fmt: skip


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write to a temp file in the same folder, fsync, then rename: a crash never leaves half a file."""
    write_atomic(path, lambda fh: torch.save(obj, fh))


def save_state(obj: dict[str, Any], path: Path) -> None:
    """Check that `obj` is plain data, then write it atomically."""
    check_plain(obj)
    atomic_torch_save(obj, path)


def load_state(source: Path | IO[bytes], map_location: str | torch.device = "cpu") -> Any:
    """torch.load with the weights-only unpickler; UnsafeStateFile if the file asks for more."""
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Weights only load failed" not in text:
            raise
        names = sorted(set(re.findall(r"GLOBAL ([\w.]+)", text))) or ["objects beyond plain data"]
        raise UnsafeStateFile(
            f"it asks for {', '.join(names)}, which a gstrain checkpoint never holds; not unpickled, "
            "since that could run code"
        ) from None
