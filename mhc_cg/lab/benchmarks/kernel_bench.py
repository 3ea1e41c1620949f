"""``mhc-cg kernels --bench``: the fused ops' device time apart from their launch cost, and the
launch-configuration sweep one GPU run settles.

Per shape (a config: the bench shape and its memory shape by default), one eager training step
of ``eager_none`` (every fused op called eagerly, forward and backward) runs under torch.profiler
after a warm-up step. Per fused op (``mhc_cg::*``): calls, **device time** (the union of the
kernels launched inside the op: what the GPU spent, whatever the host did), **host time per
call** (the op's own duration on the CPU: dispatch and Triton's launcher, which eager modes pay at
every call and graphs do not), the bytes the cost model gives the op at this shape, the achieved
GB/s and its share of the copy bandwidth measured in the same process.

``--sweep``: every launch configuration of every tunable kernel
(:data:`mhc_cg.ops.kernels.launch.TUNABLE`), each timed by the device time of that kernel's own
kernels over profiled steps of the first shape; the fastest per kernel becomes a row of
``launch_configs.json`` (the format :func:`mhc_cg.ops.kernels.launch.launch_config` reads;
``python -m mhc_cg.ops.kernels.launch merge`` puts it into the committed table), and each op's
timing a row of ``kernel_efficiency.json`` (the format ``mhc-cg cost`` reads its measurements
from: ``bench/results/``).

``--dry-run`` (CPU, CI): the same on two tiny shapes and two configurations per kernel, the
Triton kernels run by Triton's interpreter (in a child process that sets ``TRITON_INTERPRET``
before triton loads); the CPU is then the device and every time is host time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.progress import log
from mhc_cg.ops.kernels.launch import ENV, TUNABLE, candidates, device_name
from mhc_cg.lab.resolve import resolve
from mhc_cg.lab.benchmarks.timing import copy_bandwidth, fused_op_table, modelled_fused_ops
from mhc_cg.lab.profiling.phases import fused_ops
from mhc_cg.lab.profiling.traces import KIND_CHROME_CPU, read_timeline, union_ns
from mhc_cg.training.session import TrainSession

MODE = "eager_none"  # every fused op eager: each is attributable
# the Triton kernels of each tunable kernel family, and the ops that launch them (a CPU trace
# has no kernels: there the ops' own time stands in)
FAMILY_KERNELS = {"state": ("_state_part", "_state_sum"), "chain": ("_chain",),
                  "post_maps": ("_post_maps",)}
FAMILY_OPS = {"state": ("mhc_cg::pre", "mhc_cg::pre_into", "mhc_cg::post_state",
                        "mhc_cg::post_state_into"),
              "chain": ("mhc_cg::pre_from_state", "mhc_cg::pre_from_state_into", "mhc_cg::post",
                        "mhc_cg::post_into", "mhc_cg::recompute"),
              "post_maps": ("mhc_cg::post_maps",)}


def trace_times(path: Path, steps: int) -> dict:
    """From a torch.profiler trace: per ``mhc_cg::`` op ``{calls, device_ms, kernels,
    host_us_per_call}`` (:func:`~mhc_cg.lab.profiling.phases.fused_ops`) and per device kernel
    name ``{calls, device_ms}``, per step. On a CPU trace an op's device time is its own time."""
    timeline, per = read_timeline(path), max(steps, 1)
    names: dict[str, list] = defaultdict(list)
    for w in timeline.work if timeline.kind != KIND_CHROME_CPU else ():
        names[w.name].append((w.start, w.end))
    return {"ops": fused_ops(path, timeline, per),
            "kernels": {name: {"calls": len(spans) / per, "device_ms": union_ns(spans) / 1e6 / per}
                        for name, spans in sorted(names.items())}}


