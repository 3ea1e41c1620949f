"""``mhc-cg kernels``: every fused Triton kernel compiled ahead of time for a GPU (none needed here):
registers, stack, local and shared memory per kernel, the warps an SM keeps resident and the bytes
they keep in flight against the bandwidth-latency product; exit status 1 if any kernel spills."""

from __future__ import annotations

import argparse
import json
import sys

from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.cost.gpus import DEFAULT_GPU, GPUS
from mhc_cg.core.progress import log

HELP = ("compile every fused Triton kernel for a GPU ahead of time (no GPU needed): registers, "
        "shared memory, spills, bytes in flight per SM")


BENCH_OUT = "bench/results/kernels"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mhc_cg.lab.benchmarks.kernel_compile import DEFAULT_HIDDEN, DEFAULT_TARGET, DEFAULT_TOKENS

    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"CUDA target, e.g. sm_80, sm_90a (H100), sm_100a (default {DEFAULT_TARGET})")
    parser.add_argument("--hidden", default=",".join(map(str, DEFAULT_HIDDEN)),
                        help="hidden sizes, comma-separated (default %(default)s); n = 4, bf16")
    parser.add_argument("--tokens", default=str(DEFAULT_TOKENS),
                        help="tokens per microbatch, seq x micro-batch (default %(default)s)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default=DEFAULT_GPU,
                        help="the GPU whose SMs and HBM peak the bytes-in-flight check uses "
                             "(default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    bench = parser.add_argument_group("--bench: time the fused ops on the device (CUDA)")
    bench.add_argument("--bench", action="store_true",
                       help="time every fused op of an eager step: device time of its kernels, "
                            "host time per call, GB/s against the cost model's bytes")
    bench.add_argument("--sweep", action="store_true",
                       help="with --bench: time every launch configuration of the tunable "
                            "kernels; the fastest go into OUT/launch_configs.json")
    bench.add_argument("--config", action="append", default=None, metavar="YAML",
                       help="with --bench or --peers: a shape (repeat; default: "
                            "configs/bench_h100.yaml and configs/bench_h100_memory.yaml)")
    bench.add_argument("--steps", type=int, default=2, help="with --bench: profiled steps (2)")
    bench.add_argument("--out", default=BENCH_OUT,
                       help="with --bench: where kernel_bench.json, kernel_efficiency.json and "
                            "launch_configs.json go (default: %(default)s)")
    bench.add_argument("--dry-run", action="store_true",
                       help="with --bench or --peers: on the CPU at tiny shapes, the Triton "
                            "kernels through Triton's interpreter (CI)")
    peers = parser.add_argument_group("--peers: ours beside TransformerEngine's, Megatron-LM "
                                      "dev's and torch's mHC ops")
    peers.add_argument("--peers", action="store_true",
                       help="each mHC op family (pre, post, their backwards, a whole sublayer) "
                            "on the same inputs through ours and each peer: the numerics, and on "
                            "a GPU device time and GB/s; JSON and a markdown table under --out "
                            "(default bench/results/peers)")


def _integers(option: str, text: str, example: str) -> list[int]:
    values = []
    for part in str(text).split(","):
        try:
            value = int(part.strip())
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"{option}: {part.strip()!r} is not a positive integer; "
                              f"e.g. {option} {example}")
        values.append(value)
    return values


DRY_SHAPES = {"dry_bench": dict(seq_length=4, hidden_size=16), "dry_memory": dict(seq_length=8,
                                                                                  hidden_size=16)}


def _bench_argv(args: argparse.Namespace) -> list[str]:
    """This ``--bench`` call's command line, for the child that reruns it."""
    flags = [f for f, on in (("--sweep", args.sweep), ("--dry-run", args.dry_run),
                             ("--json", args.json), ("--no-progress", args.no_progress)) if on]
    configs = [a for path in args.config or () for a in ("--config", path)]
    return ["kernels", "--bench", *flags, *configs, "--steps", str(args.steps), "--out", args.out]


