"""``mhc-cg timeline compare A B``: two profiles side by side per NVTX range, as a table, JSON or PNG."""

from __future__ import annotations

import argparse
import json

from mhc_cg.lab.profiling.traces import compare, comparison_json, format_comparison, read_timeline

HELP = "compare two profiles (nsys .sqlite exports or torch.profiler Chrome traces) per NVTX range"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="timeline_command", required=True, metavar="ACTION")
    cmp = sub.add_parser(
        "compare", help="per range name: GPU time, kernels, launches, CPU launch gaps, GPU idle; B - A",
        description="Per NVTX / record_function range name (instances summed): GPU time, kernel "
                    "count, launch calls, CPU gaps between launches and GPU idle time, for A and B "
                    "side by side with B - A. CPU-only Chrome traces count top-level CPU operators "
                    "as the device's work (the output header says which meaning applies).")
    cmp.add_argument("a", help="profile A: nsys export (.sqlite) or Chrome trace (.json / .json.gz)")
    cmp.add_argument("b", help="profile B, same formats")
    cmp.add_argument("--labels", nargs=2, metavar=("A_NAME", "B_NAME"), default=None,
                     help="names for A and B in the output (default: the file names)")
    cmp.add_argument("--json", action="store_true", help="print JSON instead of the table")
    cmp.add_argument("--png", default=None, metavar="OUT.png",
                     help="also write both timelines on one time axis and GPU time per range")


def run(args: argparse.Namespace) -> int:
    a, b = read_timeline(args.a), read_timeline(args.b)
    labels = tuple(args.labels) if args.labels else (a.path.name, b.path.name)
    comparison = compare(a, b, labels)
    if args.json:
        print(json.dumps(comparison_json(comparison), indent=1))
    else:
        print(format_comparison(comparison))
    if args.png:
        from mhc_cg.lab.profiling.traces_plot import plot_comparison  # matplotlib only when a PNG is asked for

        written = plot_comparison(comparison, args.png)
        if not args.json:
            print(f"\nwrote {written}")
    return 0
