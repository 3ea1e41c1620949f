"""The GPU checklist's probe: graph pools, fused kernels and dropout masks, each part on its own.

``python -m mhc_cg.lab.benchmarks.gpu_probe --config F --out DIR [--parts pools,kernels,dropout]`` writes
``DIR/probe.json`` after every part, so a part that dies (out of memory, a kernel fault) loses
nothing measured before it. A part whose ingredient is missing reports ``"status": "not
available"`` with the reason instead of failing:

* ``pools``: every capture's pool, in bytes, per graphed mode (``graphed_none``, ``graphed_static``,
  ``attn_split``). On CUDA a pool's size is the reserved bytes of the allocator segments that carry
  its pool id (``torch.cuda.memory_snapshot``); on the ``tape`` backend it is the unique storages
  the pool's graphs allocated while capturing (the tape never reuses memory inside a pool, so
  that is an upper bound, not a CUDA pool's size). Beside each measurement goes the cost model's
  prediction (:func:`mhc_cg.lab.cost.report.cost_mode`, run on ``meta``).
* ``kernels``: each fused Triton kernel of :mod:`mhc_cg.ops.kernels` against its torch path on the
  bench's shapes: time, the bandwidth bound of the bytes it must move, exactness (CUDA only).
* ``dropout``: counter-dropout masks drawn on the device against the same masks drawn on the CPU;
  a graph replayed on the GPU and a recompute check elsewhere must agree bit for bit.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from mhc_cg.config import RunConfig, load_config
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.core.errors import ConfigError
from mhc_cg.ops import kernels
from mhc_cg.ops.dropout import counter_dropout_mask
from mhc_cg.lab.registry import MODES
from mhc_cg.lab.resolve import resolve
from mhc_cg.training.session import TrainSession
from mhc_cg.lab.benchmarks.runner import device_name
from mhc_cg.lab.benchmarks.timing import copy_bandwidth, synchronize, time_repeated
from mhc_cg.lab.cost.report import cost_mode
from mhc_cg.training.device import resolve_device

PARTS = ("pools", "kernels", "dropout")
# the graphed modes of the configured model
POOL_MODES = tuple(m.name for m in MODES.values() if m.graphed and m.same_model)


def not_available(reason: str) -> dict:
    return {"status": "not available", "reason": reason}


# --------------------------------------------------------------------------------------------
# Pools.

def snapshot_pool_bytes(snapshot: Sequence[dict]) -> dict[tuple[int, int], int]:
    """Reserved bytes per graph pool id in a ``torch.cuda.memory_snapshot()``: segments that carry
    ``segment_pool_id`` ``(0, 0)`` belong to no graph and are left out."""
    sizes: dict[tuple[int, int], int] = defaultdict(int)
    for segment in snapshot:
        pool = tuple(segment.get("segment_pool_id") or (0, 0))
        if pool != (0, 0):
            sizes[pool] += int(segment["total_size"])
    return dict(sizes)


def tape_pool_bytes(graphs: Iterable[Any]) -> dict[str, int]:
    """Bytes per tape pool: the unique storages its graphs allocated while capturing."""
    seen: dict[str, dict[int, int]] = defaultdict(dict)
    for graph in graphs:
        for _holder, nbytes, data_ptr, owned in getattr(graph, "_storages", ()):
            if owned:
                seen[str(graph.pool.id)][data_ptr] = nbytes
    return {pool: sum(storages.values()) for pool, storages in seen.items()}


def _pool_label(graph: Any) -> str:
    """What a pool holds: the first graph's name says which capture made it."""
    return graph.name


def measure_pools(graphs: Sequence[Any], backend: str) -> list[dict]:
    """One row per pool: ``pool``, ``graphs`` (count), ``first_graph``, ``bytes``."""
    by_pool: dict[str, list[Any]] = defaultdict(list)
    for graph in graphs:
        by_pool[str(graph.pool.id)].append(graph)
    if backend == "tape":
        sizes = tape_pool_bytes(graphs)
    elif backend == "cuda":
        reserved = snapshot_pool_bytes(torch.cuda.memory_snapshot())
        sizes = {}
        for pool, members in by_pool.items():
            ids = {tuple(g.graph.pool()) for g in members}
            sizes[pool] = sum(reserved.get(i, 0) for i in ids)
    else:
        raise ValueError(f"pool sizes are measured on the tape and cuda backends, not {backend!r}")
    return [{"pool": pool, "graphs": len(members), "first_graph": _pool_label(members[0]),
             "bytes": sizes.get(pool, 0)} for pool, members in by_pool.items()]


