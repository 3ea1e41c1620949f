"""The per-mode cost report behind ``mhc-cg cost``: kernels and bytes per training step, and
every captured graph with its kernels, bytes and pool peak.

Each mode is built as training builds it (:meth:`~mhc_cg.training.session.TrainSession.build`:
model, optimizer, captures) with the recording backend (:mod:`mhc_cg.lab.cost.cost_backend`),
on ``meta`` (nothing allocated: the benchmark shape on a laptop; attention as the GPU's fused
kernel, :mod:`mhc_cg.lab.cost.attention`) or on ``cpu``. Captures happen while the mode is
prepared, as in training (without warmup iterations: nothing is set up lazily here); then one
training step is recorded (:meth:`~mhc_cg.training.session.TrainSession.run_step`, the step
training runs): its eager ops (embedding, loss, MoE tail, optimizer, copies into static inputs)
through dispatch, each graph replay by the graph's recorded cost.

Meta tensors all have ``data_ptr() == 0``: everything here (and the runtime's arena and slot
checks) tells storages apart by :func:`mhc_cg.core.storage.storage_id`, never by address.
"""

from __future__ import annotations

import contextlib
import textwrap
from typing import Callable, Iterable

import torch

from mhc_cg.config import RunConfig, check
from mhc_cg.core.errors import ConfigError
from mhc_cg.core import regions
from mhc_cg.core.progress import log
from mhc_cg.lab.registry import MODES, PLAIN
from mhc_cg.training.run import Run
from mhc_cg.lab.resolve import refusal, resolve
from mhc_cg.lab.cost.attention import fused_attention_on_meta
from mhc_cg.lab.cost.attribution import (REFERENCE_C, by_phase_and_part, copies, mhc_traffic_c,
                                     recompute_bound_bytes)
from mhc_cg.core.storage import storage_id
from mhc_cg.lab.cost.allocator import rounded
from mhc_cg.lab.cost.measured import last_measured_steps
from mhc_cg.lab.cost.op_counters import StepRecorder, StreamTracker, owner_text
from mhc_cg.lab.cost.cost_backend import CostBackend
from mhc_cg.lab.cost.step_model import Band, StepModel, step_model
from mhc_cg.training.session import TrainSession, optimizer_for

DEVICES = ("meta", "cpu")
PAPER_OVERHEAD = 0.067  # the mHC paper's training-time overhead at n = 4 (section 4.3)
RECOMPUTE_POOL_LIMIT = 1.25   # a recompute graph's pool peak, in arenas
STATIC_MEMORY_LIMIT = 0.75    # graphed_static's graph memory, in graphed_none's (both below)


def mode_configs(cfg: RunConfig, device: str) -> tuple[list[tuple[str, Run]], dict[str, str]]:
    """``(mode, its run)`` for every registered mode that can be costed on ``device``, and why
    the others cannot. The graphs are captured on the recording backend whatever the config's,
    so ``graph.backend`` is left to ``auto`` (a config meant for a GPU is costed anywhere), but
    for ``te``: TransformerEngine's own function then captures, over the recording backend."""
    backend = "te" if cfg.graph.backend == "te" else "auto"
    cfg = check(cfg.replace(graph={"backend": backend}))
    costed, skipped = [], {}
    for mode in MODES.values():
        if (reason := refusal(cfg, mode.name, device)) is not None:
            skipped[mode.name] = reason
        else:
            costed.append((mode.name, resolve(cfg, mode.name, device)))
    return costed, skipped


