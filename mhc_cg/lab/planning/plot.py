"""Every rank's timeline of a planned schedule: a Chrome/Perfetto trace and a PNG with buffer lifetimes.

The time axis is simulated, not measured. Each rank runs its order one pass at a time; a pass
starts when the rank is free and its pipeline dependency is done:

* the forward of virtual stage ``v = (chunk - 1) * pp + rank`` on microbatch m waits for the
  forward of stage ``v - 1`` on m (the previous rank, or the last rank's previous chunk);
* the backward of stage v waits for the backward of stage ``v + 1``, or for its own forward on
  the last stage.

Durations are in units of one layer's forward: ``backward_cost`` per layer backward and
``recompute_cost`` per layer of mHC recompute, which runs block by block, last block first, each
right before that block's backward. Communication is free. The picture is for reading the
order and the buffer lifetimes, not for predicting step time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.planning.planner import RankPlan

US_PER_UNIT = 1000.0  # trace microseconds per layer-forward unit


@dataclass
class TimedPass:
    """One chunk pass of one rank, placed in time; a backward carries its recompute segments."""

    rank: int
    index: int  # position in the rank's order
    chunk: int
    microbatch: int
    forward: bool
    start: float
    end: float
    static_inputs: list[int]  # buffer ids of the pass's graphed layers
    slot_set: int
    recompute: list[tuple[int, float, float]] = field(default_factory=list)  # (block, start, end)


def simulate_timeline(plans: list[RankPlan], backward_cost: float = 2.0,
                      recompute_cost: float = 0.3) -> list[list[TimedPass]]:
    """Place every rank's passes in time (see the module docstring); ranks in ``plans`` order."""
    pp = len(plans)
    vpp = max(abs(c) for c in plans[0].order)
    last_stage = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}  # (F|B, virtual stage, microbatch) -> end time
    clock = [0.0] * pp
    cursor = [0] * pp
    timed: list[list[TimedPass]] = [[] for _ in range(pp)]
    inputs = [_inputs_per_pass(p) for p in plans]
    sets = [_set_per_pass(p) for p in plans]
    while any(cursor[r] < len(plans[r].steps) for r in range(pp)):
        progressed = False
        for rank, rank_plan in enumerate(plans):
            while cursor[rank] < len(rank_plan.steps):
                index = cursor[rank]
                step = rank_plan.steps[index]
                stage = (step.chunk - 1) * pp + rank
                if step.forward:
                    needed = ("F", stage - 1, step.microbatch) if stage > 0 else None
                elif stage < last_stage:
                    needed = ("B", stage + 1, step.microbatch)
                else:
                    needed = ("F", stage, step.microbatch)
                if needed is not None and needed not in done:
                    break
                start = max(clock[rank], done[needed] if needed else 0.0)
                key = (step.chunk, step.microbatch)
                item = TimedPass(rank, index, step.chunk, step.microbatch, step.forward, start,
                                 start, inputs[rank][key], sets[rank][key])
                item.end = _place_pass(item, rank_plan, backward_cost, recompute_cost)
                done[("F" if step.forward else "B", stage, step.microbatch)] = item.end
                clock[rank] = item.end
                timed[rank].append(item)
                cursor[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: plans[r].order[cursor[r]] for r in range(pp) if cursor[r] < len(plans[r].steps)}
            raise ConfigError(f"schedule: the orders deadlock (next entry per rank: {stuck})")
    return timed


def _place_pass(item: TimedPass, rank_plan: RankPlan, backward_cost: float,
                recompute_cost: float) -> float:
    layers, size = rank_plan.layers_per_chunk, rank_plan.recompute_block_size
    if item.forward:
        return item.start + layers
    t = item.start
    for block in reversed(range(rank_plan.blocks_per_chunk)):
        block_layers = min(size, layers - block * size)
        item.recompute.append((block, t, t + recompute_cost * block_layers))
        t += (recompute_cost + backward_cost) * block_layers
    return t


def _inputs_per_pass(rank_plan: RankPlan) -> dict[tuple[int, int], list[int]]:
    ids: dict[tuple[int, int], list[int]] = {}
    for use in rank_plan.uses:
        if use.kind == "static_input":
            ids.setdefault((use.chunk, use.microbatch), []).append(use.buffer)
    return ids


def _set_per_pass(rank_plan: RankPlan) -> dict[tuple[int, int], int]:
    return {(u.chunk, u.microbatch): u.buffer for u in rank_plan.uses if u.kind == "persistent_set"}


