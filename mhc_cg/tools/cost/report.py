"""The per-mode cost report behind ``mhc-cg cost``: kernels and bytes per training step, and
every captured graph with its kernels, bytes and pool peak.

Each mode is built with the recording backend (:mod:`mhc_cg.tools.cost.recording`), on ``meta`` (nothing
allocated: the benchmark shape on a laptop; attention as the GPU's fused kernel,
:mod:`mhc_cg.tools.cost.attention`) or on ``cpu``. Captures happen while the mode is prepared, as in
training (without warmup iterations: nothing is set up lazily here); then the optimizer makes its
state and one step is recorded:
its eager ops (embedding, loss, MoE tail, optimizer, copies into static inputs) through dispatch,
each graph replay by the graph's recorded cost.

Meta tensors all have ``data_ptr() == 0``: everything here (and the runtime's arena and slot
checks) tells storages apart by :func:`mhc_cg.core.storage.storage_id`, never by address.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

from mhc_cg.config import RunConfig
from mhc_cg.tools.cost.attention import fused_attention_on_meta
from mhc_cg.tools.cost.recording import CostBackend
from mhc_cg.tools.cost.record import StepRecorder
from mhc_cg.training.data import ProgressionCorpus
from mhc_cg.core.errors import ConfigError
from mhc_cg.runtime.modes.registry import build_for_plan
from mhc_cg.runtime.modes.plan import DEFAULT_STATIC_SCOPES, MOE_SCOPES, capture_plan, configured_scopes
from mhc_cg.core.storage import storage_id
from mhc_cg.config.rules import check

DEVICES = ("meta", "cpu")
PARTIAL_MOE_SCOPES = ("attn", "moe_router", "moe_preprocess", "mhc_recompute")
RECOMPUTE_POOL_LIMIT = 1.25   # a recompute graph's pool peak, in arenas
STATIC_MEMORY_LIMIT = 0.75    # graphed_static's pools + arena + persistent set, in graphed_none pools


def _with_scopes(cfg: RunConfig, scopes: list[str]) -> RunConfig:
    graph = dataclasses.replace(cfg.graph, cuda_graph_scope=scopes, cuda_graph_modules=None)
    model = dataclasses.replace(cfg.model, recompute="block")
    return check(dataclasses.replace(cfg, model=model, graph=graph))


def mode_configs(cfg: RunConfig) -> list[tuple[str, RunConfig, str]]:
    """``(report name, config, training mode)`` for every mode costed for ``cfg``.

    ``graphed_static`` uses the configured scopes (MoE partial capture left out), ``moe_partial``
    (MoE configs only) the configured ones with ``moe_router``, else attn + router + preprocess.
    """
    cfg = check(dataclasses.replace(cfg, graph=dataclasses.replace(cfg.graph, backend="auto")))
    scopes = configured_scopes(cfg) or list(DEFAULT_STATIC_SCOPES)
    static = [s for s in scopes if s not in MOE_SCOPES] or list(DEFAULT_STATIC_SCOPES)
    static = static + ["mhc_recompute"] * ("mhc_recompute" not in static)
    modes = [("eager_none", cfg, "eager_none"), ("eager_block", cfg, "eager_block"),
             ("graphed_none", cfg, "graphed_none"),
             ("graphed_static", _with_scopes(cfg, static), "graphed_static")]
    if cfg.model.is_moe:
        partial = scopes if "moe_router" in scopes else list(PARTIAL_MOE_SCOPES)
        partial = partial + ["mhc_recompute"] * ("mhc_recompute" not in partial)
        modes.append(("moe_partial", _with_scopes(cfg, partial), "graphed_static"))
    return modes


def _graph_names(graphed, model) -> dict[int, tuple[str, str]]:
    """``id(graph) -> (name, kind)`` for every graph of a graphed model."""
    subs = {id(sub): f"L{layer.layer_number}.{name}" for layer in model.layers
            for name, sub in (("attn", layer.attention), ("mlp", layer.mlp))}
    names: dict[int, tuple[str, str]] = {}
    callables = getattr(graphed, "graphed_callables", None) or ()
    for fn, runner in zip(callables, getattr(callables, "runners", None) or ()):
        sub = getattr(fn, "sub", fn)
        base = subs.get(id(sub), runner.label) + (".head" if hasattr(fn, "step") else "")
        names[id(runner.fwd_graph)] = (f"{base} fwd", "forward")
        names[id(runner.bwd_graph)] = (f"{base} bwd", "backward")
    runtime = getattr(graphed, "runtime", None)
    for (block, pset), graph in (runtime.recompute_graphs.items() if runtime else ()):
        names[id(graph)] = (f"recompute block {block} set {pset}", "recompute")
    return names


def static_buffer_bytes(graphed) -> int | None:
    """Bytes of the graphed callables' static input and grad-output buffers: allocated outside
    the pools (so not in ``pool_reserved_bytes``), once per distinct storage."""
    runners = getattr(getattr(graphed, "graphed_callables", None), "runners", None)
    if not runners:
        return None
    storages = {storage_id(t): t.untyped_storage().nbytes()
                for r in runners for t in (*r.static_inputs, *r.static_grad_outputs)
                if t is not None}
    return sum(storages.values())


def _init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Let the optimizer make its state (a first step's extra work) without running the model."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        optimizer.step()
        for p, s in zip(params, saved):
            p.copy_(s)
    optimizer.zero_grad(set_to_none=True)


def cost_mode(cfg: RunConfig, train_mode: str, device: str) -> dict:
    """The cost of one mode of ``cfg`` on ``device`` (see the module docstring)."""
    dev = torch.device(device)
    meta = dev.type == "meta"
    backend = CostBackend(device)
    plan = capture_plan(cfg, train_mode, "cpu")  # the backend is ours; the plan's is not used
    with contextlib.ExitStack() as stack:
        if meta:
            stack.enter_context(fused_attention_on_meta())
        with torch.device(dev) if meta else contextlib.nullcontext():
            model, forward, graphed = build_for_plan(cfg, plan, dev, backend=backend)
        # per-parameter optimizer and clipping on every device (meta has no multi-tensor ops;
        # a GPU would launch fewer, larger kernels there)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay, foreach=False)
        corpus = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed)
        train = cfg.train

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            for _ in range(train.num_microbatches):
                inputs, targets = (t.to(dev) for t in corpus.batch(train.micro_batch_size))
                seed = torch.zeros((), dtype=torch.int64, device=dev)
                logits = forward(inputs, seed)
                loss = F.cross_entropy(logits.flatten(0, 1).float(),
                                       targets.flatten()) / train.num_microbatches
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"), foreach=False)
            optimizer.step()

        _init_optimizer_state(model, optimizer)
        recorder = StepRecorder()
        with recorder:
            step()
    names = _graph_names(graphed, model) if graphed is not None else {}
    graphs = []
    for graph in backend.captured:
        name, kind = names.get(id(graph), (graph.name, "forward"))
        graphs.append({"name": name, "kind": kind, "kernels": graph.cost.kernels,
                       "bytes": graph.cost.bytes, "pool_peak_bytes": graph.peak.peak_bytes,
                       "pool_held_peak_bytes": graph.peak.held_peak_bytes,
                       "pool_resident_bytes": graph.peak.resident_before,
                       "escaped_bytes": graph.peak.escaped_bytes, "pool": graph.pool.id})
    info = graphed.describe() if graphed is not None else {}
    return {
        "kernels_per_step": recorder.kernels,
        "bytes_per_step": recorder.bytes,
        "eager_kernels_per_step": recorder.eager.kernels,
        "eager_bytes_per_step": recorder.eager.bytes,
        "graph_replays_per_step": recorder.replays,
        "graphs": graphs,
        "pools": len(backend.pools),
        "pool_reserved_bytes": sum(p.state.high_water for p in backend.pools),
        "arena_bytes": info.get("arena_bytes"),
        "persistent_bytes_per_microbatch": info.get("persistent_bytes_per_microbatch"),
        "static_buffer_bytes": static_buffer_bytes(graphed),
        "top_eager_kernels": dict(recorder.eager.by_op.most_common(8)),
    }


def checks(modes: dict) -> list[dict]:
    """The memory budgets of static recompute, where both graphed modes were costed."""
    static, none = modes.get("graphed_static"), modes.get("graphed_none")
    if static is None or none is None or not static["arena_bytes"]:
        return []
    arena = static["arena_bytes"]
    recompute = [g for g in static["graphs"] if g["kind"] == "recompute"]
    # a recompute graph's own need: its peak above what the pool already held live when its capture
    # began (other graphs' saved activations, when it shares the sublayer graphs' pool)
    worst = max((max(g["pool_peak_bytes"], g["pool_held_peak_bytes"]) - g["pool_resident_bytes"]
                 for g in recompute), default=0)
    total = (static["pool_reserved_bytes"] + arena + static["persistent_bytes_per_microbatch"])
    ratio = total / none["pool_reserved_bytes"] if none["pool_reserved_bytes"] else None
    return [
        {"check": f"every recompute graph's pool peak (above the pool's live bytes before it) <= "
                  f"{RECOMPUTE_POOL_LIMIT} x arena",
         "value": worst / arena, "limit": RECOMPUTE_POOL_LIMIT,
         "ok": worst <= RECOMPUTE_POOL_LIMIT * arena},
        {"check": f"graphed_static pools + arena + persistent / microbatch <= "
                  f"{STATIC_MEMORY_LIMIT} x graphed_none pools",
         "value": ratio, "limit": STATIC_MEMORY_LIMIT,
         "ok": ratio is not None and ratio <= STATIC_MEMORY_LIMIT},
    ]


def cost_report(cfg: RunConfig, device: str, config_name: str | None = None) -> dict:
    """Every mode's cost (:func:`cost_mode`) and the budget checks."""
    if device not in DEVICES:
        raise ConfigError(f"--device: must be one of {list(DEVICES)}, got {device!r}")
    if device == "meta" and cfg.model.is_moe:
        raise ConfigError("--device meta: a MoE model's dispatch reads its token counts on the "
                          "host, which meta tensors do not have; cost MoE configs with --device cpu")
    modes = {name: cost_mode(mode_cfg, train_mode, device)
             for name, mode_cfg, train_mode in mode_configs(cfg)}
    return {"config": config_name, "device": device, "modes": modes, "checks": checks(modes)}


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def format_report(report: dict, per_graph: bool = True) -> str:
    """One summary table over the modes, then one table of graphs per graphed mode."""
    lines = [f"cost of {report['config'] or 'the config'} on {report['device']} (per training step)",
             "",
             f"{'mode':15} {'kernels':>8} {'eager':>6} {'replays':>7} {'bytes':>11} "
             f"{'graphs':>6} {'pools':>5} {'pool reserved':>13} {'arena':>10} {'persistent/mb':>13} "
             f"{'static bufs':>11}",
             "-" * 113]
    for name, m in report["modes"].items():
        lines.append(f"{name:15} {m['kernels_per_step']:>8} {m['eager_kernels_per_step']:>6} "
                     f"{m['graph_replays_per_step']:>7} {_size(m['bytes_per_step']):>11} "
                     f"{len(m['graphs']):>6} {m['pools']:>5} {_size(m['pool_reserved_bytes']):>13} "
                     f"{_size(m['arena_bytes']):>10} {_size(m['persistent_bytes_per_microbatch']):>13} "
                     f"{_size(m['static_buffer_bytes']):>11}")
    for c in report["checks"]:
        value = "-" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {value}")
    if not per_graph:
        return "\n".join(lines)
    for name, m in report["modes"].items():
        if not m["graphs"]:
            continue
        lines += ["", f"{name}: graphs in capture order",
                  f"{'graph':28} {'kind':9} {'kernels':>7} {'bytes':>11} {'pool':>4} "
                  f"{'pool peak':>10} {'held peak':>10} {'escaped':>10}",
                  "-" * 96]
        for g in m["graphs"]:
            lines.append(f"{g['name']:28} {g['kind']:9} {g['kernels']:>7} {_size(g['bytes']):>11} "
                         f"{g['pool']:>4} {_size(g['pool_peak_bytes']):>10} "
                         f"{_size(g['pool_held_peak_bytes']):>10} {_size(g['escaped_bytes']):>10}")
    return "\n".join(lines)
