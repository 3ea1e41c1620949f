"""``mhc-cg bench``: time every training mode in alternation; JSON + markdown under bench/results/.

Prints the markdown table and the targets check on stdout, progress on stderr. See
``mhc_cg/tools/bench.py`` for what is measured and ``bench/README.md`` for running it on a GPU.
"""

from __future__ import annotations

import argparse

from mhc_cg.runtime.modes.registry import MODES
from mhc_cg.tools.bench import CPU_CAVEAT, BenchOptions, markdown, parse_modes, run_bench, \
    write_results
from mhc_cg.config import load_config
from mhc_cg.core.errors import ConfigError
from mhc_cg.config.choices import GRAPH_BACKENDS
from mhc_cg.training.device import resolve_device

HELP = ("benchmark eager / graphed modes with and without mHC recompute: peak memory, step time, "
        "tokens/s, recompute graph vs its bandwidth bound")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/bench_h100.yaml", help="YAML run config "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode after "
                        "building (default 3)")
    parser.add_argument("--chunk", type=int, default=5, help="timed steps of one mode per round "
                        "of the alternation (default 5)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of "
                        f"{','.join(MODES)} (default: all)")
    parser.add_argument("--out-dir", default="bench/results", help="where <device-slug>.json/.md "
                        "go (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None,
                        help="default: the config's train.device")
    parser.add_argument("--backend", choices=GRAPH_BACKENDS, default=None,
                        help="graph backend (default: the config's graph.backend)")
    parser.add_argument("--recompute-replays", type=int, default=50,
                        help="replays of the recompute graph to time (default 50)")
    parser.add_argument("--moe-experts", type=int, default=8, help="experts in moe_partial (default 8)")
    parser.add_argument("--moe-top-k", type=int, default=2, help="top-k in moe_partial (default 2)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="build and time one mode at a time (no alternation; less memory)")


def run(args: argparse.Namespace) -> int:
    modes = parse_modes(args.modes)  # before loading anything: a typo fails fast
    cfg = load_config(args.config)
    device = resolve_device(args.device or cfg.train.device)
    backend = args.backend or cfg.graph.backend
    if device.type == "cpu" and backend in ("cuda", "te"):
        raise ConfigError(f"--backend {backend} needs a CUDA device but the run is on CPU; "
                          f"use --backend tape (or auto) with --device cpu")
    if not 1 <= args.moe_top_k <= args.moe_experts:
        raise ConfigError(f"--moe-top-k: must be in [1, --moe-experts={args.moe_experts}], "
                          f"got {args.moe_top_k}")
    cfg = cfg.replace(graph={"backend": backend}, train={"device": device.type})
    opts = BenchOptions(modes=modes, steps=args.steps, warmup=args.warmup, chunk=args.chunk,
                        recompute_replays=args.recompute_replays, moe_experts=args.moe_experts,
                        moe_top_k=args.moe_top_k, one_at_a_time=args.one_at_a_time,
                        bandwidth_bytes=(256 if device.type == "cuda" else 32) * 2 ** 20)
    if device.type != "cuda":
        print(f"NOTE: {CPU_CAVEAT}.\n")
    # written after each mode, so a run cut short (time limit, OOM) keeps what it measured
    report = run_bench(cfg, device, opts,
                       on_mode_done=lambda partial: write_results(partial, args.out_dir))
    json_path, md_path = write_results(report, args.out_dir)
    print(markdown(report))
    print(f"wrote {json_path} and {md_path}")
    return 0
