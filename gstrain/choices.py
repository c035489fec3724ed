"""Every list of allowed values a user can name, each with this one owner.

The config checks its keys against these, the command line spells them out in its help, and the
modules that act on a value import the list from here. Nothing heavy is imported, so `gstrain
--help` and the config stay quick. (Strategy names live in gstrain/train/strategies/registry.py,
which maps each to its class.)
"""

from __future__ import annotations

# The rasterizer: our CUDA kernels, the PyTorch reference, or gsplat's own rasterize_to_pixels
# (forward and backward: the peer we measure against). auto: cuda on a GPU, reference on the CPU.
BACKENDS = ("auto", "reference", "cuda", "gsplat")
# The backends that run gsplat's projection and a CUDA rasterizer (ours or gsplat's): GPU only.
CUDA_BACKENDS = ("cuda", "gsplat")
# How our CUDA backward reduces gradients (the only choice it has; nothing else differs).
ATOMIC_MODES = ("atomic", "warp", "distwar", "arc")
DEVICES = ("auto", "cpu", "cuda")
INIT_MODES = ("sfm", "random")  # model.init: the SfM points, or random points
MASK_MODES = ("ignore", "background")
# data.images_on: gpu (decoded at start-up, on the training device), host (pinned host memory,
# copied one step ahead), disk (decoded on the fly by worker processes), auto (the first that fits)
IMAGES_ON = ("auto", "gpu", "host", "disk")
DECODE_IN = ("processes", "threads")  # dev.decode_in: who decodes data.images_on=disk's images
# train.appearance: no per-image colour correction, a learned 3x4 affine colour transform per
# training image (exposure and white balance; gstrain/train/appearance.py), or a learned bilateral
# grid of them per training image (also vignetting, tone curves; gstrain/train/bilateral_grid.py)
APPEARANCE_MODES = ("none", "affine", "bilateral")
# dev.bilateral_backward: how the fused bilateral backward sums a block's pixels into the grid's
# gradient (the same sums up to float rounding; bench/bilateral_cost.py times them), in the order
# of gstrain/train/csrc/bilateral.h's BilateralBwdVariant: shared-memory atomics per pixel (a warp
# whose 32 pixels share one cell sums by shuffles first); lanes in runs of one cell summed by
# segmented shuffles, one atomic a run; as that, with the row's common y weight factored out
BILATERAL_BACKWARDS = ("shared", "warp_runs", "row_runs")
PARTITIONS = ("locality", "random", "round_robin", "views")  # who owns which Gaussian (distributed/partition.py)
# optim.moments: how Adam keeps its two moments for the Gaussians' parameters: float32, bfloat16
# with stochastic rounding (half the bytes; gstrain/train/bf16_moments.py), or int8: shN's in 8 bits
# with a scale per Gaussian, the rest bfloat16 (gstrain/train/int8_moments.py)
MOMENTS = ("fp32", "bf16", "int8")
COMPRESSIONS = ("none", "fp16")  # records on the wire between ranks
DIST_BACKENDS = ("auto", "nccl", "gloo")

EXPORT_FORMATS = ("ply", "splat", "ply-compressed")  # gstrain export --format
SFM_MATCHERS = ("exhaustive", "sequential")  # gstrain sfm --matcher
CAMERA_PATHS = ("test", "train", "orbit", "spiral")  # gstrain render --path
RENDER_OUTPUTS = ("rgb", "depth", "alpha")  # gstrain render --what
PROFILE_BACKENDS = ("cuda", "gsplat", "all")  # gstrain profile --backend

