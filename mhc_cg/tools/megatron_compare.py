"""``mhc-cg megatron``'s work: Megatron-LM's own mHC GPT (main or dev) under its TE graph helper.

:func:`run` checks a config for the megatron path (:func:`mhc_cg.config.rules.megatron_problems`),
runs :mod:`megatron_integration.harness.runs` in one child process per rank (``tp_size x
pp_size``) with the branch's megatron first on the path
(:mod:`megatron_integration.harness.child_process`) and returns the ranks' results side by side;
:func:`to_json` and :func:`format_table` present them.
"""

from __future__ import annotations

import torch

from mhc_cg.config import RunConfig
from mhc_cg.config.choices import split_recompute_scope
from mhc_cg.config.rules import megatron_problems
from mhc_cg.core.errors import ConfigError
from megatron_integration.harness.child_process import find_megatron, run_megatron_job
from megatron_integration.harness.runs import OURS, compare_ranks, references, runs_of

RANK_FIELDS = ("rank", "pp_rank", "tp_rank", "ep_rank", "saved_bytes_per_layer", "persistent_slot_sets",
               "arena_bytes", "layer_graph_replays_per_step", "recompute_graph_replays_per_step",
               "recompute_blocks_kept_per_step")
PROGRESS = "[mhc-cg megatron]"


def resolve_device(cfg: RunConfig) -> str:
    """``cuda`` where asked, or for ``auto`` where there is a GPU (megatron's helper then runs with
    TransformerEngine, or without it with the stand-in over ``torch.cuda.CUDAGraph``); else
    ``cpu`` (the stand-in over the tape)."""
    if cfg.train.device != "auto":
        return cfg.train.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def world_size(cfg: RunConfig) -> int:
    """``tp x pp x ep`` processes: the expert-parallel ranks are the data-parallel ones."""
    return cfg.parallel.tp_size * cfg.parallel.pp_size * cfg.parallel.ep_size


def run(cfg: RunConfig, compare: bool, progress: bool = True, timeout: float | None = None) -> dict:
    """Train ``mhc_cg`` (and with ``compare`` the branch's own three runs) on every rank; the
    comparison (``ConfigError`` for a config the megatron path cannot run, or when the branch's
    megatron is not found: both before any process starts)."""
    problems = megatron_problems(cfg)
    if problems:
        raise ConfigError(problems)
    branch = cfg.megatron.branch
    source = find_megatron(branch).describe()
    device = resolve_device(cfg)
    if device == "cuda" and world_size(cfg) > torch.cuda.device_count():
        raise ConfigError(f"parallel.tp_size x pp_size x ep_size: {world_size(cfg)} ranks, one GPU each, "
                          f"but this machine has {torch.cuda.device_count()}; use fewer ranks or "
                          f"train.device: cpu")
    cfg = cfg.replace(train={"device": device})
    runs = list(runs_of(branch)) if compare else [OURS]
    p = cfg.parallel  # megatron's rank order is tp, then dp (= ep here), then pp
    last_stage = (p.pp_size - 1) * p.tp_size * p.ep_size  # tp and dp rank 0 of the last stage
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": runs, "device": device,
                                 "branch": branch}, world_size=world_size(cfg),
                                forward_rank=last_stage,
                                progress_prefix=PROGRESS if progress else None, timeout=timeout)
    result = compare_ranks([r["runs"] for r in per_rank], branch)
    result.update(device=device, branch=branch, source=source)
    return result


def to_json(result: dict) -> dict:
    """``{"bit_identical": bool or None, "runs": {name: {"losses": [...], "ranks": [{rank,
    pp_rank, tp_rank, ep_rank, saved_bytes_per_layer, persistent_slot_sets, arena_bytes,
    layer_graph_replays_per_step, recompute_graph_replays_per_step,
    recompute_blocks_kept_per_step}, ...]}}}``; a run the
    branch's config refuses has ``"refused"`` (Megatron's message) and no ranks."""
    runs = {}
    for name, run in result["runs"].items():
        if "refused" in run:
            runs[name] = {"refused": run["refused"], "losses": [], "ranks": []}
            continue
        runs[name] = {"losses": run["losses"],
                      "ranks": [{k: rank[k] for k in RANK_FIELDS} for rank in run["ranks"]]}
    return {"bit_identical": result["bit_identical"], "runs": runs}


