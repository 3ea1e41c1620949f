"""``mhc-cg megatron``'s work: Megatron-LM's own mHC GPT (main or dev) under its TE graph helper,
or (``megatron.cuda_graph_impl: full_iteration``) under dev's ``FullCudaGraphWrapper``.

:func:`run` checks a config for the megatron path (:func:`mhc_cg.config.rules.megatron_problems`),
runs :mod:`mhc_cg.lab.megatron_harness.runs` in one child process per rank (``tp_size x
pp_size``) with the branch's megatron first on the path
(:mod:`mhc_cg.lab.megatron_harness.child_process`) and returns the ranks' results side by side;
:func:`to_json` and :func:`format_table` present them.
"""

from __future__ import annotations

import torch

from mhc_cg.config import RunConfig
from mhc_cg.config.choices import split_recompute_scope
from mhc_cg.config.rules import megatron_problems
from mhc_cg.core.errors import ConfigError
from megatron_integration.config.field_map import WARMUP_STEPS, cpu_changes
from mhc_cg.lab.megatron_harness.child_process import find_megatron, run_megatron_job
from mhc_cg.lab.megatron_harness.runs import (DEV_FULL, FULL_ITERATION, NO_DROPOUT,
                                               checked_runs, compare_ranks, ours, references,
                                               runs_of)

RANK_FIELDS = ("rank", "pp_rank", "tp_rank", "ep_rank", "saved_bytes_per_layer", "persistent_slot_sets",
               "arena_bytes", "layer_graph_replays_per_step", "recompute_graph_replays_per_step",
               "recompute_blocks_kept_per_step", "fused_op_calls_per_step",
               "fused_kernel_launches_per_step")
# a run under dev's FullCudaGraphWrapper adds these (see to_json)
FULL_ITERATION_FIELDS = ("iteration_graph_replays", "iteration_graph_replays_per_step",
                         "iteration_graph_bytes", "iteration_graph_collectives",
                         "eager_sublayer_calls_per_step")
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
    impl, dropout = cfg.megatron.cuda_graph_impl, cfg.model.hidden_dropout
    fused = cfg.megatron.use_fused_mhc
    runs = list(runs_of(branch, impl, dropout, fused)) if compare else [ours(impl)]
    p = cfg.parallel  # megatron's rank order is tp, then dp (= ep here), then pp
    last_stage = (p.pp_size - 1) * p.tp_size * p.ep_size  # tp and dp rank 0 of the last stage
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": runs, "device": device,
                                 "branch": branch}, world_size=world_size(cfg),
                                forward_rank=last_stage,
                                progress_prefix=PROGRESS if progress else None, timeout=timeout)
    result = compare_ranks([r["runs"] for r in per_rank], branch,
                           checked_runs(branch, impl, dropout, fused))
    result.update(device=device, branch=branch, source=source, impl=impl, dropout=dropout,
                  fused=fused, native_loss_difference=native_loss_difference(result, branch),
                  capturing_function=per_rank[0].get("capturing_function"),
                  cpu_changes={field: f"{value} ({why})" for field, (value, why)
                               in cpu_changes(cfg, branch).items()})
    return result


def layer_cost(cfg: RunConfig, shape: RunConfig | None = None) -> dict:
    """Kernels and bytes of one step of the branch's mHC layer, native against mhc_cg's fused
    kernels (:mod:`mhc_cg.lab.megatron_harness.layer_cost`), at ``shape``'s model (hidden, heads,
    FFN, sequence, micro-batch) or ``cfg``'s; one child process, on meta tensors."""
    cfg = _one_layer(cfg, shape, "--layer-cost", "cpu")
    source = find_megatron(cfg.megatron.branch).describe()
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": [], "device": "cpu",
                                 "branch": cfg.megatron.branch, "layer_cost": True}, world_size=1)
    return {"branch": cfg.megatron.branch, "source": source,
            **per_rank[0]["runs"]["layer_cost"]}


