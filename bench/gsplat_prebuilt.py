"""Stands in for gsplat/csrc.py on a GPU machine that should not JIT-build gsplat again.

gsplat 1.5.3 first tries `from gsplat import csrc` and JIT-compiles its CUDA only when that
fails (about 75 s on an H200). Copy a `gsplat_cuda.so` built earlier on the same image (it is
`$TORCH_EXTENSIONS_DIR/gsplat_cuda/gsplat_cuda.so` after a first use) beside gsplat's
`__init__.py`, and this file over gsplat/csrc.py; gsplat then loads the prebuilt module:

    cp build/ext/gsplat_cuda/gsplat_cuda.so "$SITE/gsplat/" && cp bench/gsplat_prebuilt.py "$SITE/gsplat/csrc.py"
"""

import importlib.machinery
import importlib.util
import os

import torch  # noqa: F401  (the extension needs torch's libraries loaded first)

_path = os.path.join(os.path.dirname(__file__), "gsplat_cuda.so")
_loader = importlib.machinery.ExtensionFileLoader("gsplat_cuda", _path)
_spec = importlib.util.spec_from_file_location("gsplat_cuda", _path, loader=_loader)
_module = importlib.util.module_from_spec(_spec)
_loader.exec_module(_module)
globals().update({k: getattr(_module, k) for k in dir(_module) if not k.startswith("__")})
