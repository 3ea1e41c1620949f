"""The memory/time frontier of ``mhc-cg cost`` as a picture: each mode's peak memory against its
modelled step time, one point per mode (``mhc-cg cost --plot PNG``)."""

from __future__ import annotations

from pathlib import Path


def plot_frontier(report: dict, path: str | Path, title: str | None = None) -> Path:
    """Write the PNG of ``report`` (:func:`mhc_cg.tools.cost.report.cost_report`) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, m in modes.items():
        x, y = m["predicted_h100_step_s"] * 1e3, m["peak_bytes"] / 2 ** 30
        ax.scatter([x], [y], s=40, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.set_xlabel("modelled H100 step (ms)")
    ax.set_ylabel("peak device memory (GiB, allocator emulation)")
    ax.set_title(title or f"memory and time per step: {report['config'] or 'the config'}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.margins(0.15)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
