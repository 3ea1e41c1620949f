"""PNG of a timeline comparison: both timelines on one time axis, then GPU time per range name.

Top two panels: A and B, each with its ranges stacked by nesting depth (one lane per depth,
coloured by phase, the part of the name before the first ``/``) above one lane of device work
(kernels, or top-level CPU operators in a CPU-only trace). Time is in ms from each trace's first
range, so the same step lines up when both runs start their loop the same way. Bottom panel: GPU
time per range name, A and B side by side (the names with the largest GPU time, at most
``max_names``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from mhc_cg.lab.profiling.traces import NS_PER_MS, Comparison, RangeEvent, Timeline  # noqa: E402

PHASE_COLORS = {"step": "#b0b0b0", "forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#8172b3",
                "fwd": "#64b5cd", "bwd": "#ccb974", "recompute": "#c44e52", "eager": "#55a868"}
OTHER_COLORS = ("#937860", "#da8bc3", "#8c8c8c", "#64b5cd", "#76b7b2", "#ff9da7")
DEVICE_COLOR = "#2f2f2f"
SIDE_COLORS = ("#4c72b0", "#dd8452")


def phase_of(name: str) -> str:
    return name.split("/", 1)[0]


def _phase_colors(timelines: list[Timeline]) -> dict[str, str]:
    phases = sorted({phase_of(r.name) for t in timelines for r in t.ranges})
    others = iter(OTHER_COLORS * (1 + len(phases) // len(OTHER_COLORS)))
    return {p: PHASE_COLORS.get(p) or next(others) for p in phases}


def _depths(ranges: list[RangeEvent]) -> list[tuple[RangeEvent, int]]:
    """Each range with its nesting depth on its own thread (0 = outermost)."""
    out = []
    stacks: dict[object, list[int]] = {}
    for r in sorted(ranges, key=lambda r: (r.start, -r.end)):
        stack = stacks.setdefault(r.thread, [])
        while stack and stack[-1] <= r.start:
            stack.pop()
        out.append((r, len(stack)))
        stack.append(r.end)
    return out


def _draw_timeline(ax, timeline: Timeline, label: str, colors: dict[str, str]) -> None:
    t0 = timeline.origin
    depths = _depths(timeline.ranges)
    lanes = 1 + max((d for _, d in depths), default=-1)
    by_lane: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r, d in depths:
        by_lane.setdefault((d, phase_of(r.name)), []).append(
            ((r.start - t0) / NS_PER_MS, (r.end - r.start) / NS_PER_MS))
    for (d, phase), bars in by_lane.items():
        ax.broken_barh(bars, (lanes - d, 0.8), facecolors=colors[phase], edgecolor="white", linewidth=0.3)
    work = [((w.start - t0) / NS_PER_MS, (w.end - w.start) / NS_PER_MS) for w in timeline.work]
    ax.broken_barh(work, (0, 0.8), facecolors=DEVICE_COLOR, linewidth=0)
    device = "CPU ops" if timeline.kind == "chrome-cpu" else "kernels"
    ax.set_yticks([0.4] + [lanes - d + 0.4 for d in range(lanes)],
                  [device] + [f"depth {d}" for d in range(lanes)])
    ax.set_ylim(-0.2, lanes + 1)
    ax.set_title(f"{label}: {timeline.path.name} ({timeline.kind})", fontsize=9, loc="left")


def _draw_bars(ax, cmp: Comparison, max_names: int) -> None:
    rows = [(n, sa.gpu_ns if sa else 0, sb.gpu_ns if sb else 0) for n, sa, sb in cmp.ranges]
    rows = sorted(rows, key=lambda r: -max(r[1], r[2]))[:max_names]
    positions = range(len(rows))
    width = 0.4
    for k, (label, color) in enumerate(zip(cmp.labels, SIDE_COLORS)):
        values = [r[1 + k] / NS_PER_MS for r in rows]
        ax.barh([p + (k - 0.5) * width for p in positions], values, height=width, color=color, label=label)
    ax.set_yticks(list(positions), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GPU time per range name, summed over instances (ms)")
    ax.legend(fontsize=8, loc="lower right")


def plot_comparison(cmp: Comparison, out: str | Path, max_names: int = 12) -> Path:
    """Write the comparison PNG to ``out`` (parent folders created); returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    colors = _phase_colors([cmp.a, cmp.b])
    fig = plt.figure(figsize=(12, 9), constrained_layout=True)
    grid = fig.add_gridspec(3, 1, height_ratios=[1, 1, 1.2])
    ax_a = fig.add_subplot(grid[0])
    ax_b = fig.add_subplot(grid[1], sharex=ax_a)
    for ax, timeline, label in ((ax_a, cmp.a, cmp.labels[0]), (ax_b, cmp.b, cmp.labels[1])):
        _draw_timeline(ax, timeline, label, colors)
    ax_b.set_xlabel("time since the trace's first range (ms)")
    handles = [Patch(color=c, label=p) for p, c in colors.items()]
    handles.append(Patch(color=DEVICE_COLOR, label="device work"))
    ax_a.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                frameon=False)  # right of the panel: clear of the lanes and titles
    _draw_bars(fig.add_subplot(grid[2]), cmp, max_names)
    cpu_only = "chrome-cpu" in (cmp.a.kind, cmp.b.kind)
    fig.suptitle(f"{cmp.labels[0]} vs {cmp.labels[1]}"
                 + (" (CPU-only trace: 'GPU time' = time in top-level CPU operators)" if cpu_only else ""),
                 fontsize=10)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