def layer_time(cfg: RunConfig, shape: RunConfig | None = None, steps: int = 10,
               warmup: int = 3) -> dict:
    """One step of the branch's mHC layer timed native (compiled on a GPU), with mhc_cg's fused
    kernels and (dev) with dev's own fused module, in one child process
    (:mod:`mhc_cg.lab.megatron_harness.layer_timing`) on the device it finds."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = _one_layer(cfg, shape, "--layer-time", device)
    source = find_megatron(cfg.megatron.branch).describe()
    per_rank = run_megatron_job({"config": cfg.to_dict(), "runs": [], "device": device,
                                 "branch": cfg.megatron.branch,
                                 "layer_time": {"steps": steps, "warmup": warmup}}, world_size=1)
    return {"branch": cfg.megatron.branch, "source": source,
            **per_rank[0]["runs"]["layer_time"]}


def _one_layer(cfg: RunConfig, shape: RunConfig | None, flag: str, device: str) -> RunConfig:
    """``cfg`` for one layer of one rank, at ``shape``'s model where given."""
    branch = cfg.megatron.branch
    if branch == "core":
        raise ConfigError(f"megatron.branch: {flag} compares Megatron-LM's own layer's ops "
                          f"with mhc_cg's fused kernels; set megatron.branch: main or dev")
    if shape is not None:
        m, t = shape.model, shape.train
        cfg = cfg.replace(model={"hidden_size": m.hidden_size, "num_heads": m.num_heads,
                                 "ffn_hidden_size": m.ffn_hidden_size,
                                 "seq_length": m.seq_length},
                          train={"micro_batch_size": t.micro_batch_size})
    return cfg.replace(train={"device": device},
                       parallel={"tp_size": 1, "pp_size": 1, "vpp_size": 1, "ep_size": 1,
                                 "sequence_parallel": False})


def format_layer_cost(result: dict) -> str:
    s = result["shape"]
    head = (f"one {result['branch']} HyperConnectionTransformerLayer, forward and backward: seq "
            f"{s['seq']} x micro-batch {s['micro_batch']}, hidden {s['hidden']}, n = "
            f"{s['streams']}, {s['dtype']} (counted at dispatch on meta tensors; every native op "
            f"one kernel, as eager: torch.compile fuses some on a GPU)")
    rows = [(name, str(r["kernels"]), f"{r['bytes_read'] / 2**20:.1f}",
             f"{r['bytes_written'] / 2**20:.1f}", str(r["fused_op_kernels"]))
            for name, r in ((k, result[k]) for k in ("native", "fused"))]
    native, fused = result["native"], result["fused"]
    saved = (f"fused: {native['kernels'] - fused['kernels']} kernels and "
             f"{(native['bytes_read'] + native['bytes_written'] - fused['bytes_read'] - fused['bytes_written']) / 2**20:.1f} MiB "
             f"fewer per layer step (attention and MLP alike in both)")
    header = ("mHC ops", "kernels", "MiB read", "MiB written", "of them fused-op kernels")
    return "\n".join([head, *_columns(header, rows), saved])


def format_layer_time(result: dict) -> str:
    s = result["shape"]
    head = (f"one {result['branch']} HyperConnectionTransformerLayer step on {result['device']}: "
            f"seq {s['seq']} x micro-batch {s['micro_batch']}, hidden {s['hidden']}, "
            f"n = {s['streams']}, {s['dtype']}")
    rows = []
    for name, r in result["runs"].items():
        if "not_run" in r:
            rows.append((name, "-", "-", "-", f"not run: {r['not_run']}"))
            continue
        ratio = r.get("over_mhc_cg_fused")
        rows.append((name, f"{r['ms_per_step']:.3f}", "-" if ratio is None else f"{ratio:.2f}",
                     f"{r['warmup_s']:.1f}", r["clock"] + (", compiled" if r.get("compiled") else "")))
    header = ("run", "ms / step", "x mhc_cg_fused", "warm-up s", "clock")
    return "\n".join([head, *_columns(header, rows)])


def native_loss_difference(result: dict, branch: str) -> dict[str, float]:
    """``{run: the largest |loss - native loss| over the steps}`` of every run beside the
    branch's run without recompute, Megatron's native ops (the figure a fused run is judged
    by: its rounding is not Megatron's)."""
    runs = result["runs"]
    native = runs.get(f"{branch}_eager_none")
    if native is None or "refused" in native or not native["losses"]:
        return {}
    return {name: max(abs(a - b) for a, b in zip(run["losses"], native["losses"]))
            for name, run in runs.items()
            if name != f"{branch}_eager_none" and "refused" not in run and run["losses"]}


def format_cpu_changes(result: dict) -> list[str]:
    """One line of what the mapping set because the run is on a CPU, with the reasons."""
    changes = result.get("cpu_changes") or {}
    if not changes:
        return []
    return ["on the CPU the mapping set: " + "; ".join(f"{field} = {said}"
                                                       for field, said in changes.items())]


