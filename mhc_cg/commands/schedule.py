"""``mhc-cg schedule``: per pipeline rank, the graph order and the static buffers it needs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from mhc_cg.core.errors import ConfigError
from mhc_cg.core.pipeline_order import schedule_problems

if TYPE_CHECKING:
    from mhc_cg.lab.planning.planner import RankPlan

HELP = "simulate the PP/VPP 1F1B order per rank and plan its static buffers (graphs, inputs, mHC sets)"

# Planner argument -> the flag a user types, so errors name what can be fixed.
FLAGS = {"pp_size": "--pp", "vpp_size": "--vpp", "num_microbatches": "--microbatches",
         "microbatch_group_size": "--group-size", "num_layers": "--layers",
         "hidden_size": "--hidden", "seq_length": "--seq", "micro_batch_size": "--mbs",
         "num_streams": "--streams", "dtype": "--dtype", "recompute_layers": "--recompute-layers"}
# Used when neither a flag nor --config gives a value: a 7B-class layer, 4 streams, bf16.
DEFAULTS = {"pp_size": 1, "vpp_size": 1, "num_microbatches": 8, "num_layers": 32,
            "microbatch_group_size": None, "hidden_size": 4096, "seq_length": 4096,
            "micro_batch_size": 1, "num_streams": 4, "recompute_layers": None}


# Forward and backward passes simulated over all ranks (pp * vpp * M * 2): beyond these the
# simulation takes minutes and gigabytes, the plot becomes unreadable; refused up front.
MAX_SIMULATED_PASSES = 2 ** 16
MAX_PLOTTED_PASSES = 2 ** 13


def size_problems(values: dict, png: bool) -> list[str]:
    """The run's size against the limits, one line per broken limit (flag, size, fix)."""
    sizes = [values[k] for k in ("pp_size", "vpp_size", "num_microbatches")]
    if not all(isinstance(v, int) and v >= 1 for v in sizes):
        return []  # schedule_problems reports these
    passes = 2 * sizes[0] * sizes[1] * sizes[2]
    problems = []
    if passes > MAX_SIMULATED_PASSES:
        problems.append(f"--pp/--vpp/--microbatches: pp * vpp * microbatches * 2 = {passes} "
                        f"passes to simulate, above the limit of {MAX_SIMULATED_PASSES} (beyond it "
                        f"the simulation takes minutes and gigabytes); lower --microbatches (the "
                        f"buffer counts stop growing past a few times --pp) or --pp")
    elif png and passes > MAX_PLOTTED_PASSES:
        problems.append(f"--png: {passes} passes to draw, above the limit of {MAX_PLOTTED_PASSES} "
                        f"for a readable plot; lower --microbatches or --pp, or use --trace")
    return problems


def output_problems(args: argparse.Namespace) -> list[str]:
    """``--trace``/``--png`` paths whose folder is missing, before any work is done."""
    problems = []
    for flag, value in (("--trace", args.trace), ("--png", args.png)):
        if value is None:
            continue
        folder = Path(value).parent
        if not folder.is_dir():
            problems.append(f"{flag}: folder {str(folder)!r} does not exist; create it "
                            f"(mkdir -p {folder}) or write elsewhere")
        elif Path(value).is_dir():
            problems.append(f"{flag}: {value!r} is a folder; give a file name")
    return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mhc_cg.core.dtypes import DTYPE_BYTES

    parser.add_argument("--pp", type=int, dest="pp_size", help="pipeline-parallel size (default 1)")
    parser.add_argument("--vpp", type=int, dest="vpp_size", help="model chunks per rank (default 1)")
    parser.add_argument("--microbatches", type=int, dest="num_microbatches",
                        help="microbatches per step, M (default 8)")
    parser.add_argument("--layers", type=int, dest="num_layers",
                        help="graphed transformer layers in the model (default 32)")
    parser.add_argument("--group-size", type=int, dest="microbatch_group_size",
                        help="microbatches per virtual-stage group (default --pp)")
    parser.add_argument("--hidden", type=int, dest="hidden_size", help="hidden size C (default 4096)")
    parser.add_argument("--seq", type=int, dest="seq_length", help="sequence length (default 4096)")
    parser.add_argument("--mbs", type=int, dest="micro_batch_size", help="micro-batch size (default 1)")
    parser.add_argument("--streams", type=int, dest="num_streams", help="mHC streams n (default 4)")
    parser.add_argument("--dtype", choices=list(DTYPE_BYTES), default="bf16",
                        help="activation dtype (default bf16)")
    parser.add_argument("--recompute-layers", type=int, dest="recompute_layers",
                        help="layers per recompute block L_r (default sqrt(n*L/(n+2)) per chunk)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML run config: model, parallel and train.micro_batch_size / "
                             "num_microbatches are read from it; flags override")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--trace", default=None, metavar="OUT.json",
                        help="write a Chrome/Perfetto trace of every rank's simulated timeline")
    parser.add_argument("--png", default=None, metavar="OUT.png",
                        help="write the timeline and each rank's buffer lifetimes as a PNG")