def profiled_step_times(session: TrainSession, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if session.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            session.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_times(path, steps)


def family_ms(times: dict, family: str) -> float:
    """Device ms per step of a tunable kernel family: its kernels', or on a CPU trace the ops
    that launch them."""
    if times["kernels"]:  # a Triton kernel's name starts with its function's
        return sum(t["device_ms"] for name, t in times["kernels"].items()
                   if name.startswith(FAMILY_KERNELS[family]))
    return sum(times["ops"].get(op, {}).get("device_ms", 0.0) for op in FAMILY_OPS[family])


def _session(cfg: RunConfig, device: torch.device) -> TrainSession:
    cfg = cfg.replace(model={"kernels": "triton"}, train={"device": device.type})
    return TrainSession.build(resolve(cfg, MODE, device))


def _quiet(message: str) -> None:
    pass


def _say(message: str) -> None:
    log("kernels", message)


def bench_shape(name: str, cfg: RunConfig, device: torch.device, steps: int,
                say=_say) -> dict:
    """One shape's fused ops (see the module docstring); ``say``: progress lines."""
    say(f"{name}: one warm-up step, {steps} profiled")
    bandwidth = copy_bandwidth(device, (256 if device.type == "cuda" else 16) << 20)
    session = _session(cfg, device)
    session.step()
    times = profiled_step_times(session, steps)
    modelled = modelled_fused_ops(cfg, MODE)
    return {"shape": name, "hidden": cfg.model.hidden_size,
            "tokens": cfg.model.seq_length * cfg.train.micro_batch_size,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "ops": fused_op_table(times["ops"], modelled, bandwidth), "kernels": times["kernels"]}


def sweep(cfg: RunConfig, device: torch.device, steps: int, scratch: Path,
          limit: int | None = None, on_row=None, say=_say) -> list[dict]:
    """Each tunable kernel's configurations (the first ``limit`` of them) timed at ``cfg``; the
    fastest per kernel as table rows. Every configuration runs through the table the launchers
    read (``MHC_CG_LAUNCH_CONFIGS``), as a committed row would, in one session: a launcher reads
    its row at every launch, so a new one takes effect at the next step (after a warm-up step,
    which also compiles it)."""
    rows, hidden, name = [], cfg.model.hidden_size, device_name(device)
    previous = os.environ.get(ENV)
    session = _session(cfg, device)
    try:
        for family in TUNABLE:
            timed, tried = [], candidates(family)[:limit]
            for index, config in enumerate(tried, 1):
                table = scratch / f"{family}_{hidden}_{index}.json"  # a table is read once
                table.write_text(json.dumps({"rows": [{"device": name, "hidden": hidden,
                                                       "kernel": family, "config": config}]}))
                os.environ[ENV] = str(table)
                session.step()
                ms = family_ms(profiled_step_times(session, steps), family)
                timed.append((ms, config))
                say(f"sweep {family} {index}/{len(tried)}: {config}: {ms:.3f} ms")
            best_ms, best = min(timed, key=lambda item: item[0])
            rows.append({"device": name, "hidden": hidden, "kernel": family, "config": best,
                         "device_ms": best_ms, "tried": [{"config": c, "device_ms": ms}
                                                         for ms, c in timed]})
            if on_row is not None:
                on_row(rows)
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
    return rows


def efficiency_rows(shape: dict, device: torch.device, code: str | None) -> list[dict]:
    """The shape's copy bandwidth and op timings as rows of
    ``bench/results/kernel_efficiency.json`` (the copy row: what the step model times bytes at
    on this GPU)."""
    from mhc_cg.lab.cost.measured import kernel_source_sha256

    copy = shape["copy_bandwidth_bytes_per_s"]
    return [{"device": device_name(device), "code": code, "class": "copy", "kernel": "copy_",
             "hidden": shape["hidden"], "tokens": shape["tokens"],
             "timing": "CUDA events, dst.copy_(src), read + write", "bytes": None, "ms": None,
             "gb_per_s": copy / 1e9, "share_of_copy": 1.0}] + [
            {"device": device_name(device), "code": code, "class": "fused mHC",
             "kernel": r["op"].split("::")[1], "op": r["op"], "hidden": shape["hidden"],
             "tokens": shape["tokens"], "kernel_source_sha256": kernel_source_sha256(),
             "timing": "profiler: the device time of the kernels each eager call launched",
             "bytes": r["bytes"], "ms": r["device_ms"] / max(r["calls"], 1),
             "gb_per_s": r["gb_per_s"], "share_of_copy": r["share_of_copy"]}
            for r in shape["ops"] if r["gb_per_s"] is not None]


def run(shapes: list[tuple[str, RunConfig]], device: torch.device, steps: int, do_sweep: bool,
        out: Path, limit: int | None = None, progress: bool = True) -> dict:
    """Every shape, then the sweep; ``kernel_bench.json`` (and with the sweep
    ``launch_configs.json`` and ``kernel_efficiency.json``) under ``out``, after each part;
    ``progress``: a line on stderr per shape and per configuration swept."""
    say = _say if progress else _quiet
    from mhc_cg.lab.benchmarks.runner import code_version

    out.mkdir(parents=True, exist_ok=True)
    code = code_version()
    report = {"device": device_name(device), "torch": torch.__version__, "code": code,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shapes": [],
              "launch_configs": []}
    for name, cfg in shapes:
        report["shapes"].append(bench_shape(name, cfg, device, steps, say))
        (out / "kernel_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "kernel_efficiency.json").write_text(json.dumps({"rows": [
        row for shape in report["shapes"] for row in efficiency_rows(shape, device, code)]},
        indent=1) + "\n")
    if do_sweep:
        def written(rows: list[dict]) -> None:  # after each kernel: a run cut short keeps them
            report["launch_configs"] = rows
            (out / "launch_configs.json").write_text(json.dumps(
                {"rows": [{k: v for k, v in r.items() if k != "tried"} for r in rows]},
                indent=1) + "\n")
            (out / "kernel_bench.json").write_text(json.dumps(report, indent=1) + "\n")

        with tempfile.TemporaryDirectory() as scratch:
            sweep(shapes[0][1], device, steps, Path(scratch), limit, on_row=written, say=say)
    return report


