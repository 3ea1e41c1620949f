"""The benchmark behind ``mhc-cg bench``: every training mode at one or more shapes, each mode
alone in a fresh process, one report per shape.

For each shape (a config) and each mode the bench starts ``python -m mhc_cg.lab.benchmarks.timing``
(:mod:`mhc_cg.lab.benchmarks.timing`: build, warm up, time, profile) and reads back its JSON: a fresh
process and CUDA context per mode, so its peaks are torch's counters as they stand, nothing
subtracted, and no mode reuses another's cache. A mode that fails (out of memory, a crash, its
time limit) is reported with the error and the bench goes on.

Modes: every mode of the registry (:mod:`mhc_cg.lab.registry`), each built from the
shape's config and the same seed (``moe_partial`` gets ``--moe-experts`` experts of top-
``--moe-top-k`` routing). Every mode that trains the same model is compared with ``eager_none``'s
losses: equal on the CPU, within :data:`LOSS_RTOL` on CUDA (bf16 kernels there are not
deterministic).

Results are handed to ``on_shape_done`` after each mode (``mhc-cg bench`` writes the files then),
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.errors import ConfigError
from mhc_cg.core.progress import log as _log
from mhc_cg.lab.cost.gpus import name_slug
from mhc_cg.lab.registry import MODES, PLAIN, REFERENCE, get_mode
from mhc_cg.lab.resolve import resolve

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


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def device_slug(device: torch.device) -> str:
    """A file name for the device: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; ``cpu``."""
    return "cpu" if device.type != "cuda" else name_slug(device_name(device))


def code_version() -> str | None:
    """The checkout's commit (``+`` when its tracked files differ), or None outside a checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+" if dirty else "")) or None


@dataclass
class BenchOptions:
    modes: tuple[str, ...] = field(default_factory=lambda: tuple(MODES))
    steps: int = 10
    warmup: int = 2
    profile_steps: int = 2
    recompute_replays: int = 50
    bandwidth_bytes: int = 256 * 2 ** 20
    moe_experts: int = 8
    moe_top_k: int = 2
    mode_timeout_s: float | None = None  # one mode's process, build included
    trace_dir: str | None = None  # keep each mode's profiler trace here


