"""The memory/time frontier of ``mhc-cg cost`` as a picture: each mode's peak memory against its
modelled step time, one point per mode at the band's middle with a bar from its low to its high
end (``mhc-cg cost --plot PNG``)."""

from __future__ import annotations

from pathlib import Path


def plot_frontier(report: dict, path: str | Path, title: str | None = None) -> Path:
    """Write the PNG of ``report`` (:func:`mhc_cg.lab.cost.report.cost_report`) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = {name: (m["step_s"]["low"] * 1e3, m["step_s"]["high"] * 1e3)
             for name, m in report["modes"].items()}
    points = {name: ((low + high) / 2, m["peak_bytes"] / 2 ** 30)
              for (name, m), (low, high) in zip(report["modes"].items(), bands.values())}
    xs, ys = zip(*points.values())
    # a label runs about a fifth of the width to the right of its point
    near_x, near_y = 0.2 * (max(xs) - min(xs) or 1), 0.03 * (max(ys) - min(ys) or 1)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    placed: list[tuple[float, float]] = []
    for name, (x, y) in points.items():
        low, high = bands[name]
        line = ax.errorbar([x], [y], xerr=[[x - low], [high - x]], fmt="o", ms=6, capsize=3,
                           zorder=3)
        color = line[0].get_color()
        ax.scatter([low, high], [y, y], s=12, color=color, zorder=3)
        # a label next to another point's goes a line lower, so none is written over another
        crowd = sum(abs(x - px) < near_x and abs(y - py) < near_y for px, py in placed)
        placed.append((x, y))
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4 - 11 * crowd),
                    fontsize=9)
    ax.set_xlabel(f"modelled {report['gpu']['name']} step (ms): low to high end of the band")
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
