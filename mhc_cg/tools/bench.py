"""The benchmark behind ``mhc-cg bench``: every training mode, timed in alternation, one report.

Modes: every mode of the registry (:mod:`mhc_cg.runtime.modes.registry`), each built from one config
and the same seed (``moe_partial`` gets ``--moe-experts`` experts of top-``--moe-top-k`` routing).

Per mode: peak allocated memory, median step time, tokens per second and, for modes with a
recompute graph, that graph's replay time beside a bandwidth lower bound
(:func:`recompute_traffic`). Timed steps are interleaved in rounds (``chunk`` steps of each mode
per round) so clock and thermal drift hit every mode alike.

**Memory.** All modes' models live on the device at once; a mode's peak is therefore measured as
``max_memory_allocated`` during its steps minus what the *other* modes hold (the allocated bytes
before its steps minus its own resident bytes, measured when it was built). It counts the mode's
parameters, optimizer state, static buffers, graph pools' live tensors and activations. When
building every mode does not fit, they run one at a time instead (reported as ``schedule``).

``max_memory_allocated`` misses memory a graph pool keeps reserved after its capture (blocks its
capture freed, which only that pool may reuse), so each mode also reports ``peak_reserved_bytes``:
``max_memory_reserved`` during its steps minus the other modes' reserved bytes, which counts the
pools whole. Segments reserved before a mode's build may take some of its small allocations (the
allocator packs those of at most 1 MiB into shared 2 MiB segments), so its reserved figure can
trail its allocated one by up to a segment. Modes timed in alternation reuse each other's freed
cache, so the figure is reported (not ``null``) only when modes run one at a time.

**Precision.** Parameters and activations are ``train.dtype`` (fp32, bf16 or fp16) with fp32 main
parameters and optimizer state (:mod:`mhc_cg.training.optimizer`), loss in fp32. The static slots
take the dtype of what they hold. On CUDA, bf16/fp16 kernels (flash attention's backward above all)
are not deterministic, so losses are compared with :data:`LOSS_RTOL` there
(``losses_match_eager_none``); on the CPU they must be equal.

**Results** are handed to ``on_mode_done`` after each mode has finished (``mhc-cg bench`` writes
the files then), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import gc
import platform
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.errors import ConfigError
from mhc_cg.core.progress import log as _log
from mhc_cg.runtime.modes.lifecycle import ModeModel
from mhc_cg.runtime.modes.registry import MODES, REFERENCE, capture_plan, get_mode, mode_config
from mhc_cg.training.session import TrainSession
CPU_MEMORY_NOTE = ("null on CPU: CPU torch keeps no allocator peak counter "
                   "(torch.cuda.max_memory_allocated exists only for CUDA devices)")
# Relative loss tolerance against eager_none on CUDA (bf16/fp16 kernels are nondeterministic,
# fp32 ones may pick other algorithms inside a capture); 0 (exact) on the CPU.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}
CPU_CAVEAT = ("CPU run: the targets are stated for an H100/H200 with CUDA graphs; here graphs are "
              "the tape emulation, memory peaks are unavailable and times measure the host, so "
              "the PASS/FAIL lines below are not the targets' conditions")


def log(message: str) -> None:
    """Progress on stderr (stdout carries the report)."""
    _log("bench", message)


def parse_modes(text: str | None) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")`` in registry order; ``None``: every mode; unknown names are a
    ConfigError."""
    if text is None:
        return tuple(MODES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        raise ConfigError(f"--modes: unknown mode(s) {unknown or [text]}; choose a comma-separated "
                          f"subset of {', '.join(MODES)}")
    return tuple(m for m in MODES if m in names)


# --------------------------------------------------------------------------------------------
# The device: synchronisation, timers, memory counters.

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def reserved(device: torch.device) -> int | None:
    """Bytes the caching allocator holds, graph pools included (CUDA only)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else None


def time_repeated(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
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
    del src, dst
    if device.type == "cuda":  # else a mode's build could reuse the cached blocks, unseen in reserved
        torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def device_slug(device: torch.device) -> str:
    """A file name for the device: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "cuda"


# --------------------------------------------------------------------------------------------
# The recompute graph's traffic and lower bound.

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def recompute_traffic(graphed: ModeModel, block: int = 0) -> dict[str, int]:
    """Bytes the recompute of ``block`` must move at least, from a prepared static-recompute mode.

    An approximation: each byte read or written once, temporaries in cache (none spill), so
    ``read`` = the block's persistent inputs (x_l0, every sublayer's F output, the dropout seed,
    and fc1's output where activation recompute keeps it)
    + its mHC parameters (``HyperConnection`` and the pre-F RMSNorm weight of each sublayer), and
    ``write`` = the arena (one block's transient state; the arena is sized by the first block).
    """
    runtime = graphed.runtime
    pset = runtime.sets.all_sets()[0]
    first = block * runtime.block_size
    layers = runtime.blocks[block]
    inputs = _nbytes(pset.block_inputs[block]) + _nbytes(pset.seed) + sum(
        _nbytes(pset.fn_outputs[(first + i, k)]) for i in range(len(layers)) for k in range(2))
    # with activation recompute the block also re-derives the gelu output from fc1's output
    fc1 = pset.fc1_outputs
    inputs += sum(_nbytes(fc1[first + i]) for i in range(len(layers)) if first + i in fc1)
    params = sum(_nbytes(p) for layer in layers for sub in (layer.attention, layer.mlp)
                 for module in (sub.hc, sub.norm) for p in module.parameters())
    write = runtime.arena.nbytes
    return {"read_inputs": inputs, "read_params": params, "write_arena": write,
            "total": inputs + params + write}


def lower_bound_seconds(total_bytes: int, bandwidth: float) -> float:
    """Time to move ``total_bytes`` (read + written) at ``bandwidth`` bytes per second."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    return total_bytes / bandwidth


# --------------------------------------------------------------------------------------------
# One mode: its model, optimizer and data, stepped on demand.

@dataclass
class ModeBench:
    name: str
    cfg: RunConfig
    device: torch.device
    session: TrainSession | None = None  # model, forward, optimizer, data: as `mhc-cg train`
    build_s: float = 0.0
    resident_bytes: int | None = None  # allocated by this mode between steps (CUDA)
    resident_reserved_bytes: int | None = None  # reserved (graph pools included) by this mode
    peak_reserved_bytes: int | None = None
    _before_build: int | None = None
    _reserved_before_build: int | None = None
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_bytes: int | None = None

    def build(self, moe_experts: int, moe_top_k: int) -> "ModeBench":
        synchronize(self.device)
        # before building: the graph pools its captures reserve are the mode's own
        before, reserved_before = allocated(self.device), reserved(self.device)
        begin = time.perf_counter()
        self.cfg = mode_config(self.cfg, self.name, moe_experts=moe_experts, moe_top_k=moe_top_k)
        self.session = TrainSession.build(self.cfg, capture_plan(self.cfg, self.name, str(self.device)),
                                          self.device)
        self._before_build = before
        self._reserved_before_build = reserved_before
        self.build_s = time.perf_counter() - begin
        return self

    def warm_up(self, steps: int) -> None:
        """Untimed steps (optimizer state gets allocated); then measure what the mode holds."""
        for _ in range(steps):
            self.step(record=False)
        synchronize(self.device)
        if self.device.type == "cuda":
            self.resident_bytes = allocated(self.device) - self._before_build
            self.resident_reserved_bytes = reserved(self.device) - self._reserved_before_build

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return t.micro_batch_size * t.num_microbatches * self.cfg.model.seq_length

    def step(self, record: bool = True) -> None:
        """One optimizer step, as ``mhc_cg.training.session.train`` runs it; grads are dropped afterwards so
        that an idle mode holds no gradient memory while the others run."""
        start = time.perf_counter()
        loss_sum, _, _ = self.session.step()
        self.session.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        if record:
            self.step_times.append(time.perf_counter() - start)
            self.losses.append(loss_sum)

    def run_chunk(self, steps: int) -> None:
        """``steps`` timed steps; on CUDA, fold this chunk's peak into :attr:`peak_bytes`."""
        if self.device.type == "cuda":
            synchronize(self.device)
            others = allocated(self.device) - self.resident_bytes
            others_reserved = reserved(self.device) - self.resident_reserved_bytes
            torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(steps):
            self.step()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) - others
            self.peak_bytes = max(self.peak_bytes or 0, peak)
            peak = torch.cuda.max_memory_reserved(self.device) - others_reserved
            self.peak_reserved_bytes = max(self.peak_reserved_bytes or 0, peak)

    def recompute_timing(self, bandwidth: float, replays: int) -> dict:
        """Replay one recompute graph (block 0, set 0) ``replays`` times; its bound from traffic."""
        runtime = self.session.mode_model.runtime
        graphs = runtime.recompute_graphs if runtime is not None else None
        if not graphs:
            return {"recompute_graph_ms": None, "recompute_lower_bound_ms": None,
                    "recompute_note": "no recompute graph in this mode"}
        graph = graphs[(0, 0)]
        # the recompute graphs may share the sublayer graphs' pool, whose order a lone replay
        # breaks; the timing runs after the mode's last step
        with graph.pool.order.unchecked():
            for _ in range(2):
                graph.replay()
            synchronize(self.device)
            seconds = time_repeated(graph.replay, replays, self.device)
        traffic = recompute_traffic(self.session.mode_model, 0)
        return {"recompute_graph_ms": 1000.0 * seconds,
                "recompute_lower_bound_ms": 1000.0 * lower_bound_seconds(traffic["total"], bandwidth),
                "recompute_bytes": traffic, "recompute_replays": replays}

    def release(self) -> None:
        self.session = None


