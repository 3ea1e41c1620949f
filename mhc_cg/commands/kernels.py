"""``mhc-cg kernels``: every fused Triton kernel compiled ahead of time for a GPU (none needed here):
registers, stack, local and shared memory per kernel, the warps an SM keeps resident and the bytes
they keep in flight against the bandwidth-latency product; exit status 1 if any kernel spills."""

from __future__ import annotations

import argparse
import json
import sys

from mhc_cg.core.errors import ConfigError
from mhc_cg.core.progress import log
from mhc_cg.ops.kernels.dispatch import interpret_requested, triton_installed
from mhc_cg.tools.kernel_compile import (DEFAULT_HIDDEN, DEFAULT_TARGET, DEFAULT_TOKENS,
                                         format_report, kernel_report)

HELP = ("compile every fused Triton kernel for a GPU ahead of time (no GPU needed): registers, "
        "shared memory, spills, bytes in flight per SM")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"CUDA target, e.g. sm_80, sm_90a (H100), sm_100a (default {DEFAULT_TARGET})")
    parser.add_argument("--hidden", default=",".join(map(str, DEFAULT_HIDDEN)),
                        help="hidden sizes, comma-separated (default %(default)s); n = 4, bf16")
    parser.add_argument("--tokens", default=str(DEFAULT_TOKENS),
                        help="tokens per microbatch, seq x micro-batch (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


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


def run(args: argparse.Namespace) -> int:
    hidden = _integers("--hidden", args.hidden, "2048,7168")
    tokens = _integers("--tokens", args.tokens, str(DEFAULT_TOKENS))
    if len(tokens) != 1:
        raise ConfigError(f"--tokens: give one token count, got {args.tokens!r}")
    if not triton_installed():
        raise ConfigError("compiling the kernels needs the triton package; pip install triton")
    if interpret_requested() and not args.no_progress:
        log("kernels", "TRITON_INTERPRET is set: compiling in a child process without it")
    report = kernel_report(hidden, args.target, tokens[0], progress=not args.no_progress)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    for line in report["spilled"]:
        print(f"mhc-cg kernels: spills: {line}", file=sys.stderr)
    return 1 if report["spilled"] else 0
