"""The capture plan: what a run captures as graphs, resolved once from a checked config.

``cuda_graph_scope`` (or its newer spelling ``cuda_graph_modules``) is read here and nowhere
downstream. :func:`capture_plan` turns a validated ``RunConfig`` (and, for ``--mode`` or
``--compare``, a mode name) into a frozen :class:`CapturePlan`; models, runtimes, graphs and the
bench take that object. The flow is one way: YAML -> ``RunConfig`` -> rules
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
from typing import TYPE_CHECKING

from mhc_cg.core.errors import ConfigError

if TYPE_CHECKING:
    from mhc_cg.config import RunConfig

SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mhc_recompute")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")
MODES = ("eager_none", "eager_block", "graphed_none", "graphed_static", "attn_split")
# graphed_static with no scope configured (e.g. `train --compare` on a config without graphs)
DEFAULT_STATIC_SCOPES = ("attn", "mhc_recompute")


@dataclass(frozen=True)
class CapturePlan:
    """What one run captures, and how.

    ``mode`` is the training mode: ``eager_none`` (no recompute, the reference), ``eager_block``
    (eager block recompute), ``graphed_none`` (every sublayer a graph, no recompute) or
    ``graphed_static`` (static-buffer recompute, sublayers per ``attn``/``mlp``/``moe_step``) or
    ``attn_split`` (each attention's norm + attention a graph, mHC ops and MLP eager under eager
    block recompute; :mod:`mhc_cg.runtime.modes.attn_split`).
    ``moe_step`` is where a partially captured MoE sublayer's graph ends (``route`` or
    ``preprocess``), ``None`` without MoE partial capture. ``recompute_graph``: the block recompute
    is captured as its own graph. ``backend`` is the resolved capture backend (``tape``, ``cuda``
    or ``te``; :func:`mhc_cg.runtime.graphs.resolve_backend_name`).
    """

    mode: str
    attn: bool = False
    mlp: bool = False
    moe_step: str | None = None
    recompute_graph: bool = False
    backend: str = "tape"

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
        return tuple(names + (["mhc_recompute"] if self.recompute_graph else []))


def configured_scopes(cfg: "RunConfig") -> list[str]:
    """The scope list as written, under either spelling (:mod:`mhc_cg.config.rules` reports the two
    disagreeing); ``None`` and ``[]`` both mean "nothing captured"."""
    graph = cfg.graph
    scopes = graph.cuda_graph_scope if graph.cuda_graph_scope is not None else graph.cuda_graph_modules
    return list(scopes or [])


def scope_field(cfg: "RunConfig") -> str:
    """The field the scopes were given in (for messages): the older spelling unless only the newer."""
    graph = cfg.graph
    if graph.cuda_graph_scope is None and graph.cuda_graph_modules is not None:
        return "graph.cuda_graph_modules"
    return "graph.cuda_graph_scope"


def configured_mode(cfg: "RunConfig") -> str:
    """The mode a config asks for: ``graphed_static`` when ``mhc_recompute`` is in scope."""
    if "mhc_recompute" in configured_scopes(cfg):
        return "graphed_static"
    return "eager_block" if cfg.model.recompute == "block" else "eager_none"


def capture_plan(cfg: "RunConfig", mode: str | None = None, device: str | None = None, *,
                 on_this_machine: bool = True) -> CapturePlan:
    """The plan for ``cfg`` in ``mode`` (default: :func:`configured_mode`) on ``device``.

    ``cfg`` must have passed :func:`mhc_cg.config.rules.check`. ``graphed_static`` always graphs the
    recompute; with no scope configured it graphs ``attn`` too. ``graphed_none`` graphs every
    sublayer that can be captured whole (a MoE MLP cannot: its dispatch has data-dependent shapes).
    ``attn_split`` graphs the attention consumers only, whatever the configured scopes.
    ``on_this_machine=False`` resolves the backend without asking whether this machine has a GPU
    (``config check`` of a config meant for another machine).
    """
    from mhc_cg.runtime.graphs.capture import resolve_backend_name

    mode = mode or configured_mode(cfg)
    if mode not in MODES:
        raise ConfigError(f"--mode: must be one of {list(MODES)}, got {mode!r}")
    try:
        backend = resolve_backend_name(cfg.graph.backend, device or cfg.train.device,
                                       on_this_machine=on_this_machine)
    except ValueError as exc:
        raise ConfigError(f"graph.backend: {exc}") from None
    if mode in ("eager_none", "eager_block"):
        return CapturePlan(mode, backend=backend)
    if mode == "graphed_none":
        return CapturePlan(mode, attn=True, mlp=not cfg.model.is_moe, backend=backend)
    if mode == "attn_split":
        return CapturePlan(mode, attn=True, backend=backend)
    scopes = set(configured_scopes(cfg) or DEFAULT_STATIC_SCOPES)
    moe_step = None
    if cfg.model.is_moe and "moe_router" in scopes:
        moe_step = "preprocess" if "moe_preprocess" in scopes else "route"
    return CapturePlan(mode, attn="attn" in scopes, mlp="mlp" in scopes and not cfg.model.is_moe,
                       moe_step=moe_step, recompute_graph=True, backend=backend)