def resolve(args: argparse.Namespace) -> dict:
    """Flag, else --config, else DEFAULTS, for every planner argument."""
    values = dict(DEFAULTS)
    if args.config is not None:
        from mhc_cg.config import load_config

        cfg = load_config(args.config)
        values.update(pp_size=cfg.parallel.pp_size, vpp_size=cfg.parallel.vpp_size,
                      microbatch_group_size=cfg.parallel.microbatch_group_size,
                      num_microbatches=cfg.train.num_microbatches,
                      micro_batch_size=cfg.train.micro_batch_size,
                      num_layers=cfg.model.num_layers, hidden_size=cfg.model.hidden_size,
                      seq_length=cfg.model.seq_length, num_streams=cfg.model.num_streams,
                      recompute_layers=cfg.model.recompute_layers)
    for name in DEFAULTS:
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    return values


def _flag_errors(exc: ConfigError) -> ConfigError:
    lines = []
    for line in exc.problems:
        name, sep, rest = line.partition(":")
        lines.append(f"{FLAGS[name]}{sep}{rest}" if name in FLAGS else line)
    return ConfigError(lines)


def build_plans(values: dict, dtype: str) -> list[RankPlan]:
    """Plan every rank; all bad values are reported together, each naming its flag."""
    from mhc_cg.lab.planning.planner import ModelShape, layers_per_chunk, plan

    problems = schedule_problems(values["pp_size"], 0, values["num_microbatches"],
                                 values["vpp_size"], values["microbatch_group_size"])
    shape = None
    try:
        shape = ModelShape(hidden_size=values["hidden_size"], seq_length=values["seq_length"],
                           micro_batch_size=values["micro_batch_size"],
                           num_streams=values["num_streams"], dtype=dtype,
                           recompute_layers=values["recompute_layers"])
    except ConfigError as exc:
        problems += exc.problems
    if not problems:
        try:
            layers_per_chunk(values["num_layers"], values["pp_size"], values["vpp_size"])
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise _flag_errors(ConfigError(problems))
    return plan(values["pp_size"], values["vpp_size"], values["num_microbatches"],
                values["num_layers"], values["microbatch_group_size"], shape)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB"


def format_plans(plans: list[RankPlan], values: dict, dtype: str) -> str:
    first = plans[0]
    group = values["microbatch_group_size"] or values["pp_size"]
    lines = [
        f"pp={values['pp_size']} vpp={values['vpp_size']} M={values['num_microbatches']} "
        f"group={group if values['vpp_size'] > 1 else '-'} layers={values['num_layers']} "
        f"({first.layers_per_chunk} per chunk), recompute blocks of {first.recompute_block_size} "
        f"layer(s) ({first.blocks_per_chunk} per chunk)",
        f"shape: hidden {values['hidden_size']}, seq {values['seq_length']}, "
        f"mbs {values['micro_batch_size']}, streams {values['num_streams']}, {dtype}",
        "",
    ]
    header = ("rank", "graphs", "recompute graphs", "kept / step", "static inputs", "no reuse",
              "slot sets", "peak in flight", "static input bytes", "persistent bytes",
              "arena bytes", "buffer check")
    rows = [(str(p.rank), str(p.num_graphs), str(p.recompute_graphs), str(p.recomputes_kept),
             str(p.static_input_buffers),
             str(p.static_input_buffers_no_reuse), str(p.persistent_slot_sets),
             str(p.peak_in_flight), _gib(p.static_input_bytes), _gib(p.persistent_bytes),
             _gib(p.arena_bytes), "ok" if p.conflict is None else "CONFLICT") for p in plans]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    lines.append("")
    lines += [f"order rank {p.rank}: {' '.join(str(c) for c in p.order)}" for p in plans]
    lines += [f"rank {p.rank}: first conflict: {p.conflict}" for p in plans if p.conflict]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    values = resolve(args)
    problems = output_problems(args) + size_problems(values, args.png is not None)
    if problems:
        raise ConfigError(problems)
    plans = build_plans(values, args.dtype)
    if args.json:
        print(json.dumps({"pp": values["pp_size"], "vpp": values["vpp_size"],
                          "microbatches": values["num_microbatches"],
                          "group_size": None if values["vpp_size"] == 1  # unused by plain 1F1B
                          else values["microbatch_group_size"] or values["pp_size"],
                          "layers": values["num_layers"], "dtype": args.dtype,
                          "shape": {k: values[k] for k in ("hidden_size", "seq_length",
                                                           "micro_batch_size", "num_streams",
                                                           "recompute_layers")},
                          "ranks": [p.summary() for p in plans]}, indent=1))
    else:
        print(format_plans(plans, values, args.dtype))
    written = []
    if args.trace:
        from mhc_cg.lab.planning.plot import write_trace

        written.append(write_trace(plans, args.trace))
    if args.png:
        from mhc_cg.lab.planning.plot import plot_schedule  # matplotlib only when a PNG is asked for

        group = values["microbatch_group_size"] or values["pp_size"]
        title = (f"mhc-cg schedule: pp {values['pp_size']}, vpp {values['vpp_size']}, "
                 f"M {values['num_microbatches']}, group {group}, {values['num_layers']} layers")
        written.append(plot_schedule(plans, args.png, title=title))
    if not args.json:
        for path in written:
            print(f"wrote {path}")
    return 1 if any(p.conflict for p in plans) else 0
