"""The capture plan: what one run captures as graphs, resolved once from a checked config.

``cuda_graph_scope`` (or its newer spelling ``cuda_graph_modules``) is read by the modes' plans
(:mod:`mhc_cg.lab.registry`) and nowhere downstream: models, runtimes, graphs and the
tools take the frozen :class:`CapturePlan`. The flow is one way: YAML -> ``RunConfig`` -> rules
(:mod:`mhc_cg.config.rules`) -> ``CapturePlan`` -> model/runtime -> graphs -> results.

Scopes name what is captured:

* ``attn``: the attention sublayer with its mHC ops; ``mlp``: the dense MLP sublayer;
* ``moe``: the whole MoE MLP, as megatron-core captures it (only for drop-and-pad MoE);
* ``moe_router`` / ``moe_preprocess``: partial capture of the MoE sublayer, ended by megatron-core's
  ``MoECudaGraphPartialCaptureSignal``;
* ``mhc_recompute``: the block recompute graph of static-buffer recompute (ours, unknown to
  megatron-core).
"""

from __future__ import annotations

from dataclasses import dataclass

from mhc_cg.config import RunConfig
from mhc_cg.config.choices import DEFAULT_STATIC_SCOPES, RECOMPUTE_SCOPE


@dataclass(frozen=True)
class CapturePlan:
    """What one run captures, and how.

    ``mode`` names the training mode (:mod:`mhc_cg.lab.registry`). ``attn`` / ``mlp``:
    those sublayers are graphs. ``moe_step`` is where a partially captured MoE sublayer's graph ends
    (``route`` or ``preprocess``), ``None`` without MoE partial capture. ``recompute_graph``: the
    block recompute is captured as its own graph. ``iteration_microbatches``: that many
    microbatches' forward, loss and backward are one graph (full-iteration capture; 0: none).
    ``api`` is what captures, resolved from ``graph.backend``: ``te`` (TransformerEngine's
    ``make_graphed_callables``), ``tape`` or ``cuda`` (mhc_cg's, over that backend;
    :func:`mhc_cg.graphs.resolve_backend_name`).
    """

    mode: str
    attn: bool = False
    mlp: bool = False
    moe_step: str | None = None
    recompute_graph: bool = False
    iteration_microbatches: int = 0
    api: str = "tape"

    @property
    def graphed_sublayers(self) -> bool:
        """Any sublayer (or part of one) is captured."""
        return self.attn or self.mlp or self.moe_step is not None

    @property
    def scopes(self) -> tuple[str, ...]:
        """The plan as scope names (for messages and reports)."""
        names = [name for name, on in (("attn", self.attn), ("mlp", self.mlp)) if on]
        if self.moe_step is not None:
            names += ["moe_router"] + (["moe_preprocess"] if self.moe_step == "preprocess" else [])
        names += [RECOMPUTE_SCOPE] if self.recompute_graph else []
        return tuple(names + (["full_iteration"] if self.iteration_microbatches else []))


def static_capture(cfg: RunConfig) -> dict:
    """Static-buffer recompute's plan fields from the configured scopes: the recompute is always a
    graph; with no scope configured, ``attn`` is too. A MoE MLP is never captured whole (its
    dispatch has data-dependent shapes): ``moe_router`` [+ ``moe_preprocess``] capture its head."""
    scopes = set(cfg.graph.scopes or DEFAULT_STATIC_SCOPES)
    moe_step = None
    if cfg.model.is_moe and "moe_router" in scopes:
        moe_step = "preprocess" if "moe_preprocess" in scopes else "route"
    return dict(attn="attn" in scopes, mlp="mlp" in scopes and not cfg.model.is_moe,
                moe_step=moe_step, recompute_graph=True)
