"""bench/big_curve.py's plot: ms per step and peak memory against the number of Gaussians."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curve(records: list[dict[str, Any]], path: Path) -> Path:
    """ms per step and peak GiB against N (millions), a line per pipeline and image size (and cap);
    OOM points marked x on the memory panel. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker below

    fig, (ax_ms, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if not r.get("probe"):
            groups.setdefault((r["pipeline"], r["factor"], r.get("cap_gib")), []).append(r)
    for (pipeline, factor, cap), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["n"])
        size = f"{ok[0]['width']}x{ok[0]['height']}" if ok else f"factor {factor}"
        label = f"{pipeline} {size}" + (f", cap {cap:g} GiB" if cap else "")
        style = "-" if pipeline == "gstrain" else "--"
        if ok:
            line = ax_ms.plot([r["n"] / 1e6 for r in ok], [r["ms_per_step"] for r in ok], style, marker="o",
                              label=label)[0]  # fmt: skip
            ax_mem.plot([r["n"] / 1e6 for r in ok], [r["peak_gib"] for r in ok], style, marker="o",
                        color=line.get_color(), label=label)  # fmt: skip
        oom = [r for r in rows if r["status"] == "oom"]
        if oom:
            ax_mem.scatter([r["n"] / 1e6 for r in oom], [r.get("peak_gib") or 0 for r in oom], marker="x", color="red")
    for ax, ylabel in ((ax_ms, "ms per step"), (ax_mem, "peak GiB (allocator)")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _pos: f"{x:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("Gaussians (millions)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.legend(fontsize=8)
    ax_ms.set_title("cost per training step")
    ax_mem.set_title("peak memory (x: out of memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def try_plot(path: Path, records: list[dict[str, Any]]) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"big_curve: matplotlib is not installed; plot later with python -m bench.big_curve --plot {path.parent}")
        return
    print(f"big_curve: wrote {plot_curve(records, path)}")
