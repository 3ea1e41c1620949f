"""A training step's device time by phase and by fused op, from a torch.profiler Chrome trace.

``step_profile(trace)`` reads the trace (:func:`~mhc_cg.lab.profiling.traces.read_timeline`)
and attributes each kernel to the phase whose range was open when its launch was made: the
``forward``, ``backward``, ``iteration`` (a captured iteration's replay) and ``optimizer`` ranges
of the training loop's thread and the ``recompute/...`` ranges, wherever they are. Time, not thread, decides: autograd launches the
backward's kernels from its own thread while the loop's thread sits in ``backward``; a recompute
range, inside the backward, wins over it. Per phase: the union of its kernels' device intervals
(``gpu_ms``) and their count. Over the ``step`` ranges: the device's busy share (the union of all
kernels over the steps' wall time).

Per fused op (``mhc_cg::*`` operators run eagerly): calls and the device time of the kernels
launched inside them, on their thread. A fused op inside a captured graph launches nothing the
trace can tie to it (a graph replay is one launch): there the op is not timed here.

A CPU-only trace has no device: its top-level operators stand in for kernels (host time), and
``device`` says ``cpu``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from pathlib import Path

from mhc_cg.lab.profiling.traces import (KIND_CHROME_CPU, _load_chrome_json, read_timeline,
                                             union_ns)

# the phases a profile's device time is told by: a step's (mhc_cg.core.regions.PHASES) and
# "iteration", a captured iteration's replay, its forward, recompute and backward in one launch
PROFILED_PHASES = ("forward", "backward", "recompute", "iteration", "optimizer")
NS_PER_MS = 1e6


def _phase_of(name: str) -> str | None:
    if name.startswith("recompute"):
        return "recompute"
    return name if name in PROFILED_PHASES else None


def step_profile(trace: str | Path, steps: int) -> dict:
    """Per phase ``{gpu_ms, kernels}`` per step, the busy share over the ``step`` ranges and the
    fused ops' table (see the module docstring)."""
    timeline = read_timeline(trace)
    spans = sorted((r.start, r.end, _phase_of(r.name)) for r in timeline.ranges
                   if _phase_of(r.name) is not None)
    starts = [s for s, _, _ in spans]
    by_phase: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for work in timeline.work:
        phase = _innermost(spans, starts, work.launch_time)
        if phase is not None:
            by_phase[phase].append((work.start, work.end))
    step_ranges = [(r.start, r.end) for r in timeline.ranges if r.name == "step"]
    wall = sum(e - s for s, e in step_ranges)
    in_steps = [(w.start, w.end) for w in timeline.work
                if any(s <= w.launch_time <= e for s, e in step_ranges)]
    per = max(steps, 1)
    return {
        "device": "cpu" if timeline.kind == KIND_CHROME_CPU else "cuda",
        "steps": steps,
        "phases": {p: {"gpu_ms": union_ns(by_phase[p]) / NS_PER_MS / per,
                       "kernels": len(by_phase[p]) / per} for p in PROFILED_PHASES if by_phase[p]},
        "step_wall_ms": wall / NS_PER_MS / per,
        "busy_share": union_ns(in_steps) / wall if wall else None,
        "fused_ops": fused_ops(Path(trace), timeline, per),
    }


def _innermost(spans, starts, t: int) -> str | None:
    """The phase of the latest-opened range containing ``t``; a recompute range wins."""
    found = None
    for start, end, phase in reversed(spans[:bisect.bisect_right(starts, t)]):
        if end >= t:
            if phase == "recompute":
                return phase
            found = found or phase
    return found


def fused_ops(path: Path, timeline, per: int) -> dict[str, dict]:
    """``{op: {calls, device_ms, kernels, host_us_per_call}}`` per step for the ``mhc_cg::``
    operators of the trace (``host_us_per_call``: the operator's own time on its thread)."""
    data = _load_chrome_json(path)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    ops = [(round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000), (e.get("pid"), e.get("tid")),
            e["name"]) for e in events if isinstance(e, dict) and e.get("cat") == "cpu_op"
           and str(e.get("name", "")).startswith("mhc_cg::") and "dur" in e]
    table: dict[str, dict] = {}
    work = sorted(timeline.work, key=lambda w: w.launch_time)
    times = [w.launch_time for w in work]
    on_host = timeline.kind == KIND_CHROME_CPU
    for start, end, thread, name in ops:
        entry = table.setdefault(name, {"calls": 0, "spans": [], "host_ns": 0})
        entry["calls"] += 1
        entry["host_ns"] += end - start
        if on_host:  # the CPU is the device: the operator's own time
            entry["spans"].append((start, end))
            continue
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        entry["spans"] += [(w.start, w.end) for w in work[lo:hi] if w.launch_thread == thread]
    return {name: {"calls": e["calls"] / per, "device_ms": union_ns(e["spans"]) / NS_PER_MS / per,
                   "kernels": len(e["spans"]) / per,
                   "host_us_per_call": e["host_ns"] / 1e3 / max(e["calls"], 1)}
            for name, e in sorted(table.items())}
