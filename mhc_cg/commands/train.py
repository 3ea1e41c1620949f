"""``mhc-cg train``: train the tiny mHC GPT on the synthetic corpus."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "train the mHC GPT of a config on a synthetic corpus; --compare runs every recompute mode"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mhc_cg.lab.registry import MODES

    parser.add_argument("--config", default=None, help="YAML run config (default: embedded tiny CPU model)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None,
                        help="override train.device")
    parser.add_argument("--mode", choices=list(MODES), default=None,
                        help="override the mode the config implies (graphed_static when "
                             "mhc_recompute is in cuda_graph_scope)")
    parser.add_argument("--compare", action="store_true",
                        help="run the same steps in every mode and print one table (with "
                             "parallel.pp_size > 1: the pipeline and the same config on one "
                             "process, pp_size 1)")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from mhc_cg.lab.compare import modes as compare
    from mhc_cg.lab.compare import pipeline as pipeline_compare
    from mhc_cg.config import load_config
    from mhc_cg.lab.registry import REFERENCE
    from mhc_cg.training.device import use_cpu_threads
    from mhc_cg.lab.resolve import train_config

    cfg = load_config(args.config)
    on_cpu = use_cpu_threads(cfg, args.device)
    if cfg.parallel.pp_size > 1:  # one process per pipeline rank
        return pipeline_compare.run(cfg, args)
    progress = not args.no_progress
    if args.compare:
        refused = compare.refused_modes(cfg, args.device)
        results = compare.run_modes(cfg, steps=args.steps, device=args.device, progress=progress,
                                    refused=refused)
        problems = compare.mismatches(results)
        if args.json:
            print(json.dumps({**compare.to_json(results), "refused": refused}, indent=1))
        else:
            _describe(cfg, "all modes")
            print(compare.format_table(results, cpu=on_cpu))
            for mode, why in refused.items():
                print(f"{mode}: not run: {why}")
            if any(r.eval_losses for r in results.values()):
                print("eval loss (after step " + ", ".join(map(str, results[REFERENCE].eval_steps))
                      + "): " + "; ".join(f"{m} {r.eval_losses[-1]:.4f}" for m, r in results.items()))
        for line in problems:
            print(f"mhc-cg train: mismatch: {line}", file=sys.stderr)
        return 0 if not problems else 1
    result = train_config(cfg, steps=args.steps, device=args.device, progress=progress, mode=args.mode)
    mode = result.mode
    if args.json:
        print(json.dumps({"mode": mode, "losses": result.losses, "grad_norms": result.grad_norms,
                          "eval_steps": result.eval_steps, "eval_losses": result.eval_losses,
                          "skipped_steps": result.skipped_steps,
                          "step_ms_median": result.median_step_ms, **result.info}, indent=1))
        return 0
    _describe(cfg, mode)
    print(f"first loss {result.losses[0]:.4f}")
    print(f"last loss  {result.losses[-1]:.4f}")
    print(f"step time  {result.median_step_ms:.1f} ms (median of {len(result.step_times)} steps"
          + ("; host time on the CPU, says nothing about a GPU)" if on_cpu else ")"))
    if result.eval_losses:
        print(f"eval loss  {result.eval_losses[-1]:.4f} (after step {result.eval_steps[-1]})")
    if result.skipped_steps:
        print(f"skipped    {len(result.skipped_steps)} steps with non-finite gradients "
              f"(fp16 loss scaling backs off): {result.skipped_steps}")
    return 0


def _describe(cfg, mode: str) -> None:
    m = cfg.model
    from mhc_cg.config.choices import ARITHMETIC_NAMES

    print(f"mHC GPT ({ARITHMETIC_NAMES[m.arithmetic]}): {m.num_layers} layers, "
          f"hidden {m.hidden_size}, {m.num_streams} streams, "
          f"L_r={m.resolved_recompute_layers}, dropout={m.hidden_dropout} ({m.dropout_impl}); "
          f"mode: {mode}")