# --------------------------------------------------------------------------------------------
# The whole benchmark.

@dataclass
class BenchOptions:
    modes: tuple[str, ...] = field(default_factory=lambda: tuple(MODES))
    steps: int = 20
    warmup: int = 3
    chunk: int = 5  # timed steps of one mode per round
    recompute_replays: int = 50
    bandwidth_bytes: int = 256 * 2 ** 20
    moe_experts: int = 8
    moe_top_k: int = 2
    one_at_a_time: bool = False


def _rounds(mode_benches: list[ModeBench], steps: int, chunk: int) -> None:
    done, index = 0, 0
    total = -(-steps // chunk)
    while done < steps:
        n = min(chunk, steps - done)
        index += 1
        for mode_bench in mode_benches:
            mode_bench.run_chunk(n)
        done += n
        medians = ", ".join(f"{r.name} {1000 * statistics.median(r.step_times):.1f} ms"
                            for r in mode_benches)
        log(f"round {index}/{total}: {done}/{steps} steps per mode; median so far: {medians}")


def _build(name: str, cfg: RunConfig, device: torch.device, opts: BenchOptions) -> ModeBench:
    log(f"{name}: building{' and capturing graphs' if get_mode(name).graphed else ''}")
    mode_bench = ModeBench(name, cfg, device).build(opts.moe_experts, opts.moe_top_k)
    graphs = len(mode_bench.session.mode_model.graphs())
    log(f"{name}: built in {mode_bench.build_s:.1f} s ({graphs} graphs); {opts.warmup} warm-up steps")
    mode_bench.warm_up(opts.warmup)
    return mode_bench


def _free(mode_benches: list[ModeBench], device: torch.device) -> None:
    for mode_bench in mode_benches:
        mode_bench.release()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_bench(cfg: RunConfig, device: torch.device, opts: BenchOptions,
              on_mode_done: Callable[[dict], None] | None = None) -> dict:
    """Run every mode of ``opts.modes``; returns the report (see ``bench/README.md``).

    ``on_mode_done(report)`` gets the report so far each time a mode's results are complete.
    """
    if opts.steps < 1 or opts.warmup < 0 or opts.chunk < 1 or opts.recompute_replays < 1:
        raise ConfigError("--steps, --chunk and --recompute-replays must be >= 1 and --warmup >= 0")
    log(f"device {device_name(device)}; measuring copy bandwidth ({opts.bandwidth_bytes} bytes)")
    bandwidth = copy_bandwidth(device, opts.bandwidth_bytes)
    report = _report_head(cfg, device, opts, bandwidth)
    timings: dict[str, dict] = {}
    mode_benches: list[ModeBench] = []

    def finished(mode_bench: ModeBench) -> None:
        reference = report["modes"].get(REFERENCE, {}).get("losses")
        report["modes"][mode_bench.name] = _mode_entry(mode_bench, reference, timings, cfg, device)
        report["targets"] = targets_check(report["modes"])
        if on_mode_done is not None:
            on_mode_done(report)

    if not opts.one_at_a_time:
        try:
            for name in opts.modes:
                mode_benches.append(_build(name, cfg, device, opts))
            _rounds(mode_benches, opts.steps, opts.chunk)
            for mode_bench in mode_benches:
                timings[mode_bench.name] = mode_bench.recompute_timing(bandwidth, opts.recompute_replays)
        except torch.OutOfMemoryError:
            # start over with nothing resident: partial timings of a crowded device are discarded
            _free(mode_benches, device)
            mode_benches, timings = [], {}
            report["bench"]["schedule"] = "one_at_a_time"
            report["bench"]["schedule_note"] = ("all modes at once ran out of device memory; modes "
                                                "ran one at a time")
            log(report["bench"]["schedule_note"])
        for mode_bench in mode_benches:
            # alternating modes reuse each other's freed cache: reserved bytes are not per mode
            mode_bench.peak_reserved_bytes = None
            finished(mode_bench)
    else:
        report["bench"]["schedule"] = "one_at_a_time"
        report["bench"]["schedule_note"] = "asked for with --one-at-a-time"
    if not mode_benches:
        for name in opts.modes:
            mode_bench = _build(name, cfg, device, opts)
            _rounds([mode_bench], opts.steps, opts.chunk)
            timings[name] = mode_bench.recompute_timing(bandwidth, opts.recompute_replays)
            finished(mode_bench)
            _free([mode_bench], device)
    report["targets"] = targets_check(report["modes"])
    return report


def _report_head(cfg: RunConfig, device: torch.device, opts: BenchOptions, bandwidth: float) -> dict:
    backend = capture_plan(cfg, REFERENCE, str(device)).backend  # as every mode resolves it
    return {
        "device": device_name(device),
        "device_type": device.type,
        "device_slug": device_slug(device),
        "torch": torch.__version__,
        "config": cfg.to_dict(),
        "bench": {"steps": opts.steps, "warmup": opts.warmup, "chunk": opts.chunk,
                  "schedule": "alternating",
                  "schedule_note": "all modes built up front; timed steps interleaved in rounds",
                  "backend": backend, "dtype": cfg.train.dtype, "dtype_note": "",
                  "loss_rtol": LOSS_RTOL[cfg.train.dtype] if device.type == "cuda" else 0.0,
                  "moe": {"num_experts": opts.moe_experts, "top_k": opts.moe_top_k},
                  "memory_note": ("peak = max_memory_allocated during the mode's steps minus the "
                                  "other modes' resident bytes; peak_reserved the same with "
                                  "max_memory_reserved (graph pools whole)" if device.type == "cuda"
                                  else CPU_MEMORY_NOTE),
                  "caveat": CPU_CAVEAT if device.type != "cuda" else None},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "modes": {},
        "targets": [],
    }


def losses_match(losses: list[float], reference: list[float], rtol: float) -> bool:
    """Equal (``rtol`` 0) or each within ``rtol`` of the reference; a non-finite loss never
    matches (NaN != NaN would otherwise read as a difference of 0 elsewhere)."""
    import math

    if len(losses) != len(reference) or not all(map(math.isfinite, losses + reference)):
        return False
    if rtol == 0:
        return losses == reference
    return all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, reference))