def _equal_to_reference(result: dict, name: str, reference: str, rank: int) -> str:
    runs = result["runs"]
    if reference not in runs or "refused" in runs[reference]:
        return "-"
    if name == reference:
        return "(reference)"
    ref, run = runs[reference], runs[name]
    same = run["losses"] == ref["losses"] and \
        run["ranks"][rank]["grad_digests"] == ref["ranks"][rank]["grad_digests"]
    return "bit-identical" if same else "differs"


def _recomputed(rank: dict) -> str:
    kept = rank.get("kept_sublayers_per_step", 0)
    if rank["recomputed_sublayers_per_step"] or kept:
        return (f"{rank['recomputed_sublayers_per_step']} sublayers (static)"
                + (f", {kept} kept from the forward" if kept else ""))
    return f"{rank['mhc_checkpoints_per_step']} checkpoints" if rank["mhc_checkpoints_per_step"] else "-"


def _loss(run: dict) -> str:
    return f"{run['losses'][0]:.6f} -> {run['losses'][-1]:.6f}" if run["losses"] else "-"


def _moe(m) -> str:
    if not m.is_moe:
        return ""
    moe = sum(m.moe_layer_pattern)
    return f"; MoE {m.num_experts} experts top-{m.moe_top_k} in {moe} of {m.num_layers} layers"


def format_table(cfg: RunConfig, result: dict) -> str:
    """One row per run and rank, then the verdict; a refused run is one row with the reason."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    branch = result["branch"]
    reference = references(branch)[0]
    scopes, recompute_graphs = split_recompute_scope(cfg.graph.scopes)
    model = ("megatron-core's GPT of mhc_cg's mHC layer" if branch == "core"
             else f"Megatron-LM {branch}'s GPT of HyperConnectionTransformerLayer")
    head = (f"{model}: {m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.num_streams} streams, L_r={m.resolved_recompute_layers}, "
            f"{t.dtype}; tp {p.tp_size}{' (sequence parallel)' if p.sequence_parallel else ''} x "
            f"pp {p.pp_size} x vpp {p.vpp_size}{f' x ep {p.ep_size}' if p.ep_size > 1 else ''}"
            f"{_moe(m)}; {t.steps} steps x {t.num_microbatches} "
            f"microbatches on {result['device']}; megatron's TECudaGraphHelper graphs "
            f"[{', '.join(scopes)}]{', mhc_cg the recompute' if recompute_graphs else ''} "
            f"({branch}: {result['source']})")
    header = ("run", "rank (pp, tp, ep)", "loss first -> last", f"vs {reference}", "saved / layer",
              "slot sets", "arena", "layer graphs / step", "recompute graphs / step",
              "mHC recomputed / step")
    rows = []
    for name, run in result["runs"].items():
        if "refused" in run:
            rows.append((name, "all", f"refused by {branch}: {run['refused']}", "", "", "", "",
                         "", "", ""))
            continue
        for index, rank in enumerate(run["ranks"]):
            saved = rank["saved_bytes_per_layer"]
            where = f"{rank['pp_rank']}, {rank['tp_rank']}, {rank['ep_rank']}"
            rows.append((name, f"{rank['rank']} ({where})", _loss(run),
                         _equal_to_reference(result, name, reference, index),
                         "-" if saved is None else f"{saved} B",
                         str(rank["persistent_slot_sets"] or "-"),
                         f"{rank['arena_bytes']} B" if rank["arena_bytes"] else "-",
                         str(rank["layer_graph_replays_per_step"]),
                         str(rank["recompute_graph_replays_per_step"]), _recomputed(rank)))
    widths = [max(len(r[i]) for r in [header, *rows] if not r[2].startswith("refused"))
              for i in range(len(header))]
    lines = [head, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for row in rows:
        if row[2].startswith("refused"):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}")
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    lines.append("saved / layer: what a layer holds from its forward to its backward, per "
                 "microbatch; arena: the recompute's workspace, once per rank, shared by its chunks")
    if result["bit_identical"] is not None:
        refs = [r for r in references(branch) if r in result["runs"]]
        verdict = "bit for bit" if result["bit_identical"] else "NO: " + "; ".join(result["mismatches"])
        lines.append(f"mhc_cg's losses and gradients on every rank equal {' and '.join(refs)}: "
                     f"{verdict}")
    return "\n".join(lines)
