"""``mhc-cg megatron``: Megatron-LM main's mHC GPT trained under megatron's TE graph helper."""

from __future__ import annotations

import argparse
import json
import sys

from mhc_cg.config import load_config
from mhc_cg.tools import megatron_compare

HELP = ("train Megatron-LM main's mHC GPT under megatron-core's TECudaGraphHelper with mhc_cg's "
        "recompute; --compare also runs main eagerly and under its own helper")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="YAML run config (e.g. configs/megatron_main_mhc.yaml)")
    parser.add_argument("--compare", action="store_true",
                        help="also run main_eager_none, main_eager_mhc and main_graphed_mhc; exit 1 "
                             "unless mhc_cg equals the first two bit for bit")
    parser.add_argument("--json", action="store_true",
                        help='print {"bit_identical": ..., "runs": {name: {"losses": [...], '
                             '"saved_bytes_per_layer": ..., "layer_graph_replays_per_step": ..., '
                             '"recompute_graph_replays_per_step": ...}}}')
    parser.add_argument("--no-progress", action="store_true", help="no per-step lines on stderr")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    try:
        result = megatron_compare.run(cfg, args.compare, progress=not args.no_progress)
    except RuntimeError as exc:  # the child process failed: its own output says why
        print(f"mhc-cg megatron: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(megatron_compare.to_json(result), indent=1))
    else:
        print(megatron_compare.format_table(cfg, result))
    for line in result["mismatches"]:
        print(f"mhc-cg megatron: mismatch: {line}", file=sys.stderr)
    return 1 if result["bit_identical"] is False else 0
