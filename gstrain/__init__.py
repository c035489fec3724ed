"""gstrain: a Gaussian Splatting training CLI with a measured, warp-reduced rasterizer backward."""

__version__ = "0.1.0"