def _mode_entry(mode_bench: ModeBench, reference: list[float] | None, timings: dict,
                cfg: RunConfig, device: torch.device) -> dict:
    mode = get_mode(mode_bench.name)
    comparable = reference is not None and mode.same_model
    rtol = LOSS_RTOL[cfg.train.dtype] if device.type == "cuda" else 0.0
    entry = {
        "peak_mem_bytes": mode_bench.peak_bytes,
        "peak_reserved_bytes": mode_bench.peak_reserved_bytes,
        "resident_bytes": mode_bench.resident_bytes,
        "resident_reserved_bytes": mode_bench.resident_reserved_bytes,
        "step_ms_median": 1000.0 * statistics.median(mode_bench.step_times),
        "step_ms": [1000.0 * t for t in mode_bench.step_times],
        "tokens_per_s": mode_bench.tokens_per_step / statistics.median(mode_bench.step_times),
        "losses": mode_bench.losses,
        "losses_equal_eager_none": mode_bench.losses == reference if comparable else None,
        "losses_match_eager_none": losses_match(mode_bench.losses, reference, rtol) if comparable
        else None,
        "build_s": mode_bench.build_s,
    }
    if mode.graphed:
        entry.update(timings[mode_bench.name])
    return entry


# --------------------------------------------------------------------------------------------
# Targets and output.

