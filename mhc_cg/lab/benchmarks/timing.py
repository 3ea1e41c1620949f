"""One mode of ``mhc-cg bench``, alone in its process: built, warmed up, timed, profiled.

``python -m mhc_cg.lab.benchmarks.timing SPEC.json OUT.json`` (the bench starts it; ``SPEC`` holds the
shape's config, the mode and the options). A fresh process means a fresh CUDA context and
allocator: the peaks are torch's own counters since the process began (build and capture
included), nothing subtracted. Per mode:

* ``step_ms``: per timed step, CUDA events around it (wall clock on the CPU); each step ends in
  its one read back (:meth:`~mhc_cg.training.session.TrainSession.step`);
* ``peak_allocated_bytes`` / ``peak_reserved_bytes``: ``torch.cuda.max_memory_allocated`` /
  ``max_memory_reserved`` (``None`` on the CPU);
* ``profile``: ``profile_steps`` more steps under torch.profiler, read by
  :func:`~mhc_cg.lab.profiling.phases.step_profile`: device ms per phase, the busy share of
  the step, and the fused ops' device time;
* ``fused_ops``: per fused op, calls and device ms (profile) beside the bytes the cost model gives
  it at this shape and mode, the achieved GB/s and its share of the copy bandwidth measured here;
* a recompute graph's replay time beside its lower bound (graphed static modes).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.regions import region
from mhc_cg.core.progress import log
from mhc_cg.lab.registry import get_mode
from mhc_cg.lab.resolve import refusal, resolve
from mhc_cg.training.session import TrainSession


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_repeated(fn, repeats: int, device: torch.device) -> float:
    """Seconds per call of ``fn``, over ``repeats`` back-to-back calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - begin) / repeats


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes per second: ``dst.copy_(src)`` of ``nbytes`` reads
    ``nbytes`` and writes ``nbytes``, so each copy counts ``2 * nbytes``."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):  # warm-up: first-touch page faults, kernel load
        dst.copy_(src)
    synchronize(device)
    seconds = time_repeated(lambda: dst.copy_(src), repeats, device)
    return 2 * nbytes / seconds


def recompute_traffic(mode_model, block: int = 0) -> dict[str, int]:
    """Bytes the recompute of ``block`` must move at least, from a prepared static-recompute mode.

    An approximation: each byte read or written once, temporaries in cache (none spill), so
    ``read`` = the block's persistent inputs (x_l0, every sublayer's F output, the dropout seed,
    and fc1's output where activation recompute keeps it)
    + its mHC parameters (``HyperConnection`` and the pre-F RMSNorm weight of each sublayer), and
    ``write`` = the arena (one block's transient state; the arena is sized by the first block).
    """
    runtime = mode_model.runtime
    pset = runtime.sets.template
    records = runtime.layout.blocks[block]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    inputs = nbytes(pset.block_inputs[block]) + nbytes(pset.seed) + sum(
        nbytes(pset.fn_outputs[record.key]) for record in records)
    # with activation recompute the block also re-derives the gelu output from fc1's output
    inputs += sum(nbytes(pset.fc1_outputs[record.index]) for record in records
                  if record.recompute_activation)
    params = sum(nbytes(p) for record in records for module in (record.sub.hc, record.sub.norm)
                 for p in module.parameters())
    write = runtime.arena.nbytes
    return {"read_inputs": inputs, "read_params": params, "write_arena": write,
            "total": inputs + params + write}


