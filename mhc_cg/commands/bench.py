"""``mhc-cg bench``: every training mode at each shape, each in a process of its own; JSON per
shape and one markdown under bench/results/.

Prints the markdown tables and the targets check on stdout, progress on stderr. See
``mhc_cg/lab/benchmarks/runner.py`` for what is measured and ``bench/README.md`` for running it on a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mhc_cg.core.errors import ConfigError

HELP = ("benchmark every mode, each in its own process: peak memory, step time, GPU ms per phase, "
        "the fused ops' GB/s, recompute graph vs its bandwidth bound")
SHAPES = ("configs/bench_h100.yaml", "configs/bench_h100_memory.yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mhc_cg.config.choices import GRAPH_BACKENDS
    from mhc_cg.lab.registry import MODES

    parser.add_argument("--config", action="append", default=None, metavar="YAML",
                        help="a shape to run (repeat for several; default: "
                             f"{' and '.join(SHAPES)}: the bench shape and a memory shape)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode after "
                        "building (default 2)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler "
                        "after the timed ones (default 2)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of "
                        f"{','.join(MODES)} (default: all)")
    parser.add_argument("--out-dir", default="bench/results", help="where "
                        "<device-slug>.<shape>.json and <device-slug>.md go (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None,
                        help="default: the first config's train.device")
    parser.add_argument("--backend", choices=GRAPH_BACKENDS, default=None,
                        help="graph backend (default: each config's graph.backend)")
    parser.add_argument("--recompute-replays", type=int, default=50,
                        help="replays of the recompute graph to time (default 50)")
    parser.add_argument("--moe-experts", type=int, default=8, help="experts in moe_partial (default 8)")
    parser.add_argument("--moe-top-k", type=int, default=2, help="top-k in moe_partial (default 2)")
    parser.add_argument("--mode-timeout", type=float, default=None, metavar="S",
                        help="seconds one mode's process may take, build included (default: none)")
    parser.add_argument("--trace-dir", default=None, help="keep each mode's profiler trace here")


def run(args: argparse.Namespace) -> int:
    from mhc_cg.lab.benchmarks.runner import (CPU_CAVEAT, BenchOptions, markdown, parse_modes,
                                          run_bench, write_results)
    from mhc_cg.config import load_config
    from mhc_cg.training.device import resolve_device

    modes = parse_modes(args.modes)  # before loading anything: a typo fails fast
    paths = args.config or list(SHAPES)
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) != len(stems):
        raise ConfigError(f"--config: two shapes share a file name ({', '.join(paths)}); each "
                          f"shape's results are named by it")
    configs = [load_config(p) for p in paths]
    device = resolve_device(args.device or configs[0].train.device)
    if not 1 <= args.moe_top_k <= args.moe_experts:
        raise ConfigError(f"--moe-top-k: must be in [1, --moe-experts={args.moe_experts}], "
                          f"got {args.moe_top_k}")
    shapes = []
    for stem, cfg in zip(stems, configs):
        backend = args.backend or cfg.graph.backend
        if device.type == "cpu" and backend == "cuda":
            raise ConfigError("--backend cuda needs a CUDA device but the run is on CPU; use "
                              "--backend tape (or auto, or te: TransformerEngine's function over "
                              "the tape) with --device cpu")
        shapes.append((stem, cfg.replace(graph={"backend": backend},
                                         train={"device": device.type})))
    opts = BenchOptions(modes=modes, steps=args.steps, warmup=args.warmup,
                        profile_steps=args.profile_steps, recompute_replays=args.recompute_replays,
                        moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                        mode_timeout_s=args.mode_timeout, trace_dir=args.trace_dir,
                        bandwidth_bytes=(256 if device.type == "cuda" else 32) * 2 ** 20)
    if device.type != "cuda":
        print(f"NOTE: {CPU_CAVEAT}.\n")
    done: dict[str, dict] = {}

    def keep(report: dict) -> None:  # written after each mode: a run cut short keeps its results
        done[report["shape"]] = report
        write_results(list(done.values()), args.out_dir)

    reports = run_bench(shapes, device, opts, on_shape_done=keep)
    written = write_results(reports, args.out_dir)
    print(markdown(reports))
    print("wrote " + ", ".join(map(str, written)))
    return 0
