"""What GPUs measured, beside what the cost model charges: the committed measurements under
``bench/results/``.

* :data:`EFFICIENCY`: one row per measured kernel (device, code it ran, kernel, bytes, time, how
  it was timed, achieved GB/s and share of the device's measured copy bandwidth). A fused mHC
  kernel's row counts for the current code only if it was measured at the same kernel source
  (``kernel_source_sha256`` of ``mhc_cg/ops/kernels/triton_kernels.py``); the copy row measures
  torch's own copy kernel, which no commit here changes.
  What the step model charges from them: :mod:`mhc_cg.lab.cost.step_model`.
* :func:`last_measured_steps`: per mode, the step time of the newest ``mhc-cg bench`` JSON of the
  same shape, beside the modelled one.

Outside a checkout (an installed wheel) there is no ``bench/results/``: everything reads as
unmeasured.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mhc_cg.config import RunConfig
from mhc_cg.lab.cost.gpus import gpu_named

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
EFFICIENCY = RESULTS / "kernel_efficiency.json"
KERNEL_SOURCE = ROOT / "mhc_cg" / "ops" / "kernels" / "triton_kernels.py"
# the fused ops each probe kernel name times
FUSED_OPS = {"pre": "mhc_cg::pre", "post": "mhc_cg::post", "recompute_block": "mhc_cg::recompute",
             "rms_norm": "mhc_cg::rms_norm"}


# The kind of each fused op, and the probe kernel whose measurement stands for its kind:
# "state" kernels reduce a token's whole row (the projection and the streams' Gram matrix; the
# backward's coefficients), "stream" kernels stream element-wise over (tokens, features),
# "recompute" is the block's chain, "row" kernels normalise one row per program.
FUSED_KINDS = {
    "mhc_cg::pre": "state", "mhc_cg::pre_into": "state", "mhc_cg::post_state": "state",
    "mhc_cg::post_state_into": "state", "mhc_cg::post_maps": "state",
    "mhc_cg::pre_backward": "state", "mhc_cg::pre_backward_into": "state",
    "mhc_cg::post": "stream", "mhc_cg::post_into": "stream", "mhc_cg::pre_from_state": "stream",
    "mhc_cg::pre_from_state_into": "stream", "mhc_cg::post_grad_y": "stream",
    "mhc_cg::post_backward": "stream",
    "mhc_cg::recompute": "recompute",
    "mhc_cg::rms_norm": "row", "mhc_cg::rms_norm_backward": "row",
    "mhc_cg::cross_entropy": "row", "mhc_cg::cross_entropy_backward": "row",
    "mhc_cg::cross_entropy_backward_": "row",
}
KIND_PROBE = {"state": "pre", "stream": "post", "recompute": "recompute_block", "row": "rms_norm"}


def kernel_source_sha256() -> str | None:
    return hashlib.sha256(KERNEL_SOURCE.read_bytes()).hexdigest() if KERNEL_SOURCE.exists() \
        else None


def efficiency_rows(path: Path = EFFICIENCY) -> list[dict]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def is_device_time(row: dict) -> bool:
    """A row timed as the device time of its kernels (``mhc-cg kernels --bench``), not as eager
    calls with their launch and host cost."""
    return str(row.get("timing", "")).startswith("profiler")


def probe_rows(probe: dict, code: str, kernels_sha256: str) -> list[dict]:
    """Efficiency rows from a ``mhc_cg.lab.benchmarks.gpu_probe`` JSON: its copy bandwidth and each fused
    kernel's time (CUDA events around eager calls: launch cost included)."""
    kernels = probe["parts"]["kernels"]
    copy = kernels["copy_bandwidth_bytes_per_s"]
    rows = [{"device": probe["device"], "code": code, "class": "copy", "kernel": "copy_",
             "timing": "CUDA events, 256 MiB dst.copy_(src), read + write", "bytes": None,
             "ms": None, "gb_per_s": copy / 1e9, "share_of_copy": 1.0}]
    for k in kernels["kernels"]:
        achieved = k["bytes"] / (k["fused_ms"] * 1e-3)
        rows.append({"device": probe["device"], "code": code, "class": "fused mHC",
                     "kernel": k["kernel"], "op": FUSED_OPS.get(k["kernel"]),
                     "kernel_source_sha256": kernels_sha256,
                     "timing": "CUDA events around eager calls (launch cost included)",
                     "bytes": k["bytes"], "ms": k["fused_ms"], "gb_per_s": achieved / 1e9,
                     "share_of_copy": achieved / copy})
    return rows