def chrome_trace(plans: list[RankPlan], timeline: list[list[TimedPass]]) -> dict:
    """Chrome/Perfetto JSON: one process per rank; passes, recomputes and buffers-in-use counters."""
    events: list[dict] = []
    for rank, (rank_plan, passes) in enumerate(zip(plans, timeline)):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"pp rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        live_sets = 0
        for item in passes:
            kind = "forward" if item.forward else "backward"
            args = {"chunk": item.chunk, "microbatch": item.microbatch, "order_index": item.index,
                    "static_inputs": item.static_inputs, "slot_set": item.slot_set}
            events.append(_span(f"{kind} c{item.chunk} m{item.microbatch}", kind, rank,
                                item.start, item.end, args))
            for block, start, end in item.recompute:
                events.append(_span(f"recompute c{item.chunk} m{item.microbatch} b{block}",
                                    "recompute", rank, start, end,
                                    {"chunk": item.chunk, "microbatch": item.microbatch,
                                     "block": block, "slot_set": item.slot_set, "arena": 0}))
            live_sets += 1 if item.forward else -1
            moment = item.start if item.forward else item.end
            events.append({"ph": "C", "name": "buffers in use", "pid": rank, "tid": 0,
                           "ts": _us(moment),
                           "args": {"slot_sets": live_sets,
                                    "static_inputs": live_sets * rank_plan.layers_per_chunk}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"time_unit": "one layer forward = 1 ms (simulated)"}}


def _span(name: str, category: str, rank: int, start: float, end: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": category, "pid": rank, "tid": 0,
            "ts": _us(start), "dur": _us(end - start), "args": args}


def _us(units: float) -> float:
    return round(units * US_PER_UNIT, 3)  # whole nanoseconds: no float noise in the trace


def write_trace(plans: list[RankPlan], path: str | Path, **costs: float) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(plans, simulate_timeline(plans, **costs))))
    return path


def plot_schedule(plans: list[RankPlan], path: str | Path, title: str = "",
                  **costs: float) -> Path:
    """PNG: the pipeline timeline on top, then per rank each slot set's users over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = simulate_timeline(plans, **costs)
    pp = len(plans)
    heights = [0.55 * pp + 0.6] + [0.28 * p.persistent_slot_sets + 0.7 for p in plans]
    fig, axes = plt.subplots(len(heights), 1, figsize=(16, sum(heights) + 1.2), sharex=True,
                             gridspec_kw={"height_ratios": heights})
    colors = plt.get_cmap("tab10")
    top = axes[0]
    for rank, passes in enumerate(timeline):
        for item in passes:
            color = colors((item.chunk - 1) % 10)
            top.barh(rank, item.end - item.start, left=item.start, height=0.8, color=color,
                     alpha=1.0 if item.forward else 0.55, hatch=None if item.forward else "//",
                     edgecolor="black", linewidth=0.4)
            top.text((item.start + item.end) / 2, rank, str(item.microbatch), ha="center",
                     va="center", fontsize=6)
            for _, start, end in item.recompute:
                top.barh(rank + 0.3, end - start, left=start, height=0.2, color="crimson")
    top.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    top.invert_yaxis()
    top.set_title("pipeline timeline (simulated): solid = forward, hatched = backward, "
                  "red = mHC recompute; number = microbatch, colour = chunk", fontsize=9)
    for ax, rank_plan, passes in zip(axes[1:], plans, timeline):
        _plot_lifetimes(ax, rank_plan, passes, colors)
    axes[-1].set_xlabel("time (units of one layer forward)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(c % 10)) for c in range(_num_chunks(plans))]
    fig.legend(handles, [f"chunk {c + 1}" for c in range(len(handles))], loc="upper right",
               ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_lifetimes(ax, rank_plan: RankPlan, passes: list[TimedPass], colors) -> None:
    forward_start = {(p.chunk, p.microbatch): p.start for p in passes if p.forward}
    for item in passes:
        if item.forward:
            continue
        start = forward_start[(item.chunk, item.microbatch)]
        ax.barh(item.slot_set, item.end - start, left=start, height=0.75,
                color=colors((item.chunk - 1) % 10), edgecolor="black", linewidth=0.4, alpha=0.8)
        first, last = min(item.static_inputs), max(item.static_inputs)
        ax.text(start + 0.3, item.slot_set, f"m{item.microbatch} in {first}-{last}", va="center",
                fontsize=6)
    ax.set_yticks(range(rank_plan.persistent_slot_sets),
                  [f"set {s}" for s in range(rank_plan.persistent_slot_sets)], fontsize=7)
    ax.invert_yaxis()
    gib = 2 ** 30
    ax.set_title(
        f"rank {rank_plan.rank}: {rank_plan.persistent_slot_sets} persistent slot sets "
        f"({rank_plan.persistent_bytes / gib:.2f} GiB), {rank_plan.static_input_buffers} static "
        f"inputs with reuse ({rank_plan.static_input_buffers_no_reuse} without), arena "
        f"{rank_plan.arena_bytes / gib:.2f} GiB; bar = a set's user from forward to backward, "
        f"'in a-b' = its static input buffers", fontsize=8, loc="left")


def _num_chunks(plans: list[RankPlan]) -> int:
    return max(abs(c) for c in plans[0].order)
