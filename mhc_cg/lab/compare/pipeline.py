"""``mhc-cg train`` for a config with ``parallel.pp_size > 1``: run the ranks, print what they report.

Prints the per-step losses the last stage computes and the gradient norms, and per rank the
static buffers it used beside the planner's figures. ``--compare`` also trains the same config
with ``pp_size: 1, vpp_size: 1`` in this process and checks both runs agree: the losses bit for
bit, the gradient norms within :data:`NORM_RTOL` (every rank's squared norm summed over the ranks,
as Megatron does, rounds differently from one sum; exit status 1 if they do not).
"""

from __future__ import annotations

import argparse
import json

from mhc_cg.config import RunConfig
from mhc_cg.lab.pipeline.driver import PipelineResult, train_pipeline
from mhc_cg.lab.resolve import train_config

NORM_RTOL = 1e-5  # fp32 sums of the same squares in other orders and groupings


def norms_agree(norms: list[float], reference: list[float]) -> bool:
    return len(norms) == len(reference) and all(
        abs(a - b) <= NORM_RTOL * abs(b) for a, b in zip(norms, reference))


def single_process_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``pp_size: 1, vpp_size: 1`` (everything else as it is)."""
    return cfg.replace(parallel={"pp_size": 1, "vpp_size": 1, "microbatch_group_size": None})


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def format_ranks(result: PipelineResult) -> str:
    header = ("rank", "stages", "slot sets (planner)", "peak in use", "FIFO as planned",
              "arena", "persistent / set", "recompute graphs", "sublayer graphs")
    rows = [(str(r["rank"]), ",".join(map(str, r["stages"])),
             f"{r['persistent_sets']} ({r['planned_sets']})", str(r["peak_sets_in_use"]),
             "yes" if r["assignment_matches_planner"] else "NO", _kib(r["arena_bytes"]),
             _kib(r["persistent_bytes_per_set"]), str(r["recompute_graphs"]),
             str(r["sublayer_graphs"]))
            for r in result.ranks]
    return _table(header, rows)


def format_steps(result: PipelineResult, reference=None) -> str:
    header = ["step", "loss (last stage)", "grad norm"]
    if reference is not None:
        header += ["loss, pp_size 1", "grad norm, pp_size 1", "equal"]
    rows = []
    for step, (loss, norm) in enumerate(zip(result.losses, result.grad_norms)):
        row = [str(step + 1), f"{loss:.10f}", f"{norm:.10f}"]
        if reference is not None:
            ref_loss, ref_norm = reference.losses[step], reference.grad_norms[step]
            same = loss == ref_loss and norms_agree([norm], [ref_norm])
            row += [f"{ref_loss:.10f}", f"{ref_norm:.10f}", "yes" if same else
                    f"NO (loss {loss - ref_loss:+.3e}, norm {norm - ref_norm:+.3e})"]
        rows.append(row)
    return _table(header, rows)


def _table(header, rows) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip()
             for line in (header, ["-" * w for w in widths], *rows)]
    return "\n".join(lines)


def run(cfg: RunConfig, args: argparse.Namespace) -> int:
    """The pipelined ``mhc-cg train``; ``args`` as :mod:`mhc_cg.commands.train` parses them."""
    progress = not args.no_progress
    result = train_pipeline(cfg, steps=args.steps, device=args.device, progress=progress,
                            mode=args.mode)
    reference = None
    if args.compare:
        reference = train_config(single_process_config(cfg), steps=args.steps, device=args.device,
                          progress=progress, mode=result.mode)
    equal = reference is None or (result.losses == reference.losses
                                  and norms_agree(result.grad_norms, reference.grad_norms))
    if args.json:
        out = {"mode": result.mode, "losses": result.losses, "grad_norms": result.grad_norms,
               "step_ms_median": result.median_step_ms, **result.info}
        if reference is not None:
            out["single_process"] = {"losses": reference.losses,
                                     "grad_norms": reference.grad_norms}
            out["bit_identical"] = equal
        print(json.dumps(out, indent=1))
        return 0 if equal else 1
    m = cfg.model
    print(f"mHC GPT: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_streams} streams; "
          f"mode: {result.mode}; pipeline: pp_size {result.pp_size} x vpp_size "
          f"{result.vpp_size}, {result.num_microbatches} microbatches, megatron-core's "
          f"{'interleaved ' if result.vpp_size > 1 else ''}1F1B, one process per rank")
    print(format_ranks(result))
    print()
    print(format_steps(result, reference))
    print(f"step time  {result.median_step_ms:.1f} ms (median of {len(result.step_times)} "
          f"steps, last rank)")
    if reference is not None:
        print(f"per-step losses equal to pp_size 1 bit for bit, grad norms within {NORM_RTOL:g}: "
              + ("yes" if equal else "NO"))
    return 0 if equal else 1