def probe_pools(cfg: RunConfig, device: torch.device, modes: Sequence[str] = POOL_MODES) -> dict:
    result: dict[str, Any] = {"status": "ok", "cost_model": "available", "modes": {}}
    for mode in modes:
        run = resolve(cfg, mode, device)
        plan = run.plan
        if plan.api not in ("tape", "cuda"):
            result["modes"][mode] = not_available(f"backend {plan.api}: its pools are TE's")
            continue
        graphed = TrainSession.build(run).mode_model  # a full-iteration mode needs its step loop
        synchronize(device)
        rows = measure_pools(graphed.graphs(), plan.api)
        entry: dict[str, Any] = {"backend": plan.api, "pools": rows,
                                 "total_bytes": sum(r["bytes"] for r in rows)}
        try:
            cost = cost_mode(resolve(cfg.replace(graph={"backend": "auto"}), mode, "meta"))
        except Exception as exc:  # noqa: BLE001 - the measurement stands without it
            entry["prediction_error"] = f"{type(exc).__name__}: {exc}"
        else:
            total = cost["pool_reserved_bytes"]
            entry.update(predicted_pools=cost["pools"], predicted_total_bytes=total,
                         measured_over_predicted=entry["total_bytes"] / total if total else None)
        result["modes"][mode] = entry
        del graphed
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------------------------
# Kernels.

@dataclass
class KernelCase:
    """A fused kernel and its torch reference on the same arguments; ``nbytes``: the bytes it
    must read and write at least (its bandwidth bound)."""

    name: str
    fused: Callable[..., Any]
    reference: Callable[..., Any]
    args: tuple
    nbytes: int