def run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mhc_cg.lab.benchmarks import kernel_bench
    from mhc_cg.commands.bench import SHAPES
    from mhc_cg.config import load_config
    from mhc_cg.ops.kernels.dispatch import interpret_requested
    from mhc_cg.training.device import resolve_device

    if args.steps < 1:
        raise ConfigError(f"--steps: must be a positive integer, got {args.steps}")
    if args.dry_run:
        if not interpret_requested():
            return kernel_bench.run_interpreted(_bench_argv(args))
        base = load_config(None).replace(
            model={"vocab_size": 16, "num_heads": 2, "num_layers": 2, "sinkhorn_iterations": 4},
            train={"micro_batch_size": 1, "device": "cpu"})
        shapes = [(name, base.replace(model=shape)) for name, shape in DRY_SHAPES.items()]
        device = resolve_device("cpu")
    else:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--bench: times the kernels on a GPU and this machine has none; "
                              "add --dry-run to rehearse it on the CPU")
        paths = args.config or list(SHAPES)
        shapes = [(Path(p).stem, load_config(p)) for p in paths]
        device = resolve_device("cuda")
    report = kernel_bench.run(shapes, device, args.steps, args.sweep, Path(args.out),
                              limit=2 if args.dry_run else None, progress=not args.no_progress)
    print(json.dumps(report, indent=2) if args.json else kernel_bench.format_report(report))
    return 0


def run_peers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mhc_cg.lab.benchmarks import kernel_peers
    from mhc_cg.commands.bench import SHAPES
    from mhc_cg.config import load_config

    if args.bench or args.sweep:
        raise ConfigError("--peers runs apart from --bench and --sweep; give one of them")
    out = Path(args.out if args.out != BENCH_OUT else kernel_peers.OUT)
    if args.dry_run:
        shapes, dtypes, device = [kernel_peers.DRY_SHAPE], list(kernel_peers.DRY_DTYPES), "cpu"
    else:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--peers: times the kernels on a GPU and this machine has none; "
                              "add --dry-run to compare their numerics on the CPU")
        shapes = []
        for path in args.config or list(SHAPES):
            cfg = load_config(path)
            shapes.append({"name": Path(path).stem, "seq": cfg.model.seq_length,
                           "batch": cfg.train.micro_batch_size, "hidden": cfg.model.hidden_size})
        dtypes, device = ["bfloat16"], "cuda"
    report = kernel_peers.run(shapes, dtypes, device, args.dry_run, Path.cwd(), out,
                              progress=not args.no_progress)
    print(json.dumps(report, indent=2) if args.json else kernel_peers.format_report(report))
    bad = [r for r in report["rows"] if not r["ok"]]
    for r in bad:
        print(f"mhc-cg kernels --peers: {r['peer']} differs from ours at {r['op']} "
              f"({r['shape']}, {r['dtype']}): {r['worst']}", file=sys.stderr)
    return 1 if bad else 0


def run(args: argparse.Namespace) -> int:
    from mhc_cg.lab.benchmarks.kernel_compile import DEFAULT_TOKENS, format_report, kernel_report
    from mhc_cg.ops.kernels.dispatch import interpret_requested, triton_installed

    if args.peers:
        return run_peers(args)
    if args.bench:
        return run_bench(args)
    if args.sweep or args.dry_run:
        raise ConfigError("--sweep and --dry-run go with --bench or --peers; add one")
    hidden = _integers("--hidden", args.hidden, "2048,7168")
    tokens = _integers("--tokens", args.tokens, str(DEFAULT_TOKENS))
    if len(tokens) != 1:
        raise ConfigError(f"--tokens: give one token count, got {args.tokens!r}")
    if not triton_installed():
        raise ConfigError("compiling the kernels needs the triton package; pip install triton")
    if interpret_requested() and not args.no_progress:
        log("kernels", "TRITON_INTERPRET is set: compiling in a child process without it")
    report = kernel_report(hidden, args.target, tokens[0], progress=not args.no_progress,
                           gpu=args.gpu)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    for line in report["spilled"]:
        print(f"mhc-cg kernels: spills: {line}", file=sys.stderr)
    return 1 if report["spilled"] else 0
