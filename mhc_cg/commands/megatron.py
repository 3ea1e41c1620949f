"""``mhc-cg megatron``: Megatron's own mHC GPT trained under megatron's TE graph helper, or
(``megatron.cuda_graph_impl: full_iteration``) under Megatron-LM dev's ``FullCudaGraphWrapper``,
one process per rank."""

from __future__ import annotations

import argparse
import json
import sys

HELP = ("train Megatron's own mHC GPT (megatron.branch: main, dev, or core with mhc_cg's layer) "
        "under its TECudaGraphHelper with mhc_cg's recompute (or, with megatron.cuda_graph_impl: "
        "full_iteration, under dev's FullCudaGraphWrapper), one process per rank; --compare "
        "also runs it eagerly and under Megatron's own recompute")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="YAML run config (e.g. configs/megatron_main_mhc.yaml, "
                             "configs/megatron_dev_tp2_pp2.yaml, configs/megatron_dev_moe_partial.yaml, "
                             "configs/megatron_dev_full_iteration.yaml; with megatron.entry, "
                             "Megatron's own script: configs/megatron_dev_dsv4.yaml, "
                             "configs/megatron_dev_dsv4_pp2.yaml)")
    parser.add_argument("--compare", action="store_true",
                        help="also run the branch's own runs (BRANCH_eager_none, BRANCH_eager_mhc, "
                             "BRANCH_graphed_mhc; core: core_eager_none, core_eager_block; "
                             "full_iteration: dev_eager_none[_dropout0], dev_full_iteration_mhc; "
                             "megatron.use_fused_mhc: BRANCH_eager_none and mhc_cg_fused_eager); "
                             "exit 1 unless mhc_cg (and dev_full_iteration_mhc) equals its "
                             "references bit for bit on every rank")
    parser.add_argument("--json", action="store_true",
                        help='print {"bit_identical": ..., "runs": {name: {"losses": [...], '
                             '"ranks": [{"rank", "pp_rank", "tp_rank", "ep_rank", "saved_bytes_per_layer", '
                             '"persistent_slot_sets", "arena_bytes", '
                             '"layer_graph_replays_per_step", '
                             '"recompute_graph_replays_per_step", '
                             '"recompute_blocks_kept_per_step", "fused_op_calls_per_step", '
                             '"fused_kernel_launches_per_step"[, full_iteration: '
                             '"iteration_graph_replays", "iteration_graph_replays_per_step", '
                             '"iteration_graph_bytes", "iteration_graph_collectives", '
                             '"eager_sublayer_calls_per_step"]}, ...]}}, "checked": {run: [references]}, '
                             '"use_fused_mhc", "largest_loss_difference_vs_native": {run: float}}')
    parser.add_argument("--no-progress", action="store_true", help="no per-step lines on stderr")
    parser.add_argument("--layer-cost", action="store_true",
                        help="count the kernels and bytes of one step of the branch's mHC layer, "
                             "Megatron's native ops against mhc_cg's fused kernels (on meta "
                             "tensors, no training)")
    parser.add_argument("--layer-time", action="store_true",
                        help="time one step of the branch's mHC layer native (compiled on a GPU), "
                             "with mhc_cg's fused kernels and (dev) with dev's own fused module, "
                             "in one process")
    parser.add_argument("--steps", type=int, default=10,
                        help="with --layer-time: timed steps after 3 warm-up steps (default 10)")
    parser.add_argument("--shape", metavar="YAML",
                        help="with --layer-cost or --layer-time: the model shape (hidden, heads, "
                             "FFN, sequence, micro-batch) of this config, e.g. "
                             "configs/bench_h100.yaml")


def run(args: argparse.Namespace) -> int:
    from mhc_cg.config import load_config
    from mhc_cg.lab.megatron_harness import compare as megatron_compare

    cfg = load_config(args.config)
    if args.shape and not (args.layer_cost or args.layer_time):
        print("mhc-cg megatron: error: --shape is for --layer-cost and --layer-time; add one or "
              "drop --shape", file=sys.stderr)
        return 2
    if args.steps < 1:
        print(f"mhc-cg megatron: error: --steps {args.steps}: time at least 1 step",
              file=sys.stderr)
        return 2
    if cfg.megatron.entry is not None:
        return run_entry(cfg, args)
    shape = load_config(args.shape) if args.shape else None
    if args.layer_cost:
        cost = megatron_compare.layer_cost(cfg, shape)
        print(json.dumps(cost, indent=1) if args.json else megatron_compare.format_layer_cost(cost))
        return 0
    if args.layer_time:
        timed = megatron_compare.layer_time(cfg, shape, steps=args.steps)
        print(json.dumps(timed, indent=1) if args.json
              else megatron_compare.format_layer_time(timed))
        return 0
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


def run_entry(cfg, args: argparse.Namespace) -> int:
    """A config with ``megatron.entry``: Megatron-LM's own script, one process per rank
    (:mod:`mhc_cg.lab.megatron_harness.entry_runs`)."""
    from mhc_cg.lab.megatron_harness import entry_runs

    if args.layer_cost or args.layer_time or args.shape:
        print("mhc-cg megatron: error: --layer-cost, --layer-time and --shape measure mhc_cg's "
              "harness model, not a megatron.entry run; drop them or megatron.entry",
              file=sys.stderr)
        return 2
    try:
        result = entry_runs.run(cfg, args.compare, progress=not args.no_progress)
    except RuntimeError as exc:  # a rank failed: its own output says why
        print(f"mhc-cg megatron: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(entry_runs.to_json(result), indent=1) if args.json
          else entry_runs.format_table(result))
    for line in result["mismatches"]:
        print(f"mhc-cg megatron: mismatch: {line}", file=sys.stderr)
    return 1 if result["bit_identical"] is False else 0
