"""``mhc-cg cost``: kernels, bytes and graph-pool memory per training step, per mode, on meta or cpu."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.cost.gpus import GPUS
from mhc_cg.core.progress import log

HELP = "GPU cost without a GPU: kernels, bytes and capture-pool memory of every mode's step"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mhc_cg.lab.cost.report import DEVICES

    parser.add_argument("--config", default=None, help="YAML run config (default: embedded tiny model)")
    parser.add_argument("--device", choices=DEVICES, default="meta",
                        help="meta: nothing allocated, any size (attention as the GPU's fused "
                             "kernel); cpu: the ops really run")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--summary", action="store_true", help="only the per-mode tables")
    parser.add_argument("--live", action="store_true",
                        help="also what is live at each mode's peak: the static buffers, each "
                             "graph pool's high-water mark (the capture that set it, the "
                             "tensors live then) and the step's eager storages, by what made "
                             "them")
    parser.add_argument("--gpu", choices=sorted(GPUS), default=None,
                        help="the GPU the step is modelled on (default: h100); "
                             "mhc_cg/lab/cost/gpus.py says where each figure comes from")
    parser.add_argument("--full-bandwidth", action="store_true",
                        help="time every kernel at the HBM peak, one figure (default: a band, "
                             "bytes at the copy bandwidth the GPU measured, each fused op from "
                             "that to its kind's eager-measured share until this code's kernels "
                             "are timed: bench/results/kernel_efficiency.json)")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="also draw each mode's peak memory against its modelled step time")


def run(args: argparse.Namespace) -> int:
    from mhc_cg.config import load_config
    from mhc_cg.lab.cost.report import cost_report, format_live, format_report

    cfg = load_config(args.config)
    if args.plot:
        _check_writable(Path(args.plot))
    report = cost_report(cfg, args.device, args.config, measured=not args.full_bandwidth,
                         gpu=args.gpu)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, not args.summary))
        if args.live:
            print("\n".join(format_live(report)))
    if args.plot:
        from mhc_cg.lab.cost.frontier_plot import plot_frontier

        log("cost", f"frontier written to {plot_frontier(report, args.plot)}")
    return 0


def _check_writable(path: Path) -> None:
    """Refuse a ``--plot`` path that cannot be written, before the costing starts."""
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot: {path} is not a .png; give a path ending in .png")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot create {path.parent} ({exc.strerror}); give a "
                          f"writable path") from None
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"--plot: {path.parent} is not writable; give a writable path")
