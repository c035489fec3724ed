"""JIT build of gstrain's CUDA extensions (the rasterizer, the fused SSIM): one helper for all.

Each extension is compiled on first use into a cache directory named by a hash of everything that
shapes the binary, so a cached build is reused exactly when it matches and the one-line
"compiling" message is printed exactly when it does not. A machine that cannot build (CPU-only
PyTorch, no GPU, no nvcc) gets a UserError with one line that says why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from gstrain.errors import UserError

COMPILING_MESSAGE = "gstrain: compiling CUDA kernels (first run only)..."

_loaded: dict[str, ModuleType] = {}
_lock = threading.Lock()


def arch_list() -> list[str]:
    """TORCH_CUDA_ARCH_LIST if set, else this GPU's capability plus 9.0 (the H100/H200)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").replace(",", " ").split()
    if env:
        return env
    major, minor = torch.cuda.get_device_capability()
    return list(dict.fromkeys([f"{major}.{minor}", "9.0"]))


def gencode_flags(arches: list[str]) -> list[str]:
    flags = []
    for arch in arches:
        ptx = arch.endswith("+PTX")
        num = arch.removesuffix("+PTX").replace(".", "")
        if not num.isalnum():
            raise UserError(f"TORCH_CUDA_ARCH_LIST has an entry gstrain cannot read: {arch!r}")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def check_toolchain(what: str = "the CUDA backend", alternative: str = "use render.backend=reference") -> None:
    """UserError (one line) unless this machine can build and run CUDA extensions.

    `what` names the feature in the message; `alternative` is how to run without it.
    """
    if torch.version.cuda is None:
        raise UserError(
            f"{what} needs a CUDA build of PyTorch; this one is CPU-only ({alternative}, or install PyTorch with CUDA)"
        )
    if not torch.cuda.is_available():
        raise UserError(f"{what} needs a CUDA GPU, and PyTorch sees none")
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None
    if not (nvcc is not None and nvcc.is_file()) and shutil.which("nvcc") is None:
        raise UserError(
            f"{what} compiles its kernels on first use and needs the CUDA toolkit's nvcc; "
            f"none was found (set CUDA_HOME or put nvcc on PATH, or {alternative})"
        )


def extensions_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "gstrain" / "extensions"


def load_extension(
    name: str,
    sources: Sequence[Path],
    headers: Sequence[Path] = (),
    *,
    what: str = "the CUDA backend",
    alternative: str = "use render.backend=reference",
) -> ModuleType:
    """Build (first use only) and load the extension `name` from `sources` (.cpp / .cu).

    `headers` only feed the cache hash; their directories (and the sources') are on the include
    path. Loaded modules are kept per name, so later calls cost one dictionary lookup.
    """
    ext = _loaded.get(name)
    if ext is not None:
        return ext
    with _lock:
        ext = _loaded.get(name)
        if ext is not None:
            return ext
        check_toolchain(what, alternative)
        from torch.utils.cpp_extension import load

        cuda_flags = ["-O3", "-lineinfo", *gencode_flags(arch_list())]
        cflags = ["-O3"]  # the C++ standard is left to torch (it must match its headers)
        files = [Path(f) for f in (*sources, *headers)]
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
        h.update(" ".join(cuda_flags + cflags).encode())
        h.update(f"{torch.__version__} {torch.version.cuda} {sys.version_info[:2]}".encode())
        versioned = f"{name}_{h.hexdigest()[:12]}"
        build_dir = extensions_dir() / versioned
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / f"{versioned}.so").exists():
            print(COMPILING_MESSAGE, file=sys.stderr, flush=True)
        ext = load(
            name=versioned,
            sources=[str(f) for f in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=list(dict.fromkeys(str(f.parent) for f in files)),
            build_directory=str(build_dir),
            verbose=False,
        )
        _loaded[name] = ext
        return ext