def cost_mode(run: Run,
              optimizer: Callable[[RunConfig, Iterable], object] = optimizer_for,
              model: StepModel | None = None) -> dict:
    """The cost of one ``run`` (:func:`mode_configs`; its device ``meta`` or ``cpu``): one
    training step as training runs it (:meth:`TrainSession.run_step`), its optimizer included,
    timed by ``model`` (default: the step model of the default GPU, the H100). The capture
    backend is ours (recording), whatever the plan's. ``optimizer``: the session's optimizer
    factory (the back-test's costs another one)."""
    cfg, dev = run.cfg, run.device
    model = step_model() if model is None else model
    meta = dev.type == "meta"
    streams = StreamTracker(cfg.model.num_streams * cfg.model.hidden_size)
    backend = CostBackend(dev.type, streams, model)

    def laid_out(cfg: RunConfig, params: Iterable) -> object:
        # the flat buffers hold every parameter and gradient: no stream storage, before capture
        made = optimizer(cfg, params)
        streams.exclude(made.state_tensors())
        return made

    with contextlib.ExitStack() as stack:
        if meta:
            stack.enter_context(fused_attention_on_meta())
        with torch.device(dev) if meta else contextlib.nullcontext():
            session = TrainSession.build(run, backend=backend, optimizer=laid_out)
        with backend.recording_step(dev) as recorder:
            session.run_step()
    mode_model = session.mode_model
    graphs = _graph_entries(mode_model, backend, cfg)
    info = mode_model.describe()
    pool_reserved = sum(p.state.high_water for p in backend.pools)
    memory = peak_memory(session, info, mode_model.static_buffer_bytes(), pool_reserved,
                         recorder.live.peak)
    held = sum(memory.values()) - memory["step"]  # model state, static buffers, pools: all step
    # a phase that ran only inside a graph (a captured iteration's backward) holds the pools
    by_phase = {phase: held + recorder.live.peak_by_phase.get(phase, 0) for phase in regions.PHASES
                if phase in recorder.live.peak_by_phase or recorder.kernels_by_phase[phase]}
    peak_phase = max(by_phase, key=by_phase.get)
    if mode_model.captures_iteration:  # forward, recompute and backward: one replay
        by_phase["iteration"] = max(b for p, b in by_phase.items() if p != "optimizer")
        if by_phase["iteration"] >= by_phase.get("optimizer", 0):
            peak_phase = "iteration"
    return {
        **_step_figures(recorder, cfg, model),
        "graphs": graphs,
        "pools": len(backend.pools),
        "pool_reserved_bytes": pool_reserved,
        # what the pools hold allocated after the step (max_memory_allocated counts this much
        # of them; they reserve pool_reserved_bytes)
        "pool_live_bytes": sum(b.nbytes for p in backend.pools for b in p.state.live_resident()),
        "arena_bytes": info.get("arena_bytes"),
        "persistent_bytes_per_microbatch": info.get("persistent_bytes_per_microbatch"),
        "static_buffer_bytes": mode_model.static_buffer_bytes(),
        "peak_bytes": sum(memory.values()),
        "peak_memory": memory,
        "peak_bytes_by_phase": by_phase,
        "peak_phase": peak_phase,
        "step_peak_by_phase": {phase: recorder.live.peak_by_phase[phase]
                               for phase in regions.PHASES if phase in recorder.live.peak_by_phase},
        "step_temporaries_by_phase": dict(recorder.live.largest_by_phase),
        "live_at_peak": live_at_peak(memory, info, mode_model.static_buffer_bytes(), backend,
                                     recorder.live.live_at_peak,
                                     {g.name: n for n, _, g in mode_model.named_graphs()}),
    }


