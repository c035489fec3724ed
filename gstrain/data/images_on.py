"""data.images_on: where the training images live, auto's pick among gpu, host and disk by the
sizes it sees (said in one line), and whether the scene loads lazily. The stores themselves are
data/image_store.py's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from gstrain.choices import IMAGES_ON
from gstrain.data.images import decoded_shape, view_shape
from gstrain.data.scene import View
from gstrain.errors import UserError

# auto keeps the images on the device when they take at most this share of its free memory: the
# rest is the Gaussians' (parameters, gradients, Adam moments, per-step buffers) to grow into.
DEVICE_SHARE = 0.25
# auto keeps decoded images in host memory when they take at most this share of what is available.
HOST_SHARE = 0.5


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def choose_images_on(image_bytes: int, device_free: int | None, host_available: int,
                     host_bytes: int | None = None) -> tuple[str, str]:
    """auto's pick for `image_bytes` of decoded images, and the one line that says why.

    device_free: free bytes on the CUDA device (None when training on the CPU, where the device
    memory is the host's and "gpu" means resident in it). host_bytes: what host memory would hold
    (the decodes before undistortion; None: image_bytes)."""
    host_bytes = image_bytes if host_bytes is None else host_bytes
    if device_free is None:
        if image_bytes <= HOST_SHARE * host_available:
            return "gpu", (f"data.images_on=auto: images resident ({_gib(image_bytes)} decoded, "
                           f"{_gib(host_available)} of memory available; training on the CPU)")
        return "disk", (f"data.images_on=auto: disk ({_gib(image_bytes)} decoded is over {HOST_SHARE:.0%} "
                        f"of the {_gib(host_available)} of memory available)")
    if image_bytes <= DEVICE_SHARE * device_free:
        return "gpu", (f"data.images_on=auto: gpu ({_gib(image_bytes)} decoded, at most {DEVICE_SHARE:.0%} "
                       f"of the {_gib(device_free)} free on the GPU)")
    if host_bytes <= HOST_SHARE * host_available:
        return "host", (f"data.images_on=auto: host ({_gib(image_bytes)} decoded is over {DEVICE_SHARE:.0%} "
                        f"of the {_gib(device_free)} free on the GPU; {_gib(host_available)} of host memory "
                        "available)")
    held = "" if host_bytes == image_bytes else f", {_gib(host_bytes)} before undistortion"
    return "disk", (f"data.images_on=auto: disk ({_gib(image_bytes)} decoded{held} is over {DEVICE_SHARE:.0%} of "
                    f"the {_gib(device_free)} free on the GPU and {HOST_SHARE:.0%} of the {_gib(host_available)} "
                    "of host memory available)")


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (None on the CPU)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def check_images_on(value: str) -> None:
    """UserError (one line, exit 2) unless `value` is one of choices.IMAGES_ON."""
    if value not in IMAGES_ON:
        raise UserError(f"data.images_on must be one of {', '.join(IMAGES_ON)}; got '{value}'")


def scene_is_lazy(images_on: str, device: torch.device | None = None) -> bool:
    """Whether to load the scene lazily (headers only): all but gpu on the CPU, which decodes every
    image at start-up anyway (auto decides once the sizes are known, and decodes then if it keeps
    them). gpu on CUDA is lazy too: its store decodes at start-up and undistorts on the device, as
    host and disk do, so the three give the same bytes."""
    check_images_on(images_on)
    return images_on != "gpu" or (device is not None and device.type == "cuda")


def resolve_images_on(
    views: Sequence[View], images_on: str, device: torch.device, log: Callable[[str], None] = print,
    device_free: int | None = None, host_available: int | None = None,
) -> str:
    """gpu, host or disk for data.images_on: auto picks by the decoded sizes and says so in one
    line. device_free / host_available: the sizes auto weighs (measured when None)."""
    check_images_on(images_on)
    if images_on != "auto":
        return images_on
    image_bytes = sum(h * w * c for h, w, c in (view_shape(v) for v in views))
    host_bytes = sum(h * w * c for h, w, c in (decoded_shape(v) for v in views))  # host keeps them distorted
    if device_free is None:
        device_free = device_free_bytes(device)
    where, line = choose_images_on(image_bytes, device_free,
                                   host_available if host_available is not None else host_available_bytes(),
                                   host_bytes)
    log(f"gstrain: {line}")
    return where