def format_report(report: dict) -> str:
    lines = [f"fused ops on {report['device']} (torch {report['torch']}, code {report['code']}): "
             f"device time of the kernels each eager call launched; host time per call "
             f"(dispatch and launcher)"]
    for shape in report["shapes"]:
        lines += ["", f"{shape['shape']}: hidden {shape['hidden']}, {shape['tokens']} tokens, "
                      f"copy bandwidth {shape['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
                  f"{'op':32} {'calls':>6} {'device ms':>10} {'host us/call':>13} {'MiB':>9} "
                  f"{'GB/s':>8} {'of copy':>8}"]
        for r in shape["ops"]:
            mib = "-" if r["bytes"] is None else f"{r['bytes'] / 2 ** 20:.1f}"
            gbs = "-" if r["gb_per_s"] is None else f"{r['gb_per_s']:.1f}"
            share = "-" if r["share_of_copy"] is None else f"{r['share_of_copy']:.1%}"
            lines.append(f"{r['op']:32} {r['calls']:>6g} {r['device_ms']:>10.3f} "
                         f"{r['host_us_per_call']:>13.1f} {mib:>9} {gbs:>8} {share:>8}")
    for row in report["launch_configs"]:
        lines.append(f"sweep: {row['kernel']} at hidden {row['hidden']}: {row['config']} "
                     f"({row['device_ms']:.3f} ms per step, fastest of {len(row['tried'])})")
    return "\n".join(lines)


def run_interpreted(argv: list[str]) -> int:
    """This command again in a child whose Triton interprets kernels on the CPU."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "mhc_cg.cli", *argv], env=env).returncode