def _check(name: str, value: float | None, limit: float | None, text: str,
           strict: bool = False) -> dict:
    if value is None or limit is None:
        return {"target": name, "status": "SKIP", "detail": f"{text}: not measured"}
    status = "PASS" if (value < limit if strict else value <= limit) else "FAIL"
    return {"target": name, "status": status, "detail": f"{text}: {value:.4g} vs limit {limit:.4g}"}


def targets_check(modes: dict) -> list[dict]:
    """The issue's targets for ``graphed_static``; SKIP where a figure is missing."""
    gs, eb, en, split = (modes.get(m, {}) for m in ("graphed_static", "eager_block", "eager_none",
                                                     "attn_split"))

    def scaled(entry: dict, key: str, factor: float) -> float | None:
        return None if entry.get(key) is None else factor * entry[key]

    return [
        _check("peak <= 1.05 x eager_block", gs.get("peak_mem_bytes"),
               scaled(eb, "peak_mem_bytes", 1.05), "graphed_static peak bytes"),
        _check("step <= 0.9 x eager_block", gs.get("step_ms_median"),
               scaled(eb, "step_ms_median", 0.9), "graphed_static step ms"),
        _check("step <= 1.07 x eager_none", gs.get("step_ms_median"),
               scaled(en, "step_ms_median", 1.07), "graphed_static step ms"),
        _check("step < attn_split", gs.get("step_ms_median"), split.get("step_ms_median"),
               "graphed_static step ms", strict=True),
        _check("recompute graph <= 2 x its bound", gs.get("recompute_graph_ms"),
               scaled(gs, "recompute_lower_bound_ms", 2.0), "recompute graph ms"),
    ]


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def markdown(report: dict) -> str:
    b, m = report["bench"], report["config"]["model"]
    lines = [f"# mhc-cg bench: {report['device']}", ""]
    if b["caveat"]:
        lines += [f"**{b['caveat']}.**", ""]
    lines += [f"Model: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, "
              f"seq {m['seq_length']}, n = {m['num_streams']}, micro-batch "
              f"{report['config']['train']['micro_batch_size']}, {b['dtype']}"
              f"{' (' + b['dtype_note'] + ')' if b['dtype_note'] else ''}. "
              f"Backend {b['backend']}, torch {report['torch']}. {b['steps']} timed steps per mode "
              f"after {b['warmup']} warm-up, schedule {b['schedule']} ({b['schedule_note']}). "
              f"Copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
              f"(read + write). Memory: {b['memory_note']}.", "",
              "| mode | peak MiB | step ms (median) | tokens/s | recompute graph ms | lower bound ms "
              "| losses match eager_none |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for name, e in report["modes"].items():
        same = {True: "yes", False: "no", None: "-"}[e.get("losses_match_eager_none",
                                                            e["losses_equal_eager_none"])]
        lines.append(f"| {name} | {_fmt(e['peak_mem_bytes'], 2 ** 20, 1)} | {e['step_ms_median']:.2f} "
                     f"| {e['tokens_per_s']:.0f} | {_fmt(e.get('recompute_graph_ms'), 1, 3)} "
                     f"| {_fmt(e.get('recompute_lower_bound_ms'), 1, 3)} | {same} |")
    lines += ["", "Targets (graphed_static):", ""]
    lines += [f"- {t['status']} {t['target']} ({t['detail']})" for t in report["targets"]]
    return "\n".join(lines) + "\n"


def write_results(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """``<out_dir>/<device-slug>.json`` and ``.md``."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{report['device_slug']}.json", out / f"{report['device_slug']}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path
