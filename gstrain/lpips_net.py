"""LPIPS (v0.1, Zhang et al. 2018) in plain torch: the metric the papers report, without torchvision.

The `lpips` package imports torchvision, and PyPI's torchvision does not load beside a CPU build of
torch (its compiled ops need torch's CUDA libraries), so gstrain builds the two backbones itself:
torchvision's AlexNet and VGG16 `features` stacks, read from torchvision's own checkpoint files,
and lpips' per-layer linear weights. All weights come through torch.hub's cache, downloaded on
first use when the machine is online; offline, the reason names each file and where it goes.

The function: inputs in [-1, 1] are shifted and scaled per channel, five ReLU outputs of the
backbone are unit-normalised along channels, their squared differences weighted per channel by
lpips' linear layers, averaged over the image, and summed over the five layers.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

# per network: (torch.hub file name, URL) of the backbone, then of lpips' linear weights
WEIGHT_FILES: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "alex": (
        ("alexnet-owt-7be5be79.pth", "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"),
        ("lpips-v0.1-alex.pth",
         "https://github.com/richzhang/PerceptualSimilarity/raw/master/lpips/weights/v0.1/alex.pth"),
    ),
    "vgg": (
        ("vgg16-397923af.pth", "https://download.pytorch.org/models/vgg16-397923af.pth"),
        ("lpips-v0.1-vgg.pth",
         "https://github.com/richzhang/PerceptualSimilarity/raw/master/lpips/weights/v0.1/vgg.pth"),
    ),
}
# torchvision's `features` layers: ("conv", in, out, kernel, stride, padding) | ("relu",) | ("pool", kernel, stride)
_ALEX = [("conv", 3, 64, 11, 4, 2), ("relu",), ("pool", 3, 2), ("conv", 64, 192, 5, 1, 2), ("relu",), ("pool", 3, 2),
         ("conv", 192, 384, 3, 1, 1), ("relu",), ("conv", 384, 256, 3, 1, 1), ("relu",),
         ("conv", 256, 256, 3, 1, 1), ("relu",)]
_VGG_WIDTHS = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
# index of the last layer of each of the five slices lpips compares (a ReLU)
_TAPS = {"alex": (1, 4, 7, 9, 11), "vgg": (3, 8, 15, 22, 29)}
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)
DOWNLOAD_TIMEOUT_S = 30.0

LpipsFn = Callable[[Tensor, Tensor], Tensor]


def weight_paths(net: str) -> list[Path]:
    """Where torch.hub keeps the two weight files of `net` (backbone, linear layers)."""
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    return [folder / name for name, _ in WEIGHT_FILES[net]]


def fetch_weights(net: str) -> str | None:
    """Download the missing weight files of `net` into torch.hub's cache; None, or one line on why not."""
    for (_, url), path in zip(WEIGHT_FILES[net], weight_paths(net), strict=True):
        if path.is_file():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # an offline machine must not hang eval
        try:
            torch.hub.download_url_to_file(url, str(path), progress=False)  # writes a temp file, then renames
        except Exception as exc:  # offline, refused, timed out: a reason, not a crash
            return f"{missing_line(net)} (download failed: {type(exc).__name__})"
        finally:
            socket.setdefaulttimeout(previous)
    return None


def missing_line(net: str) -> str:
    """One line: which LPIPS weight files are missing and where to put them."""
    missing = [(url, path) for (_, url), path in zip(WEIGHT_FILES[net], weight_paths(net), strict=True)
               if not path.is_file()]
    what = "; ".join(f"put {url} at {path}" for url, path in missing)
    return f"LPIPS weights not available offline: {what}"


class Lpips(nn.Module):
    """LPIPS v0.1 distance of two [B, 3, H, W] batches in [-1, 1]: [B] values."""

    def __init__(self, net: str) -> None:
        super().__init__()
        self.net = net
        self.features = nn.Sequential(*_layers(net))
        self.taps = _TAPS[net]
        widths = [self.features[i - 1].out_channels for i in self.taps]
        self.lins = nn.ModuleList(nn.Conv2d(w, 1, 1, bias=False) for w in widths)
        self.register_buffer("shift", torch.tensor(_SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(_SCALE).view(1, 3, 1, 1))

    def load_weights(self, backbone: dict[str, Tensor], linear: dict[str, Tensor]) -> None:
        """torchvision's state dict (its features.* entries) and lpips' (lin{k}.model.1.weight)."""
        self.features.load_state_dict({k.removeprefix("features."): v for k, v in backbone.items()
                                       if k.startswith("features.") and int(k.split(".")[1]) <= self.taps[-1]})
        self.lins.load_state_dict({f"{k}.weight": linear[f"lin{k}.model.1.weight"] for k in range(len(self.lins))})

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        x = torch.cat([a, b]).sub(self.shift).div(self.scale)
        total = torch.zeros(a.shape[0], device=a.device, dtype=a.dtype)
        start = 0
        for tap, lin in zip(self.taps, self.lins, strict=True):
            x = self.features[start: tap + 1](x)
            start = tap + 1
            unit = x / (x.square().sum(dim=1, keepdim=True).sqrt() + 1e-10)
            fa, fb = unit.chunk(2)
            total = total + lin((fa - fb).square()).mean(dim=(1, 2, 3))
        return total


def build_lpips(net: str, device: torch.device | str) -> LpipsFn:
    """fn(img, gt) -> scalar LPIPS of two [H, W, 3] images in [0, 1]; the weight files must be cached."""
    backbone_file, linear_file = weight_paths(net)
    model = Lpips(net)
    model.load_weights(torch.load(backbone_file, map_location="cpu", weights_only=True),
                       torch.load(linear_file, map_location="cpu", weights_only=True))
    model = model.to(device).eval().requires_grad_(False)

    def fn(img: Tensor, gt: Tensor) -> Tensor:
        a = img.permute(2, 0, 1).unsqueeze(0) * 2 - 1
        b = gt.permute(2, 0, 1).unsqueeze(0) * 2 - 1
        with torch.no_grad():
            return model(a, b)[0]

    return fn


def _layers(net: str) -> list[nn.Module]:
    if net == "alex":
        spec = _ALEX
    else:
        spec, width = [], 3
        for item in _VGG_WIDTHS:
            if item == "M":
                spec.append(("pool", 2, 2))
            else:
                spec += [("conv", width, item, 3, 1, 1), ("relu",)]
                width = item
    layers: list[nn.Module] = []
    for kind, *args in spec:
        if kind == "conv":
            c_in, c_out, k, s, p = args
            layers.append(nn.Conv2d(c_in, c_out, k, stride=s, padding=p))
        elif kind == "relu":
            layers.append(nn.ReLU(inplace=False))
        else:
            layers.append(nn.MaxPool2d(args[0], stride=args[1]))
    return layers