def _grouped(entries, top: int = 6) -> list[list]:
    """``[(name, bytes)]`` summed by name (``x k`` where ``k`` storages), the ``top`` largest,
    the rest as one entry."""
    sums: dict[str, list] = {}
    for name, nbytes in entries:
        entry = sums.setdefault(name, [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    ranked = sorted(sums.items(), key=lambda e: -e[1][0])
    rest = sum(n for _, (n, _) in ranked[top:])
    return [[name if k == 1 else f"{name} x {k}", n] for name, (n, k) in ranked[:top]] + \
        ([[f"{len(ranked) - top} more", rest]] if rest else [])


def live_at_peak(memory: dict, info: dict, static_buffers: int | None, backend: CostBackend,
                 eager: list[tuple[tuple | None, int]], labels: dict[str, str]) -> dict:
    """What is live at the peak, by holder: the static buffers one by one, each pool's
    high-water mark with the capture that set it and the tensors live then (by the graph that
    made them and the op), and the step's eager storages at their most (by the op that made
    them). The sums are :func:`peak_memory`'s; ``labels``: a capture's name in the mode's words
    (``L7.mlp bwd``)."""
    sets = info.get("persistent_sets", 0)
    static = {"arena": info.get("arena_bytes") or 0,
              f"persistent sets ({sets})": (info.get("persistent_bytes_per_microbatch") or 0) * sets,
              "graphs' static buffers": static_buffers or 0}
    pools = [{"pool": pool.id, "high_water": pool.state.high_water,
              "set_by": labels.get(pool.state.high_water_graph, pool.state.high_water_graph),
              "live": _grouped((owner_text(what), n)
                               for _, what, n in pool.state.high_water_live)}
             for pool in backend.pools]
    return {"model_state": memory["model_state"], "static": static, "pools": pools,
            "eager": _grouped((owner_text(made), n) for made, n in eager)}


def format_live(report: dict) -> list[str]:
    """``mhc-cg cost --live``: each mode's peak by holder (:func:`live_at_peak`)."""
    lines = ["", "what is live at the peak (the allocator emulation; pools reserve their "
                 "high-water mark for good, so a pool counts whole whenever its mark was set)"]
    for name, mode in report["modes"].items():
        live = mode["live_at_peak"]
        lines += ["", f"{name}: {_size(mode['peak_bytes'])} at {mode['peak_phase']}",
                  f"  model state                  {_size(live['model_state']):>12}"]
        for what, nbytes in live["static"].items():
            if nbytes:
                lines.append(f"  static: {what:<20} {_size(nbytes):>12}")
        for pool in live["pools"]:
            lines.append(f"  pool {pool['pool']}: high-water mark     {_size(pool['high_water']):>12}"
                         f"  set by {pool['set_by']}")
            lines += [f"      {_size(n):>12}  {what}" for what, n in pool["live"]]
        step = mode["peak_memory"]["step"]
        lines.append(f"  eager, the step's most       {_size(step):>12}")
        lines += [f"      {_size(n):>12}  {what}" for what, n in live["eager"]]
    return lines


def _step_figures(recorder: StepRecorder, cfg: RunConfig, model: StepModel) -> dict:
    """Kernels, bytes and modelled time of a recorded step, in all and per phase and part (each
    time a band: :class:`~mhc_cg.lab.cost.step_model.Band` as ``{"low", "high"}``)."""
    eager, graphed = recorder.eager, recorder.graphs
    phases = [p for p in (*regions.PHASES, "other") if recorder.kernels_by_phase[p]]
    return {
        "kernels_per_step": recorder.kernels,
        "kernels_by_phase": dict(recorder.kernels_by_phase),
        "bytes_per_step": recorder.bytes,
        "eager_kernels_per_step": eager.kernels,
        "eager_bytes_per_step": eager.bytes,
        "host_ops_per_step": recorder.host_ops,
        "graph_replays_per_step": recorder.replays,
        "top_eager_kernels": dict(eager.by_op.most_common(8)),
        # the fused mHC ops, eager and inside graphs: kernels and bytes per step
        "fused_ops": {op.replace(".", "::", 1): {
            "kernels": eager.by_op[op] + graphed.by_op[op],
            "bytes": eager.bytes_by_op[op] + graphed.bytes_by_op[op]}
            for op in sorted(set(eager.by_op) | set(graphed.by_op)) if op.startswith("mhc_cg.")},
        "flops_per_step": eager.flops + graphed.flops,
        "step_s": model.step_seconds(eager.model_seconds + graphed.model_seconds,
                                     eager.kernels, recorder.replays).as_dict(),
        # of it, the kernels bound by their bytes (the rest: by FLOPs, and launches)
        "bandwidth_bound_s": (eager.bandwidth_seconds + graphed.bandwidth_seconds).as_dict(),
        # per phase: its kernels' time (a graph's where it was captured) and its launches
        "step_s_by_phase": {
            p: model.step_seconds(eager.seconds_by_phase[p] + graphed.seconds_by_phase[p],
                                  eager.by_phase[p], recorder.replays_by_phase[p]).as_dict()
            for p in phases},
        # ... its kernels' time alone (what a profiler's kernel intervals measure)
        "kernel_s_by_phase": {p: (eager.seconds_by_phase[p] + graphed.seconds_by_phase[p]
                                  + Band()).as_dict() for p in phases},
        "bytes_by_phase_and_part": by_phase_and_part(recorder.by_part),
        "mhc_traffic_C": mhc_traffic_c(recorder.by_part, cfg),
        "copy_bytes_per_step": copies(recorder.by_part),
    }


def model_state_tensors(session: TrainSession) -> list[torch.Tensor]:
    """What training holds from step to step: the model's parameters and buffers, and every
    tensor its optimizer keeps (main parameters, moments, gradients, staging)."""
    model = session.model
    return [*model.parameters(), *model.buffers(), *session.optimizer.state_tensors()]


def peak_memory(session: TrainSession, info: dict, static_buffers: int | None, pools: int,
                step_peak: int) -> dict[str, int]:
    """The device's peak over a step, by what holds it (the allocator emulation's view):
    ``model_state`` (:func:`model_state_tensors`: distinct storages, in 512-byte blocks),
    ``static`` (the runtime's arena, its persistent sets and the graphs' static buffers,
    allocated once), ``graph_pools`` (what the pools reserve: their high-water marks, never given
    back) and ``step`` (the most that the step's eager ops hold at once: activations autograd
    saved, gradients, temporaries; :class:`~mhc_cg.lab.cost.op_counters.LiveBytes`)."""
    storages = {storage_id(t): rounded(t.untyped_storage().nbytes())
                for t in model_state_tensors(session)}
    static = ((info.get("arena_bytes") or 0)
              + (info.get("persistent_bytes_per_microbatch") or 0) * info.get("persistent_sets", 0)
              + (static_buffers or 0))
    return {"model_state": sum(storages.values()), "static": static, "graph_pools": pools,
            "step": step_peak}


def _graph_entries(mode_model, backend: CostBackend, cfg: RunConfig) -> list[dict]:
    """Every captured graph in capture order; a recompute graph with its bound beside it."""
    names = {id(graph): (name, kind) for name, kind, graph in mode_model.named_graphs()}
    entries = []
    for graph in backend.captured:
        name, kind = names.get(id(graph), (graph.name, "forward"))
        entry = {"name": name, "kind": kind, "kernels": graph.cost.kernels,
                 "bytes": graph.cost.bytes, "pool_peak_bytes": graph.peak.peak_bytes,
                 "pool_held_peak_bytes": graph.peak.held_peak_bytes,
                 "pool_resident_bytes": graph.peak.resident_before,
                 "escaped_bytes": graph.peak.escaped_bytes, "pool": graph.pool.id}
        if kind == "recompute":
            block = int(name.split()[2])
            records = mode_model.runtime.layout.blocks[block]
            bound = recompute_bound_bytes(cfg, len(mode_model.runtime.layout.block_layers(block)),
                                          sum(r.recompute_activation for r in records))
            entry.update(bound_bytes=bound, over_bound=graph.cost.bytes / bound)
        entries.append(entry)
    return entries


def checks(modes: dict) -> list[dict]:
    """The memory budgets of static recompute, where both graphed modes were costed."""
    static, none = modes.get("graphed_static"), modes.get("graphed_none")
    if static is None or none is None or not static["arena_bytes"]:
        return []
    arena = static["arena_bytes"]
    recompute = [g for g in static["graphs"] if g["kind"] == "recompute"]
    # a recompute graph's own need: its peak above what the pool already held live when its capture
    # began (other graphs' saved activations, when it shares the sublayer graphs' pool)
    worst = max((max(g["pool_peak_bytes"], g["pool_held_peak_bytes"]) - g["pool_resident_bytes"]
                 for g in recompute), default=0)
    # Everything each mode keeps for its graphs, static buffers outside the pools included:
    # graphed_none's static inputs are the streams its backward graphs read (its saved x), while
    # graphed_static's alias its arena and persistent set (storages counted once).
    total = (static["pool_reserved_bytes"] + arena + static["persistent_bytes_per_microbatch"]
             + static["static_buffer_bytes"])
    base = none["pool_reserved_bytes"] + none["static_buffer_bytes"]
    ratio = total / base if base else None
    found = [
        {"check": f"every recompute graph's pool peak (above the pool's live bytes before it) <= "
                  f"{RECOMPUTE_POOL_LIMIT} x arena",
         "value": worst / arena, "limit": RECOMPUTE_POOL_LIMIT,
         "ok": worst <= RECOMPUTE_POOL_LIMIT * arena},
        {"check": f"graphed_static pools + arena + persistent / microbatch + static buffers <= "
                  f"{STATIC_MEMORY_LIMIT} x graphed_none pools + static buffers",
         "value": ratio, "limit": STATIC_MEMORY_LIMIT,
         "ok": ratio is not None and ratio <= STATIC_MEMORY_LIMIT},
    ]
    block = modes.get("eager_block")
    if block is not None:  # the mode this project exists for keeps no more than eager recompute
        found.append({"check": "graphed_static peak <= eager_block peak",
                      "value": static["peak_bytes"] / block["peak_bytes"], "limit": 1.0,
                      "ok": static["peak_bytes"] <= block["peak_bytes"]})
    return found


def cost_report(cfg: RunConfig, device: str, config_name: str | None = None,
                measured: bool = True, gpu: str | None = None) -> dict:
    """Every mode's cost (:func:`cost_mode`) and the budget checks, timed on ``gpu`` (default the
    H100). ``measured``: the step model of the committed measurements
    (:func:`~mhc_cg.lab.cost.step_model.step_model`: a band until this code's kernels are timed);
    else every kernel at the HBM peak. The report says which GPU, where each figure comes from,
    and the newest measured step of the config's shape."""
    if device not in DEVICES:
        raise ConfigError(f"--device: must be one of {list(DEVICES)}, got {device!r}")
    if device == "meta" and cfg.model.is_moe:
        raise ConfigError("--device meta: a MoE model's dispatch reads its token counts on the "
                          "host, which meta tensors do not have; cost MoE configs with --device cpu")
    model = step_model(gpu, full_bandwidth=not measured)
    costed, skipped = mode_configs(cfg, device)
    modes = {}
    for index, (name, run) in enumerate(costed, 1):
        log("cost", f"{name}: building and recording one step ({index}/{len(costed)})")
        modes[name] = cost_mode(run, model=model)
    plain = modes.get(PLAIN)
    for m in modes.values():  # the paper's headline: a step's cost over the plain residual's
        m["mhc_overhead"] = (None if plain is None else
                             (step_band(m) / step_band(plain) + -1.0).as_dict())
    return {"config": config_name, "device": device, "gpu": model.describe(), "modes": modes,
            "skipped": skipped, "checks": checks(modes),
            "measured_steps": last_measured_steps(cfg, gpu=model.gpu.key)}


def step_band(mode: dict) -> Band:
    """A costed mode's modelled step, in seconds."""
    return Band(**mode["step_s"])


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def format_report(report: dict, per_graph: bool = True) -> str:
    """One summary table over the modes, then one table of graphs per graphed mode."""
    lines = [f"cost of {report['config'] or 'the config'} on {report['device']}, modelled on "
             f"{report['gpu']['name']} (per training step)",
             "",
             f"{'mode':20} {'kernels':>8} {'eager':>6} {'replays':>7} {'bytes':>11} "
             f"{'graphs':>6} {'pools':>5} {'pool reserved':>13} {'arena':>10} {'persistent/mb':>13} "
             f"{'static bufs':>11}",
             "-" * 118]
    for name, m in report["modes"].items():
        lines.append(f"{name:20} {m['kernels_per_step']:>8} {m['eager_kernels_per_step']:>6} "
                     f"{m['graph_replays_per_step']:>7} {_size(m['bytes_per_step']):>11} "
                     f"{len(m['graphs']):>6} {m['pools']:>5} {_size(m['pool_reserved_bytes']):>13} "
                     f"{_size(m['arena_bytes']):>10} {_size(m['persistent_bytes_per_microbatch']):>13} "
                     f"{_size(m['static_buffer_bytes']):>11}")
    lines += ["", *format_frontier(report), *format_overhead(report), "",
              *format_traffic(report), "", *format_measured(report)]
    for name, reason in report.get("skipped", {}).items():
        lines.append(f"{name}: not costed on {report['device']}: {reason}")
    for c in report["checks"]:
        value = "-" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {value}")
    if not per_graph:
        return "\n".join(lines)
    for name, m in report["modes"].items():
        if not m["graphs"]:
            continue
        lines += ["", f"{name}: graphs in capture order",
                  f"{'graph':28} {'kind':9} {'kernels':>7} {'bytes':>11} {'pool':>4} "
                  f"{'pool peak':>10} {'held peak':>10} {'escaped':>10}",
                  "-" * 96]
        for g in m["graphs"]:
            lines.append(f"{g['name']:28} {g['kind']:9} {g['kernels']:>7} {_size(g['bytes']):>11} "
                         f"{g['pool']:>4} {_size(g['pool_peak_bytes']):>10} "
                         f"{_size(g['pool_held_peak_bytes']):>10} {_size(g['escaped_bytes']):>10}")
    return "\n".join(lines)


def _ms(band: Band) -> str:
    return band.scaled(1e3).format(".2f", " ms")


def _ratios(band: Band, other: dict | None) -> str:
    return "-" if other is None else (band / step_band(other)).format(".3f")


def _gpu_column(report: dict) -> str:
    return f"{report['gpu']['key'].upper()} step (model)"


def format_frontier(report: dict) -> list[str]:
    """Memory against time, one row per mode: the device's peak over a step by what holds it,
    the bytes the step moves and its modelled time
    (a band: Note [the step is a band until the kernels are measured])."""
    modes = report["modes"]
    reference = modes.get("eager_none")
    lines = ["memory and time per step: peak on the device (allocator emulation) = model state + "
             "static buffers + graph pools + the step's eager allocations at their most; at: the "
             "phase it is reached in; fwd+bwd: the peak before the optimizer runs; step: low-high",
             f"{'mode':20} {'peak':>10} {'at':>9} {'fwd+bwd':>10} {'model state':>11} "
             f"{'static':>10} {'graph pools':>11} {'step':>10} {'bytes':>10} "
             f"{_gpu_column(report):>21} {'/eager_none':>11}",
             "-" * 142]
    for name, m in modes.items():
        mem, step = m["peak_memory"], step_band(m)
        lines.append(f"{name:20} {_size(m['peak_bytes']):>10} {m['peak_phase']:>9} "
                     f"{_size(peak_before_optimizer(m)):>10} {_size(mem['model_state']):>11} "
                     f"{_size(mem['static']):>10} {_size(mem['graph_pools']):>11} "
                     f"{_size(mem['step']):>10} {_size(m['bytes_per_step']):>10} "
                     f"{_ms(step):>21} {_ratios(step, reference):>11}")
    return lines


def overhead_text(overhead: dict) -> str:
    """An mHC overhead band: ``+2.4% to +111.0%``, or one figure."""
    low, high = f"{overhead['low']:+.1%}", f"{overhead['high']:+.1%}"
    return low if low == high else f"{low} to {high}"


def format_overhead(report: dict) -> list[str]:
    """Each mode's modelled mHC overhead beside the paper's."""
    rows = [(name, m["mhc_overhead"]) for name, m in report["modes"].items()
            if m.get("mhc_overhead") is not None and name != PLAIN]
    if not rows:
        return []
    return [f"mHC overhead (modelled step / {PLAIN}'s - 1, low to high; the paper: "
            f"{PAPER_OVERHEAD:.1%}): " + ", ".join(f"{name} {overhead_text(value)}"
                                                  for name, value in rows)]


def _rate(value: float, unit: str) -> str:
    return f"{value / 1e12:.{2 if unit == 'TB/s' else 0}f} {unit}"


def format_model(gpu: dict) -> list[str]:
    """Which GPU the step is modelled on and where each figure it charges comes from."""
    figures = gpu["figures"]
    lines = [f"step model: {gpu['name']} (--gpu {gpu['key']}): each kernel max(bytes / bandwidth, "
             f"FLOPs / dense bf16), + {gpu['eager_launch_s'] * 1e6:.0f} us per eager launch, + "
             f"{gpu['graph_launch_s'] * 1e6:.0f} us per graph replay",
             f"  bytes at {_rate(gpu['copy_charged']['value'], 'TB/s')}: "
             f"{gpu['copy_charged']['source']}"]
    for what, unit in (("dense bf16", "TFLOP/s"), ("dense TF32", "TFLOP/s"),
                       ("HBM bandwidth", "TB/s")):
        lines.append(f"  {what}: {_rate(figures[what]['value'], unit)} ({figures[what]['source']})")
    groups: dict[tuple, list[str]] = {}
    for op, c in gpu["fused"].items():
        groups.setdefault((c["low"], c["high"], c["source"]), []).append(op.split("::")[1])
    if not groups:
        lines.append("  fused mHC ops: at the same bandwidth as every other kernel")
    for (low, high, source), ops in groups.items():
        share = f"{low:.1%}" if low == high else f"{low:.0%} (low) to {high:.1%} (high)"
        lines += textwrap.wrap(f"fused {', '.join(ops)}: {share} of it; {source}", 100,
                               initial_indent="  ", subsequent_indent="      ")
    if not gpu["one_figure"]:
        lines.append("  the step is a band until this code's fused kernels are timed on this GPU "
                     "(mhc-cg kernels --bench, folded in: bench/README.md)")
    return lines


def format_measured(report: dict) -> list[str]:
    """The step model's GPU and figures; the newest measured step of this shape beside the
    modelled one."""
    lines = format_model(report["gpu"])
    steps = report.get("measured_steps") or {}
    if not steps:
        return lines + [f"no {report['gpu']['key'].upper()} has measured a step at this shape "
                        f"(bench/results/): every step time here is modelled only"]
    lines += ["", f"last measured step at this shape: {steps['source']} ({steps['device']}, "
                  f"code {steps['code']}; its optimizer and kernels may predate this code: "
                  f"docs/cost.md's back-test costs that run's own step)"]
    lines.append(f"{'mode':20} {'modelled':>21} {'measured':>10} {'measured / modelled':>20}")
    for name, m in report["modes"].items():
        model = step_band(m).scaled(1e3)
        got = steps["modes"].get(name)
        ratio = "-" if got is None else Band(got / model.high, got / model.low).format(".2f")
        lines.append(f"{name:20} {_ms(step_band(m)):>21} "
                     + ("         -" if got is None else f"{got:>7.2f} ms {ratio:>20}"))
    return lines


def peak_before_optimizer(mode: dict) -> int:
    """A mode's device peak over its forward, recompute and backward: its peak with an optimizer
    that allocates nothing (a fused one, on gradients already in place)."""
    return max(b for phase, b in mode["peak_bytes_by_phase"].items() if phase != "optimizer")


def format_traffic(report: dict) -> list[str]:
    """The mHC traffic per token and sublayer (C) beside the references, bytes per step by part,
    the runtime's copies and the modelled step time, one row per mode."""
    modes = report["modes"]
    reference = modes.get("eager_none")
    lines = ["mHC traffic per token and sublayer, in C (one C-wide row); " + "; ".join(
                 f"{name}: {value:g}C" for name, value in REFERENCE_C.items()),
             f"{'mode':20} {'forward':>8} {'recompute':>9} {'backward':>8} {'total':>7} "
             f"{_gpu_column(report):>21} {'of it bandwidth-bound':>21} {'/eager_none':>11} "
             f"{'/eager_block':>12}",
             "-" * 126]
    block = modes.get("eager_block")
    for name, m in modes.items():
        c, step = m["mhc_traffic_C"], step_band(m)
        lines.append(f"{name:20} {c['forward']:>8.1f} {c['recompute']:>9.1f} {c['backward']:>8.1f} "
                     f"{c['total']:>7.1f} {_ms(step):>21} {_ms(Band(**m['bandwidth_bound_s'])):>21} "
                     f"{_ratios(step, reference):>11} {_ratios(step, block):>12}")
    lines += ["", "bytes per step by part (all phases)"]
    parts = sorted({part for m in modes.values() for phase in m["bytes_by_phase_and_part"].values()
                    for part in phase})
    lines.append(f"{'part':34}" + "".join(f"{name:>20}" for name in modes))
    for part in parts:
        row = [sum(phase.get(part, 0) for phase in m["bytes_by_phase_and_part"].values())
               for m in modes.values()]
        lines.append(f"{part:34}" + "".join(f"{_size(b):>20}" for b in row))
    for name, m in modes.items():
        bounded = [g for g in m["graphs"] if "bound_bytes" in g]
        if bounded:
            worst = max(bounded, key=lambda g: g["over_bound"])
            graphs = "graph" if len(bounded) == 1 else "graphs"
            lines.append(f"{name}: {len(bounded)} recompute {graphs}, each {_size(worst['bytes'])} "
                         f"against a bound of {_size(worst['bound_bytes'])} (worst "
                         f"{worst['over_bound']:.2f} x bound)")
    return lines
