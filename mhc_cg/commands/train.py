"""``mhc-cg train``: train the tiny mHC GPT on the synthetic corpus."""

from __future__ import annotations

import argparse

from ..config import load_config
from ..train import train

HELP = "train the mHC GPT of a config on a synthetic corpus and print the loss"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML run config (default: embedded tiny CPU model)")
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None,
                        help="override train.device")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    m = cfg.model
    print(f"mHC GPT: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_streams} streams, "
          f"recompute={m.recompute}, dropout={m.hidden_dropout} ({m.dropout_impl})")
    result = train(cfg, steps=args.steps, device=args.device, progress=not args.no_progress)
    print(f"first loss {result.losses[0]:.4f}")
    print(f"last loss  {result.losses[-1]:.4f}")
    print(f"step time  {result.median_step_ms:.1f} ms (median of {len(result.step_times)} steps)")
    return 0