def run_mode(cfg: RunConfig, mode: str, device: torch.device, opts: BenchOptions) -> dict:
    """``mode`` at ``cfg`` in a process of its own (:mod:`mhc_cg.lab.benchmarks.timing`); its entry, or
    ``{"error": ...}`` when the process failed."""
    spec = {"config": cfg.to_dict(), "mode": mode, "device": device.type,
            "steps": opts.steps, "warmup": opts.warmup, "profile_steps": opts.profile_steps,
            "recompute_replays": opts.recompute_replays, "bandwidth_bytes": opts.bandwidth_bytes,
            "moe_experts": opts.moe_experts, "moe_top_k": opts.moe_top_k,
            "trace_dir": opts.trace_dir}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        begin = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "mhc_cg.lab.benchmarks.timing", str(spec_path),
                                 str(out_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        tail: list[str] = []
        reader = threading.Thread(target=_relay, args=(proc.stderr, tail), daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=opts.mode_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return {"error": f"timed out after {opts.mode_timeout_s:g} s"}
        reader.join()
        seconds = time.perf_counter() - begin
        if code != 0 or not out_path.exists():
            return {"error": f"exit {code}: {tail[-1] if tail else 'no output'}",
                    "process_s": seconds}
        entry = json.loads(out_path.read_text())
        entry["process_s"] = seconds
        return entry


def _relay(stream, tail: list[str]) -> None:
    """Pass the child's progress lines on as they come; keep its last lines for an error."""
    for line in stream:
        if line.startswith("[bench]"):
            print(line, end="", file=sys.stderr, flush=True)
        elif line.strip():
            tail[:] = [*tail[-19:], line.strip()]


def run_bench(shapes: list[tuple[str, RunConfig]], device: torch.device, opts: BenchOptions,
              on_shape_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Every mode of ``opts.modes`` at every ``(name, config)`` of ``shapes``: one report per
    shape (see ``bench/README.md``); ``on_shape_done(report)`` gets a shape's report after each
    of its modes."""
    if opts.steps < 1 or opts.warmup < 0 or opts.profile_steps < 1 or opts.recompute_replays < 1:
        raise ConfigError("--steps, --profile-steps and --recompute-replays must be >= 1 and "
                          "--warmup >= 0")
    reports = []
    for shape, cfg in shapes:
        report = _report_head(shape, cfg, device, opts)
        for index, mode in enumerate(opts.modes, 1):
            log(f"{shape}: {mode} ({index}/{len(opts.modes)}), a process of its own")
            entry = run_mode(cfg, mode, device, opts)
            if "error" in entry:
                log(f"{shape}: {mode} failed: {entry['error']}")
            report["modes"][mode] = _compared(entry, mode, report, cfg, device)
            _overheads(report["modes"])
            report["targets"] = targets_check(report["modes"])
            if on_shape_done is not None:
                on_shape_done(report)
        reports.append(report)
    return reports


def _report_head(shape: str, cfg: RunConfig, device: torch.device, opts: BenchOptions) -> dict:
    backend = resolve(cfg, REFERENCE, device).plan.api  # as every mode resolves it
    return {
        "device": device_name(device), "device_type": device.type,
        "device_slug": device_slug(device), "torch": torch.__version__,
        "code": code_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": shape, "config": cfg.to_dict(),
        "bench": {"steps": opts.steps, "warmup": opts.warmup, "profile_steps": opts.profile_steps,
                  "schedule": "one_process_per_mode", "backend": backend,
                  "dtype": cfg.train.dtype,
                  "loss_rtol": LOSS_RTOL[cfg.train.dtype] if device.type == "cuda" else 0.0,
                  "moe": {"num_experts": opts.moe_experts, "top_k": opts.moe_top_k},
                  "memory_note": ("peak = torch.cuda.max_memory_allocated / max_memory_reserved "
                                  "of the mode's own process (build and capture included)"
                                  if device.type == "cuda" else CPU_MEMORY_NOTE),
                  "caveat": CPU_CAVEAT if device.type != "cuda" else None},
        "modes": {},
        "targets": [],
    }


def _overheads(modes: dict) -> None:
    """Each mode's measured mHC overhead: its step over the plain residual's, less one."""
    plain = modes.get(PLAIN, {}).get("step_ms_median")
    for entry in modes.values():
        if "step_ms_median" in entry:
            entry["mhc_overhead"] = None if plain is None else entry["step_ms_median"] / plain - 1


def losses_match(losses: list[float], reference: list[float], rtol: float) -> bool:
    """Equal (``rtol`` 0) or each within ``rtol`` of the reference; a non-finite loss never
    matches (NaN != NaN would otherwise read as a difference of 0 elsewhere)."""
    if len(losses) != len(reference) or not all(map(math.isfinite, losses + reference)):
        return False
    if rtol == 0:
        return losses == reference
    return all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, reference))


def _compared(entry: dict, mode: str, report: dict, cfg: RunConfig, device: torch.device) -> dict:
    reference = report["modes"].get(REFERENCE, {}).get("losses")
    comparable = reference is not None and get_mode(mode).same_model and "losses" in entry
    rtol = LOSS_RTOL[cfg.train.dtype] if device.type == "cuda" else 0.0
    entry["losses_equal_eager_none"] = entry["losses"] == reference if comparable else None
    entry["losses_match_eager_none"] = (losses_match(entry["losses"], reference, rtol)
                                        if comparable else None)
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
    """The targets for ``graphed_static``; SKIP where a figure is missing."""
    gs, eb, en, split = (modes.get(m, {}) for m in ("graphed_static", "eager_block", "eager_none",
                                                     "attn_split"))

    def scaled(entry: dict, key: str, factor: float) -> float | None:
        return None if entry.get(key) is None else factor * entry[key]

    return [
        _check("peak <= eager_none", gs.get("peak_allocated_bytes"),
               en.get("peak_allocated_bytes"), "graphed_static peak bytes"),
        _check("peak <= 1.05 x eager_block", gs.get("peak_allocated_bytes"),
               scaled(eb, "peak_allocated_bytes", 1.05), "graphed_static peak bytes"),
        _check("step <= 1.07 x eager_none", gs.get("step_ms_median"),
               scaled(en, "step_ms_median", 1.07), "graphed_static step ms"),
        _check("step < eager_block", gs.get("step_ms_median"), eb.get("step_ms_median"),
               "graphed_static step ms", strict=True),
        _check("step < attn_split", gs.get("step_ms_median"), split.get("step_ms_median"),
               "graphed_static step ms", strict=True),
        _check("recompute graph <= 2 x its bound", gs.get("recompute_graph_ms"),
               scaled(gs, "recompute_lower_bound_ms", 2.0), "recompute graph ms"),
    ]


def _fmt(value, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def markdown(reports: list[dict]) -> str:
    """All shapes' tables: per mode memory, step, busy share, GPU ms per phase; the fused ops."""
    if not reports:
        return ""
    head = reports[0]
    lines = [f"# mhc-cg bench: {head['device']}", "",
             f"torch {head['torch']}, code {head['code'] or 'unknown'}, {head['date']}; each mode "
             f"in a process of its own (peaks: torch's counters in that process, build and "
             f"capture included).", ""]
    if head["bench"]["caveat"]:
        lines += [f"**{head['bench']['caveat']}.**", ""]
    for report in reports:
        lines += _shape_markdown(report)
    return "\n".join(lines) + "\n"


def _shape_markdown(report: dict) -> list[str]:
    b, m, t = report["bench"], report["config"]["model"], report["config"]["train"]
    timing = "device" if report["device_type"] == "cuda" else "host"
    lines = [f"## {report['shape']}: {m['num_layers']} layers, hidden {m['hidden_size']}, "
             f"seq {m['seq_length']}, micro-batch {t['micro_batch_size']} x "
             f"{t['num_microbatches']}, n = {m['num_streams']}, {b['dtype']}", "",
             f"{b['steps']} timed steps per mode after {b['warmup']} warm-up, {b['profile_steps']} "
             f"profiled; backend {b['backend']}. Phase times: {timing} ms per step of the "
             f"kernels launched in each phase.", "",
             "| mode | pid | peak alloc MiB | peak reserved MiB | step ms | mHC overhead | tokens/s "
             "| busy | forward | backward | recompute | iteration | optimizer "
             "| losses match eager_none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, e in report["modes"].items():
        if "error" in e:
            lines.append(f"| {name} | - | failed: {e['error']} |||||||||||||")
            continue
        phases = e["profile"]["phases"]
        busy = e["profile"]["busy_share"]
        overhead = e.get("mhc_overhead")
        overhead = "-" if overhead is None or name == PLAIN else f"{overhead:+.1%}"
        same = {True: "yes", False: "no", None: "-"}[e["losses_match_eager_none"]]
        lines.append(
            f"| {name} | {e['pid']} | {_fmt(e['peak_allocated_bytes'], 2 ** 20, 1)} | "
            f"{_fmt(e['peak_reserved_bytes'], 2 ** 20, 1)} | {e['step_ms_median']:.2f} | "
            f"{overhead} | "
            f"{e['tokens_per_s']:.0f} | {'-' if busy is None else f'{busy:.0%}'} | "
            + " | ".join(_fmt(phases.get(p, {}).get("gpu_ms")) for p in
                         ("forward", "backward", "recompute", "iteration", "optimizer"))
            + f" | {same} |")
    fused = [(name, row) for name, e in report["modes"].items() if "error" not in e
             for row in e["fused_ops"]]
    if fused:
        lines += ["", f"Fused ops run eagerly ({timing} ms per step of their kernels; bytes "
                      f"from the cost model; inside a graph an op is not attributable):", "",
                  "| mode | op | calls | ms | bytes | GB/s | of copy |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {name} | {r['op']} | {r['calls']:g} | {r['device_ms']:.3f} | "
                  f"{_fmt(r['bytes'], 2 ** 20, 1)} MiB | {_fmt(r['gb_per_s'], 1, 1)} | "
                  f"{'-' if r['share_of_copy'] is None else format(r['share_of_copy'], '.1%')} |"
                  for name, r in fused]
    lines += ["", "Targets (graphed_static):", ""]
    lines += [f"- {t['status']} {t['target']} ({t['detail']})" for t in report["targets"]]
    return lines + [""]


def write_results(reports: list[dict], out_dir: str | Path) -> list[Path]:
    """``<out_dir>/<device-slug>.<shape>.json`` per shape and ``<device-slug>.md`` for all."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for report in reports:
        path = out / f"{report['device_slug']}.{report['shape']}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        written.append(path)
    if reports:
        md = out / f"{reports[0]['device_slug']}.md"
        md.write_text(markdown(reports))
        written.append(md)
    return written
