"""``mhc-cg megatron``'s work: Megatron-LM main's mHC GPT under megatron's TE graph helper.

:func:`run` checks a config for the megatron path (:func:`mhc_cg.config.rules.megatron_main_problems`),
runs :mod:`megatron_integration.harness.main_runs` in a child process with Megatron-LM main's megatron
first on the path (:mod:`megatron_integration.harness.child_process`) and returns its result;
:func:`to_json` and :func:`format_table` present it.
"""

from __future__ import annotations

import torch

from mhc_cg.config import RunConfig
from mhc_cg.core.errors import ConfigError
from mhc_cg.runtime.graphs.backends import te_available
from mhc_cg.config.choices import split_recompute_scope
from mhc_cg.config.rules import megatron_main_problems
from megatron_integration.harness.child_process import find_main, run_main_job
from megatron_integration.harness.main_runs import REFERENCES, RUNS

OURS = "mhc_cg"
JSON_FIELDS = ("losses", "saved_bytes_per_layer", "layer_graph_replays_per_step",
               "recompute_graph_replays_per_step")
PROGRESS = "[mhc-cg megatron]"


def resolve_device(cfg: RunConfig) -> str:
    """``cuda`` where asked, or for ``auto`` where a GPU and TransformerEngine are both there;
    else ``cpu`` (megatron's helper then runs with the test stand-in for TE)."""
    if cfg.train.device != "auto":
        return cfg.train.device
    return "cuda" if torch.cuda.is_available() and te_available() else "cpu"


def run(cfg: RunConfig, compare: bool, progress: bool = True) -> dict:
    """Train ``mhc_cg`` (and with ``compare`` main's three runs) in a child process; its result
    (``ConfigError`` for a config the megatron path cannot run, or when main is not found)."""
    problems = megatron_main_problems(cfg)
    if problems:
        raise ConfigError(problems)
    device = resolve_device(cfg)
    cfg = cfg.replace(train={"device": device})
    runs = list(RUNS) if compare else [OURS]
    result = run_main_job({"config": cfg.to_dict(), "runs": runs, "device": device},
                          progress_prefix=PROGRESS if progress else None)
    result["device"], result["main"] = device, find_main().describe()
    return result


def to_json(result: dict) -> dict:
    """``{"bit_identical": bool or None, "runs": {name: {losses, saved_bytes_per_layer,
    layer_graph_replays_per_step, recompute_graph_replays_per_step}}}``."""
    return {"bit_identical": result["bit_identical"],
            "runs": {name: {k: run[k] for k in JSON_FIELDS} for name, run in result["runs"].items()}}


def _equal_to_reference(result: dict, name: str) -> str:
    runs = result["runs"]
    if REFERENCES[0] not in runs:
        return "-"
    if name == REFERENCES[0]:
        return "(reference)"
    ref, run = runs[REFERENCES[0]], runs[name]
    same = run["losses"] == ref["losses"] and run["grad_digests"] == ref["grad_digests"]
    return "bit-identical" if same else "differs"


def _recomputed(run: dict) -> str:
    if run["recomputed_sublayers_per_step"]:
        return f"{run['recomputed_sublayers_per_step']} sublayers (static)"
    return f"{run['mhc_checkpoints_per_step']} checkpoints" if run["mhc_checkpoints_per_step"] else "-"


def format_table(cfg: RunConfig, result: dict) -> str:
    """One row per run, then the arena and the verdict."""
    m, t = cfg.model, cfg.train
    scopes, recompute_graphs = split_recompute_scope(cfg.graph.scopes)
    head = (f"Megatron-LM main's GPT of HyperConnectionTransformerLayer: {m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.num_streams} streams, L_r={m.resolved_recompute_layers}, "
            f"{t.dtype}; {t.steps} steps x {t.num_microbatches} microbatches on {result['device']}; "
            f"megatron's TECudaGraphHelper graphs [{', '.join(scopes)}]"
            f"{', mhc_cg the recompute' if recompute_graphs else ''} (main: {result['main']})")
    header = ("run", "loss first -> last", "vs main_eager_none", "saved / layer",
              "layer graphs / step", "recompute graphs / step", "mHC recomputed / step")
    rows = []
    for name, run in result["runs"].items():
        saved = run["saved_bytes_per_layer"]
        rows.append((name, f"{run['losses'][0]:.6f} -> {run['losses'][-1]:.6f}",
                     _equal_to_reference(result, name), "-" if saved is None else f"{saved} B",
                     str(run["layer_graph_replays_per_step"]),
                     str(run["recompute_graph_replays_per_step"]), _recomputed(run)))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [head, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if OURS in result["runs"]:
        lines.append(f"mhc_cg arena (the recompute's workspace, once per rank, not in saved / "
                     f"layer): {result['runs'][OURS]['arena_bytes']} B")
    if result["bit_identical"] is not None:
        verdict = "bit for bit" if result["bit_identical"] else "NO: " + "; ".join(result["mismatches"])
        lines.append(f"mhc_cg's losses and gradients equal {' and '.join(REFERENCES)}: {verdict}")
    return "\n".join(lines)
