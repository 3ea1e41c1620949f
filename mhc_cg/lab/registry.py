"""Training modes: each one object (:class:`Mode`) in one registry (:data:`MODES`).

A mode says what model settings it implies, what it captures (its :class:`CapturePlan`), which
:class:`~mhc_cg.modes.lifecycle.ModeModel` runs it, and what it is comparable with.
``train``, ``--compare``, ``bench``, ``cost``, ``probe``, the pipeline driver and the CLI's choices
iterate :data:`MODES`; registering a mode here (:func:`register`) is all it takes to add one.

Built in, in this order:

* ``eager_none``: eager, no recompute of any kind (the reference every other mode must equal);
* ``eager_block``: eager block recompute (frees the mHC intermediates, re-allocates them);
* ``graphed_none``: every sublayer a graph, no recompute;
* ``graphed_static``: static-buffer recompute, the configured scopes graphed (this project);
* ``attn_split``: Megatron-LM dev's split: each attention's norm + attention a graph fed by the
  eager aggregate, the rest eager under eager block recompute;
* ``graphed_full``: one captured training iteration (every microbatch's forward and backward)
  around eager block recompute, as Megatron's ``FullCudaGraphWrapper`` captures it;
* ``graphed_full_static``: the same capture around the static runtime (arena, persistent sets);
* ``moe_partial``: static-buffer recompute with MoE partial capture on the MoE version of the
  model (a dense model gets ``moe_experts`` experts, together as wide as its MLP); it trains
  another model, so it is not compared with the reference;
* ``plain_residual``: the same F on a plain residual (``x + dropout(F(norm(x)))``, one stream,
  eager): not the same model either; each mode's mHC overhead is its step over this one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mhc_cg.config import RunConfig
from mhc_cg.config.choices import RECOMPUTE_SCOPE
from mhc_cg.core.errors import ConfigError
from mhc_cg.ops.dropout import stateful_dropout_problem
from mhc_cg.lab.references.attn_split import AttnSplitModel
from mhc_cg.lab.references.eager import EagerModel
from mhc_cg.lab.references.graphed_full import FullEagerModel
from mhc_cg.modes.full_iteration import FullStaticModel
from mhc_cg.lab.references.graphed_none import GraphedSublayersModel
from mhc_cg.modes.graphed_static import GraphedStaticModel
from mhc_cg.modes.plan import static_capture
from mhc_cg.training.run import Mode


MODES: dict[str, Mode] = {}
REFERENCE = "eager_none"
PLAIN = "plain_residual"  # the same F without mHC: each mode's mHC overhead is over its step


def register(mode: Mode) -> Mode:
    """Add ``mode`` to the registry (after the modes already there); its name must be new."""
    if mode.name in MODES:
        raise ValueError(f"mode {mode.name!r} is already registered")
    MODES[mode.name] = mode
    return mode


def unregister(name: str) -> None:
    MODES.pop(name)


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ConfigError(f"--mode: must be one of {list(MODES)}, got {name!r}")
    return MODES[name]


# the modes that run DeepSeek-V4.1's delayed pre (model.arithmetic: v41): stepwise torch ops,
# eagerly; the static runtime and the graphs take fused sublayers' one stream tensor
DELAYED_PRE_MODES = (REFERENCE, "eager_block", PLAIN)


def arithmetic_refusal(cfg: RunConfig, mode: str) -> str | None:
    """Why ``mode`` cannot run ``cfg.model.arithmetic``, one line naming the field, or ``None``."""
    if cfg.model.arithmetic != "v41" or mode in DELAYED_PRE_MODES:
        return None
    return (f"model.arithmetic: v41 (the delayed pre) trains in {', '.join(DELAYED_PRE_MODES[:2])}; "
            f"mode {mode} runs arithmetic main or dev")


def configured_mode(cfg: RunConfig) -> str:
    """The mode a config asks for: ``graphed_static`` when ``mhc_recompute`` is in scope, else
    eager block recompute or none as ``model.recompute`` says."""
    if RECOMPUTE_SCOPE in cfg.graph.scopes:
        return "graphed_static"
    return "eager_block" if cfg.model.recompute == "block" else REFERENCE


# --------------------------------------------------------------------------------------------
# The built-in modes.

def _moe_variant(cfg: RunConfig, *, moe_experts: int = 8, moe_top_k: int = 2) -> RunConfig:
    model = {"recompute": "block"}
    if not cfg.model.is_moe:
        model.update(num_experts=moe_experts, moe_top_k=moe_top_k,
                     moe_ffn_hidden_size=max(cfg.model.ffn_hidden_size // moe_experts, 1),
                     recompute_activation=False, recompute_activation_layers=None)
    return cfg.replace(model=model, graph=cfg.graph.with_scopes(
        ["attn", "moe_router", "moe_preprocess", RECOMPUTE_SCOPE]))


def _plain_variant(cfg: RunConfig, **_) -> RunConfig:
    """The same F on a plain residual: one stream, no mHC ops, nothing to recompute or capture;
    torch's dropout (one kernel, as Megatron's fused bias-dropout-add), where mHC's is fused into
    its post."""
    return cfg.replace(model={"residual": "plain", "num_streams": 1, "recompute": "none",
                              "recompute_activation": False, "recompute_activation_layers": None,
                              "dropout_impl": "torch"},
                       graph=cfg.graph.with_scopes([]))


def _full_capture(cfg: RunConfig) -> dict:
    return dict(iteration_microbatches=cfg.train.num_microbatches)


def _replays_dropout(cfg: RunConfig, device: str) -> str | None:
    """A mode whose graphs (or static slots) hold the dropout: torch's mask cannot be redrawn."""
    m = cfg.model
    return stateful_dropout_problem(m.dropout_impl, m.hidden_dropout, "model.dropout_impl",
                                    "model.hidden_dropout",
                                    also="or an eager mode (eager_none, eager_block, attn_split)")