def _shape(cfg: dict) -> tuple:
    """What makes two runs comparable: the shape, and whether TE's function captured."""
    m, t = cfg["model"], cfg["train"]
    return (m["num_layers"], m["hidden_size"], m["num_heads"], m["seq_length"], m["num_streams"],
            m["vocab_size"], t["micro_batch_size"], t["num_microbatches"], t["dtype"],
            cfg.get("graph", {}).get("backend") == "te")


def gpu_runs(results: Path = RESULTS) -> list[dict]:
    """Every ``mhc-cg bench`` JSON under ``results`` measured on a GPU, oldest first, each with
    its ``path``."""
    runs = []
    for path in sorted(results.rglob("*.json")) if results.exists() else []:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and report.get("device_type") == "cuda" \
                and "modes" in report and "config" in report:
            runs.append({**report, "path": path})
    return sorted(runs, key=lambda r: r.get("date", ""))


def last_measured_steps(cfg: RunConfig, results: Path = RESULTS, gpu: str | None = None) -> dict:
    """``{"source", "device", "code", "modes": {mode: step ms}}`` of the newest ``mhc-cg bench``
    JSON under ``results`` measured on a GPU (the model's ``gpu``, a key of
    :data:`~mhc_cg.lab.cost.gpus.GPUS`, when given) at ``cfg``'s shape; {} if there is none."""
    shape = _shape(cfg.to_dict())
    found = [report for report in gpu_runs(results) if _shape(report["config"]) == shape
             and (gpu is None or getattr(gpu_named(report.get("device", "")), "key", None) == gpu)]
    if not found:
        return {}
    report = found[-1]  # gpu_runs is oldest first
    path = report["path"]
    return {"source": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "device": report["device"], "code": report.get("code", "unknown"),
            "modes": {m: e["step_ms_median"] for m, e in report["modes"].items()}}


def merge(new: list[dict], path: Path = EFFICIENCY) -> list[dict]:
    """``new`` rows into the table at ``path``, in place of the rows of the same device, code and
    op (or kernel, and shape where a row has one); returns the table's rows."""
    key = lambda r: (r["device"], r["code"], r.get("op") or r["kernel"], r.get("hidden"),  # noqa: E731
                     r.get("tokens"))
    replaced = {key(r) for r in new}
    rows = [r for r in efficiency_rows(path) if key(r) not in replaced] + new
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m mhc_cg.lab.cost.measured merge KERNEL_EFFICIENCY.json``: a GPU run's rows
    (``mhc-cg kernels --bench``) into the committed table (:func:`merge`); ``... probe
    PROBE_JSON CODE``: a probe's rows, stamped with the kernel source of the working tree (run it
    where the probe's code is)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    arity = {"merge": 2, "probe": 3}
    if not args or arity.get(args[0]) != len(args):
        print("usage: python -m mhc_cg.lab.cost.measured merge FILE | probe PROBE_JSON CODE",
              file=sys.stderr)
        return 2
    if args[0] == "probe":
        new = probe_rows(json.loads(Path(args[1]).read_text()), args[2], kernel_source_sha256())
    else:
        new = json.loads(Path(args[1]).read_text())["rows"]
    rows = merge(new)
    print(f"{EFFICIENCY}: {len(rows)} rows ({len(new)} merged)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