def to_json(result: dict) -> dict:
    """``{"bit_identical": bool or None, "runs": {name: {"losses": [...], "ranks": [{rank,
    pp_rank, tp_rank, ep_rank, saved_bytes_per_layer, persistent_slot_sets, arena_bytes,
    layer_graph_replays_per_step, recompute_graph_replays_per_step,
    recompute_blocks_kept_per_step}, ...]}}}``; a run the
    branch's config refuses has ``"refused"`` (Megatron's message) and no ranks. A run under dev's
    ``FullCudaGraphWrapper`` has ``FULL_ITERATION_FIELDS`` on each rank besides: the iteration
    graph's replays over the run and in the last step, the bytes its capture allocated and the
    ``c10d`` ops it holds (the tape's figures; ``null`` on a GPU), and the sublayer calls run as
    Python in the last (replayed) step; its saved bytes and recompute counts are the captured
    step's. ``"checked"``: ``{run: [the runs it must equal bit for bit]}``.
    ``"capturing_function"``: the ``make_graphed_callables`` megatron's helper called (file and
    sha256 from its code object, TE's version as megatron read it)."""
    runs = {}
    for name, run in result["runs"].items():
        if "refused" in run:
            runs[name] = {"refused": run["refused"], "losses": [], "ranks": []}
            continue
        runs[name] = {"losses": run["losses"],
                      "ranks": [{k: rank[k] for k in RANK_FIELDS + (
                          FULL_ITERATION_FIELDS if "iteration_graph_replays" in rank else ())}
                                for rank in run["ranks"]]}
    checked = checked_runs(result["branch"], result.get("impl", "transformer_engine"),
                           result.get("dropout", 0.0), result.get("fused", False))
    return {"bit_identical": result["bit_identical"], "runs": runs,
            "use_fused_mhc": result.get("fused", False),
            "largest_loss_difference_vs_native": result.get("native_loss_difference", {}),
            "checked": {run: list(refs) for run, refs in checked.items() if run in runs},
            "capturing_function": result.get("capturing_function"),
            "cpu_changes": result.get("cpu_changes", {})}


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


def _shape(cfg: RunConfig, model: str, result: dict) -> str:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    return (f"{model}: {m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.num_streams} streams, L_r={m.resolved_recompute_layers}, "
            f"{t.dtype}; tp {p.tp_size}{' (sequence parallel)' if p.sequence_parallel else ''} x "
            f"pp {p.pp_size} x vpp {p.vpp_size}{f' x ep {p.ep_size}' if p.ep_size > 1 else ''}"
            f"{_moe(m)}; {t.steps} steps x {t.num_microbatches} "
            f"microbatches on {result['device']}")