def _full_unavailable(cfg: RunConfig, device: str) -> str | None:
    """Why one captured iteration cannot train ``cfg``: what changes on the host between steps,
    or what only the host can decide inside one (then the dropout, as for every graphed mode:
    ``graphed_full``'s eager recompute would rewind the generator inside the graph, which
    Megatron refuses too)."""
    if cfg.train.dtype == "fp16":
        return ("train.dtype: fp16's loss scale moves on the host between steps, and a captured "
                "iteration keeps the one it was captured with; use bf16 or fp32, or a mode that "
                "captures less (graphed_static)")
    if cfg.model.is_moe:
        return ("model.num_experts: a dropless MoE layer's dispatch sizes its buffers from token "
                "counts read on the host, which one captured iteration cannot do; use moe_partial "
                "(MoE partial capture)")
    return _replays_dropout(cfg, device)


def _moe_unavailable(cfg: RunConfig, device: str) -> str | None:
    if (problem := _replays_dropout(cfg, device)) is not None:
        return problem
    if device == "meta":
        return ("a MoE model's dispatch reads its token counts on the host, which meta tensors "
                "do not have")
    return None


for _mode in (
    Mode("eager_none", "eager, no recompute (the reference)", EagerModel,
         recompute_activation=False),
    Mode("eager_block", "eager block recompute (frees and re-allocates)", EagerModel,
         recompute="block"),
    # Activation recompute frees a storage, which no graph can hold
    Mode("graphed_none", "every sublayer a graph, no recompute", GraphedSublayersModel,
         recompute_activation=False,
         capture=lambda cfg: dict(attn=True, mlp=not cfg.model.is_moe), unavailable=_replays_dropout),
    Mode("graphed_static", "static-buffer recompute, sublayers and recompute in graphs",
         GraphedStaticModel, capture=static_capture, pipelines=True, unavailable=_replays_dropout),
    Mode("attn_split", "Megatron-LM dev's split: attention graphs, the rest eager block recompute",
         AttnSplitModel, recompute="block", capture=lambda cfg: dict(attn=True)),
    Mode("graphed_full", "one captured iteration around eager block recompute (Megatron's "
         "full-iteration capture)", FullEagerModel, recompute="block", capture=_full_capture,
         unavailable=_full_unavailable),
    Mode("graphed_full_static", "one captured iteration around the static runtime",
         FullStaticModel, capture=_full_capture, unavailable=_full_unavailable),
    Mode("moe_partial", "graphed_static with MoE partial capture, on the MoE model",
         GraphedStaticModel, capture=static_capture, same_model=False, configure=_moe_variant,
         unavailable=_moe_unavailable),
    Mode(PLAIN, "the same F on a plain residual, eager: the baseline of mHC's overhead",
         EagerModel, recompute_activation=False, same_model=False, configure=_plain_variant),
):
    register(_mode)