def lower_bound_seconds(total_bytes: int, bandwidth: float) -> float:
    """Time to move ``total_bytes`` (read + written) at ``bandwidth`` bytes per second."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    return total_bytes / bandwidth


def recompute_timing(session: TrainSession, bandwidth: float, replays: int) -> dict:
    """Replay one recompute graph (block 0, set 0) ``replays`` times; its bound from traffic."""
    runtime = session.mode_model.runtime
    graphs = runtime.recompute_graphs if runtime is not None else None
    if not graphs:
        return {}
    graph = graphs[(0, 0)]
    # the recompute graphs may share the sublayer graphs' pool, whose order a lone replay breaks;
    # the timing runs after the mode's last step
    with graph.pool.order.unchecked():
        for _ in range(2):
            graph.replay()
        synchronize(session.device)
        seconds = time_repeated(graph.replay, replays, session.device)
    traffic = recompute_traffic(session.mode_model, 0)
    return {"recompute_graph_ms": 1000.0 * seconds,
            "recompute_lower_bound_ms": 1000.0 * lower_bound_seconds(traffic["total"], bandwidth),
            "recompute_bytes": traffic, "recompute_replays": replays}


def profiled(session: TrainSession, steps: int, trace_dir: Path | None) -> dict:
    """``steps`` steps under torch.profiler, read per phase and per fused op."""
    from torch.profiler import ProfilerActivity, profile

    from mhc_cg.lab.profiling.phases import step_profile

    activities = [ProfilerActivity.CPU]
    if session.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with region("step"):
                session.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(trace_dir or tmp) / f"{session.plan.mode}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        return step_profile(path, steps)


def modelled_fused_ops(cfg: RunConfig, mode: str) -> dict[str, dict] | None:
    """The cost model's kernels and bytes per step of each fused op at this shape and mode
    (costed on ``meta``), or ``None`` where a mode cannot be costed there."""
    from mhc_cg.lab.cost.report import cost_mode

    cfg = cfg.replace(graph={"backend": "auto"})  # the cost model's backend records, anywhere
    if refusal(cfg, mode, "meta") is not None:
        return None
    return cost_mode(resolve(cfg, mode, "meta"))["fused_ops"]


def fused_op_table(fused: dict, modelled: dict | None, bandwidth: float) -> list[dict]:
    """Per fused op timed (``fused_ops`` of a profile: calls, device ms, host us per call): with
    the cost model's bytes, the GB/s achieved and its share of the copy bandwidth."""
    rows = []
    for op, timed in fused.items():
        nbytes = (modelled or {}).get(op, {}).get("bytes")
        seconds = timed["device_ms"] / 1e3
        achieved = nbytes / seconds if nbytes and seconds else None
        rows.append({"op": op, **timed, "bytes": nbytes,
                     "gb_per_s": None if achieved is None else achieved / 1e9,
                     "share_of_copy": None if achieved is None else achieved / bandwidth})
    return rows


def measure(spec: dict) -> dict:
    """What the module docstring lists, for the mode and config of ``spec``."""
    device = torch.device(spec["device"])
    mode = spec["mode"]
    run = resolve(RunConfig.from_dict(spec["config"]), mode, device,
                  moe_experts=spec["moe_experts"], moe_top_k=spec["moe_top_k"])
    cfg = run.cfg
    torch.manual_seed(cfg.train.seed)
    bandwidth = copy_bandwidth(device, spec["bandwidth_bytes"])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    begin = time.perf_counter()
    log("bench", f"{mode}: building{' and capturing graphs' if get_mode(mode).graphed else ''}")
    session = TrainSession.build(run)
    build_s = time.perf_counter() - begin
    for _ in range(spec["warmup"]):
        session.step()
    losses, step_ms, wall_ms = [], [], []
    for index in range(spec["steps"]):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        loss, _ = session.step()  # ends in its read back
        wall = time.perf_counter() - begin
        if device.type == "cuda":
            end.record()
            end.synchronize()
            step_ms.append(start.elapsed_time(end))
        else:
            step_ms.append(1e3 * wall)
        wall_ms.append(1e3 * wall)
        losses.append(loss)
    log("bench", f"{mode}: {spec['steps']} steps, median {statistics.median(step_ms):.2f} ms; "
                 f"profiling {spec['profile_steps']}")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    profile = profiled(session, spec["profile_steps"], spec.get("trace_dir"))
    t = cfg.train
    tokens = t.micro_batch_size * t.num_microbatches * cfg.model.seq_length
    entry = {
        "pid": os.getpid(), "device": device.type, "build_s": build_s,
        "peak_allocated_bytes": peak, "peak_reserved_bytes": reserved,
        "step_ms": step_ms, "step_ms_median": statistics.median(step_ms),
        "wall_ms": wall_ms, "tokens_per_s": tokens / (statistics.median(step_ms) / 1e3),
        "losses": losses, "copy_bandwidth_bytes_per_s": bandwidth,
        "profile": {k: v for k, v in profile.items() if k != "fused_ops"},
        "fused_ops": fused_op_table(profile["fused_ops"], modelled_fused_ops(cfg, mode), bandwidth),
        # what captured the graphs: mhc_cg's make_graphed_callables or TE's (file and sha256)
        "capture": (session.mode_model.capture_api().source() if session.mode_model.graphed
                    else None),
    }
    entry.update(recompute_timing(session, bandwidth, spec["recompute_replays"]))
    return entry


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = argv if argv is not None else sys.argv[1:3]
    spec = json.loads(Path(spec_path).read_text())
    Path(out_path).write_text(json.dumps(measure(spec), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