def _columns(header: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
            "  ".join("-" * w for w in widths),
            *("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)]


def _against(result: dict, name: str, rank: int, checked: dict) -> str:
    """A full-iteration table's comparison cell: a reference, or bit-identical to its own."""
    if any(name in refs for refs in checked.values()):
        return "(reference)"
    if name not in checked:
        return "-"
    cells = [f"{_equal_to_reference(result, name, ref, rank)} to {ref}" for ref in checked[name]
             if ref in result["runs"]]
    return "; ".join(cells) or "-"


def _python_calls(rank: dict) -> str:
    calls = rank.get("eager_sublayer_calls_per_step")
    return "-" if calls is None else str(sum(calls.values()))


def format_full_iteration_table(cfg: RunConfig, result: dict) -> str:
    """:func:`format_table` for ``megatron.cuda_graph_impl: full_iteration``: each run's dropout,
    its reference, and the iteration graph's replays, size and the Python left in a replayed
    step."""
    m = cfg.model
    checked = checked_runs(result["branch"], result["impl"], result["dropout"],
                           result.get("fused", False))
    graph = "the tape" if result["device"] == "cpu" else "torch.cuda.CUDAGraph"
    model = "Megatron-LM dev's GPT of HyperConnectionTransformerLayer"
    head = (f"{_shape(cfg, model, result)}; "
            f"dev's FullCudaGraphWrapper graphs each step whole after "
            f"{WARMUP_STEPS} eager step (cuda_graph_impl: full_iteration, on {graph}) "
            f"(dev: {result['source']})")
    header = ("run", "rank (pp, tp, ep)", "dropout", "loss first -> last", "vs reference", "saved / layer",
              "slot sets", "arena", "iteration graph / step", "capture allocated",
              "Python calls, replayed step", "mHC recomputed / step")
    rows, refused = [], []
    for name, run in result["runs"].items():
        if "refused" in run:
            refused.append(f"{name}: refused by dev: {run['refused']}")
            continue
        dropout = 0.0 if name in (NO_DROPOUT, DEV_FULL) else m.hidden_dropout
        impl = f" {m.dropout_impl}" if dropout > 0 else ""
        for index, rank in enumerate(run["ranks"]):
            saved, pool = rank["saved_bytes_per_layer"], rank.get("iteration_graph_bytes")
            where = f"{rank['pp_rank']}, {rank['tp_rank']}, {rank['ep_rank']}"
            graphed = "iteration_graph_replays" in rank
            replays = rank.get("iteration_graph_replays_per_step")
            rows.append((name, f"{rank['rank']} ({where})", f"{dropout:g}{impl}", _loss(run),
                         _against(result, name, index, checked),
                         "-" if saved is None else f"{saved} B",
                         str(rank["persistent_slot_sets"] or "-"),
                         f"{rank['arena_bytes']} B" if rank["arena_bytes"] else "-",
                         "-" if replays is None else str(replays),
                         f"{pool} B" if pool else "-",
                         _python_calls(rank) if graphed else "-", _recomputed(rank)))
    lines = [head, *_columns(header, rows), *refused,
             "saved / layer: what a layer holds from its forward to its backward, per microbatch, "
             "measured in the captured step; arena: the recompute's workspace, once per rank",
             "capture allocated: every byte the iteration graph's capture allocated, each storage "
             "once at its largest (the tape keeps them all; a CUDA pool reuses freed blocks, so its "
             "high-water mark, not measured here, is lower); Python calls: sublayer F, norm and "
             "mHC calls run as Python in the last step (a replay runs none)",
             *format_cpu_changes(result)]
    if result["bit_identical"] is not None:
        verdict = "bit for bit" if result["bit_identical"] else "NO: " + "; ".join(result["mismatches"])
        pairs = [f"{run} equals {' and '.join(refs)}" for run, refs in checked.items()
                 if run in result["runs"] and "refused" not in result["runs"][run]]
        lines.append(f"losses and gradients on every rank: {'; '.join(pairs)}: {verdict}")
    return "\n".join(lines)


def format_table(cfg: RunConfig, result: dict) -> str:
    """One row per run and rank, then the verdict; a refused run is one row with the reason."""
    if result.get("impl") == FULL_ITERATION:
        return format_full_iteration_table(cfg, result)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    branch = result["branch"]
    fused = result.get("fused", False)
    refs = list(checked_runs(branch, fused=fused).values())[0] if fused else references(branch)
    reference = refs[0]
    scopes, recompute_graphs = split_recompute_scope(cfg.graph.scopes)
    model = ("megatron-core's GPT of mhc_cg's mHC layer" if branch == "core"
             else f"Megatron-LM {branch}'s GPT of HyperConnectionTransformerLayer")
    head = (f"{model}: {m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.num_streams} streams, L_r={m.resolved_recompute_layers}, "
            f"{t.dtype}; tp {p.tp_size}{' (sequence parallel)' if p.sequence_parallel else ''} x "
            f"pp {p.pp_size} x vpp {p.vpp_size}{f' x ep {p.ep_size}' if p.ep_size > 1 else ''}"
            f"{_moe(m)}; {t.steps} steps x {t.num_microbatches} "
            f"microbatches on {result['device']}; megatron's TECudaGraphHelper graphs "
            f"[{', '.join(scopes)}]{', mhc_cg the recompute' if recompute_graphs else ''}"
            f"{'; the layers on mhc_cg fused kernels (use_fused_mhc)' if fused else ''} "
            f"({branch}: {result['source']})")
    header = ("run", "rank (pp, tp, ep)", "loss first -> last", f"vs {reference}", "saved / layer",
              "slot sets", "arena", "layer graphs / step", "recompute graphs / step",
              "mHC recomputed / step", "fused ops (launches) / step", "|loss - native| max")
    differences = result.get("native_loss_difference", {})
    rows = []
    for name, run in result["runs"].items():
        if "refused" in run:
            rows.append((name, "all", f"refused by {branch}: {run['refused']}", "", "", "", "",
                         "", "", "", "", ""))
            continue
        for index, rank in enumerate(run["ranks"]):
            saved = rank["saved_bytes_per_layer"]
            where = f"{rank['pp_rank']}, {rank['tp_rank']}, {rank['ep_rank']}"
            native = fused and name == f"{branch}_eager_none"  # other rounding: not compared
            rows.append((name, f"{rank['rank']} ({where})", _loss(run),
                         "(native ops)" if native else
                         _equal_to_reference(result, name, reference, index),
                         "-" if saved is None else f"{saved} B",
                         str(rank["persistent_slot_sets"] or "-"),
                         f"{rank['arena_bytes']} B" if rank["arena_bytes"] else "-",
                         str(rank["layer_graph_replays_per_step"]),
                         str(rank["recompute_graph_replays_per_step"]), _recomputed(rank),
                         f"{rank['fused_op_calls_per_step']} "
                         f"({rank['fused_kernel_launches_per_step']})",
                         f"{differences[name]:.3g}" if name in differences else "-"))
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
    lines.append("fused ops: mhc_cg's mHC ops the last step ran, eager or replayed on the tape (on a "
                 "GPU a graph replay dispatches none: the eager ones only), and the Triton kernel "
                 "launches they stand for")
    lines += format_cpu_changes(result)
    if result["bit_identical"] is not None:
        refs = [r for r in refs if r in result["runs"]]
        verdict = "bit for bit" if result["bit_identical"] else "NO: " + "; ".join(result["mismatches"])
        lines.append(f"mhc_cg's losses and gradients on every rank equal {' and '.join(refs)}: "
                     f"{verdict}")
    return "\n".join(lines)