def _tensors(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


def compare_kernel(case: KernelCase, device: torch.device, bandwidth: float, repeats: int) -> dict:
    """Time the fused kernel and its reference; compare their outputs element for element."""
    fused, reference = _tensors(case.fused(*case.args)), _tensors(case.reference(*case.args))
    if len(fused) != len(reference):
        raise ValueError(f"kernel {case.name}: {len(fused)} outputs, reference has {len(reference)}")
    exact = all(torch.equal(a, b) for a, b in zip(fused, reference))
    diff = max(((a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
               for a, b in zip(fused, reference))
    synchronize(device)
    fused_s = time_repeated(lambda: case.fused(*case.args), repeats, device)
    reference_s = time_repeated(lambda: case.reference(*case.args), repeats, device)
    bound_s = case.nbytes / bandwidth
    return {"kernel": case.name, "exact": exact, "max_abs_diff": diff,
            "fused_ms": 1000 * fused_s, "reference_ms": 1000 * reference_s,
            "bound_ms": 1000 * bound_s, "fused_over_bound": fused_s / bound_s,
            "speedup": reference_s / fused_s, "bytes": case.nbytes}


def fused_kernel_cases(cfg: RunConfig, device: torch.device) -> list[KernelCase]:
    """The forward of each fused op on one micro-batch of the bench's shapes, Triton against
    torch: a sublayer's pre and post, a block's recompute (two layers) and the final RMSNorm.
    ``nbytes`` is its bound: every input read once and every output written once (the pre reads
    x twice, so its bound is below what it can reach)."""
    m = cfg.model
    s, b, n, c = m.seq_length, cfg.train.micro_batch_size, m.num_streams, m.hidden_size
    dtype = TORCH_DTYPES[cfg.train.dtype]
    width, iterations, eps, p = n * n + 2 * n, m.sinkhorn_iterations, 1e-5, m.hidden_dropout
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    def size(*tensors: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    x, y = rand(s, b, n * c), rand(s, b, c)
    weight, bias, norm = rand(width, n * c, scale=(n * c) ** -0.5), rand(width), rand(c)
    alphas = tuple(torch.full((1,), 0.01, device=device, dtype=dtype) for _ in range(3))
    seed = torch.tensor(1234, device=device)
    with torch.no_grad():
        fn_input, state, x_on = kernels.pre(x, weight, *alphas, bias, norm, n, iterations, eps,
                                            kernels="torch")
    steps = 4  # a block of two layers
    ys, states = rand(steps, s, b, c), state.unsqueeze(0).repeat(steps, 1, 1, 1)
    params = torch.cat([bias, *alphas]).unsqueeze(0).repeat(steps, 1)
    norms, streams = norm.unsqueeze(0).repeat(steps, 1), [2 + k for k in range(steps)]

    def both(fn: Callable) -> tuple[Callable, Callable]:
        return (lambda *a: fn(*a, kernels="triton")), (lambda *a: fn(*a, kernels="torch"))

    def recompute(*a: Any, **choice: str) -> tuple[torch.Tensor, torch.Tensor]:
        x_out, fn_out = x.new_empty(steps - 1, *x.shape), y.new_empty(steps, *y.shape)
        kernels.recompute_block(*a, x_out, fn_out, **choice)
        return x_out, fn_out

    pre_args = (x, weight, *alphas, bias, norm, n, iterations, eps)
    post_args = (x_on, state, *alphas, bias, y, seed, p, 1, n, iterations)
    recompute_args = (x, ys, states, params, norms, seed, p, streams, n, iterations, eps)
    return [
        KernelCase("pre", *both(kernels.pre), pre_args, size(x, weight, fn_input, state)),
        KernelCase("post", *both(kernels.post), post_args, size(x, state, y, x)),
        KernelCase("recompute_block", *both(recompute), recompute_args,
                   size(x, ys, states) + (steps - 1) * size(x) + steps * size(y)),
        KernelCase("rms_norm", *both(kernels.rms_norm), (y, norm, eps), 2 * size(y)),
    ]


def probe_kernels(cfg: RunConfig, device: torch.device, bandwidth: float, repeats: int = 20) -> dict:
    if device.type != "cuda":
        return not_available("no CUDA device: the fused kernels are Triton kernels")
    return {"status": "ok", "copy_bandwidth_bytes_per_s": bandwidth,
            "kernels": [compare_kernel(case, device, bandwidth, repeats)
                        for case in fused_kernel_cases(cfg, device)]}


# --------------------------------------------------------------------------------------------
# Dropout masks.

def mask_agreement(device: torch.device, shapes: Sequence[tuple[int, ...]], seeds: Sequence[int],
                   streams: Sequence[int], p: float) -> list[dict]:
    """Counter-dropout masks on ``device`` against the CPU's, one row per (shape, seed, stream)."""
    rows = []
    for shape in shapes:
        for seed in seeds:
            for stream in streams:
                here = counter_dropout_mask(torch.tensor(seed, device=device), stream,
                                            torch.Size(shape), p, torch.float32).cpu()
                cpu = counter_dropout_mask(torch.tensor(seed), stream, torch.Size(shape), p,
                                           torch.float32)
                rows.append({"shape": list(shape), "seed": seed, "stream": stream,
                             "equal": torch.equal(here, cpu),
                             "mismatches": int((here != cpu).sum()),
                             "keep_fraction": float((cpu != 0).float().mean())})
    return rows


def probe_dropout(cfg: RunConfig, device: torch.device) -> dict:
    if device.type != "cuda":
        return not_available("no CUDA device: the masks would be compared CPU against CPU")
    m, b = cfg.model, cfg.train.micro_batch_size
    shapes = [(m.seq_length, b, m.num_streams * m.hidden_size), (3, 5, 7)]
    rows = mask_agreement(device, shapes, seeds=[0, 1, 2 ** 31 - 2], streams=[0, 1, 2 * m.num_layers - 1],
                          p=m.hidden_dropout or 0.1)
    return {"status": "ok", "all_equal": all(r["equal"] for r in rows), "cases": rows}


# --------------------------------------------------------------------------------------------
# The probe.

def run_probe(cfg: RunConfig, device: torch.device, out_dir: Path,
              parts: Sequence[str] = PARTS) -> dict:
    """Run ``parts`` in order, writing ``out_dir/probe.json`` after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "probe.json"
    report: dict[str, Any] = {"device": device_name(device), "torch": torch.__version__,
                              "backend": cfg.graph.backend, "parts": {}}
    bandwidth = None
    for part in parts:
        begin = time.perf_counter()
        try:
            if part == "pools":
                result = probe_pools(cfg, device)
            elif part == "kernels":
                if bandwidth is None:
                    bandwidth = copy_bandwidth(device, (256 if device.type == "cuda" else 32) << 20)
                result = probe_kernels(cfg, device, bandwidth)
            else:
                result = probe_dropout(cfg, device)
        except torch.OutOfMemoryError as exc:
            result = {"status": "out of memory", "error": str(exc).splitlines()[0]}
        except Exception as exc:  # noqa: BLE001 - one part's failure is reported, the rest runs
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = time.perf_counter() - begin
        report["parts"][part] = result
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[probe] {part}: {result['status']} ({result['seconds']:.1f} s)", file=sys.stderr,
              flush=True)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.lab.benchmarks.gpu_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/bench_h100.yaml")
    parser.add_argument("--out", required=True, help="folder for probe.json")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None)
    parser.add_argument("--backend", choices=("tape", "cuda", "auto"), default=None)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    args = parser.parse_args(argv)

    try:
        parts = [p.strip() for p in args.parts.split(",") if p.strip()]
        unknown = [p for p in parts if p not in PARTS]
        if unknown or not parts:
            raise ConfigError(f"--parts: unknown part(s) {unknown or [args.parts]}; choose from "
                              f"{', '.join(PARTS)}")
        cfg = load_config(args.config)
        device = resolve_device(args.device or cfg.train.device)
        cfg = cfg.replace(graph={"backend": args.backend or cfg.graph.backend},
                          train={"device": device.type})
    except ConfigError as exc:
        for line in exc.problems:
            print(f"mhc_cg.lab.benchmarks.gpu_probe: error: {line}", file=sys.stderr)
        return 2
    report = run_probe(cfg, device, Path(args.out), parts)
    failed = [p for p, r in report["parts"].items() if r["status"] in ("error", "out of memory")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
