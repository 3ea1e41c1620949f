"""The layer side of megatron's TE layer graphs on mhc_cg's static runtime.

Note [Megatron drives it] (docs/design.md, item 12). megatron-core's ``TECudaGraphHelper``
(``cuda_graph_impl: transformer_engine``) graphs each
``GraphableMegatronModule`` layer: TE's ``make_graphed_callables`` calls the layer, whose
``__call__`` routes to ``_te_cuda_graph_capture`` while the helper captures, and to
``_te_cuda_graph_replay`` once the layer holds graphs. ``GraphedSublayerMixin`` (put before the
layer class in the bases) makes both the *attention sublayer on the n*C stream* of the static
runtime, mHC ops included:

* capture: the runtime's sublayer path (``SublayerPath.run``) of the attention steps, so its
  mHC ops save into arena slots and F's output and the block input go to the persistent slot set; the graph returns
  ``(output, F output)`` (and a fused sublayer's mapping state). With ``mlp`` in the graph scope
  (``SublayerSite.with_mlp``) the MLP sublayer follows inside the same graph, the same way, and
  the graph returns ``(output, attention's F output, MLP's F output)`` (and both states). In a
  MoE layer with ``moe_router`` [+ ``moe_preprocess``] in scope (``SublayerSite.moe_step``) the
  graph goes on into the MLP sublayer up to megatron's partial-capture signal and returns what
  the eager rest needs after those (:mod:`megatron_integration.layers.moe_partial`);
* replay: megatron's own replay (its manual parameter hooks, the graph of this microbatch);
  without ``mlp`` in scope a dense MLP sublayer stays with the runtime, eager, and a MoE one
  runs its eager rest there.

Where the layer runs on the runtime (``SublayerSite``) is set by
:func:`megatron_integration.capture.install.install_static_recompute`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor
import torch

from mhc_cg.graphs import graph_capturing
from mhc_cg.runtime.chunk import SublayerRecord
from mhc_cg.runtime.frame import Frame
from mhc_cg.runtime.static import StaticRecompute

from megatron_integration.layers.moe_partial import moe_head
from megatron_integration.layers.steps import LayerSteps


@dataclass
class SublayerSite:
    """Where a layer's graphed sublayers run on the runtime: its steps and its sublayers' records
    (attention, MLP) in the runtime's chunk.

    ``graph_sets[k]``: the persistent set microbatch k of this layer's model chunk takes along
    the rank's order (first-in first-out, as the runtime's forward acquires them). megatron's
    helper captures one graph per (layer, microbatch), microbatch 0 first; each capture writes
    its microbatch's set, so a replay writes the set its forward took. With one set (no
    pipeline) every capture and replay writes it.
    """

    runtime: StaticRecompute
    steps: LayerSteps
    records: list[SublayerRecord]
    seeded: bool  # dropout draws its mask from the persistent set's seed
    graph_sets: list[int] = field(default_factory=lambda: [0])
    captures: int = 0  # graphs of this layer captured so far
    warmups: int = 0  # warm-up calls of the graph body so far (TE's, before it captures)
    with_mlp: bool = False  # the layer graph holds the MLP sublayer too (``mlp`` in scope)
    moe_step: str | None = None  # the graph ends in the MoE MLP: after "route" or "preprocess"
    layout: tuple[int, int] | None = None  # F outputs and states a graph returns, from its capture

    def graph_body(self, x: Tensor, attention_mask: Tensor | None, kwargs: dict) -> tuple:
        """What the layer graph holds: the attention sublayer (and the MLP's, ``with_mlp``) with
        its mHC ops in slots, then a MoE MLP's head (``moe_step``):
        ``(output, each F output, each fused sublayer's mapping state, *MoE head)`` (a graph's
        outputs are tensors); :meth:`split_outputs` reads it back."""
        sets = self.runtime.sets
        pset = sets.fixed_set() if sets.capacity == 1 else sets.all_sets()[self._capture_set()]
        return self._sublayers(x, attention_mask, kwargs, pset)

    @property
    def whole(self) -> list[SublayerRecord]:
        """The records the layer graph holds whole: the attention's, and the MLP's with ``mlp``
        in scope (``with_mlp``); a hybrid stack's layer has one of the two."""
        return [r for r in self.records if r.k == 0 or (self.with_mlp and r.k == 1)]

    @property
    def head_record(self) -> SublayerRecord:
        """The MoE MLP's record, whose head ends the graph (``moe_step``)."""
        return next(r for r in self.records if r.k == 1)

    def split_outputs(self, outputs) -> tuple[Tensor, list[Tensor], list[Tensor], tuple]:
        """A replay's outputs as ``(output, F outputs, mapping states, MoE head)``."""
        if self.layout is None:
            raise RuntimeError(f"layer {self.steps.layer_number}: replayed before any capture")
        fns, states = self.layout
        out, *rest = outputs
        return out, rest[:fns], rest[fns:fns + states], tuple(rest[fns + states:])

    def _capture_set(self) -> int:
        """The set this call writes outside a forward: a capture's microbatch's, in capture
        order. TE's warm-up walks the same order before it captures (its ``_order``; without
        one, a single set), several microbatches in flight: each warm-up call writes its
        microbatch's set too, so no call overwrites what an earlier one's backward still
        reads."""
        if not graph_capturing():
            k, self.warmups = self.warmups, self.warmups + 1
            return self.graph_sets[k % len(self.graph_sets)]
        k, self.captures = self.captures, self.captures + 1
        if k >= len(self.graph_sets):
            raise RuntimeError(f"layer {self.steps.layer_number}: graph capture {k + 1} but the "
                               f"rank's order has {len(self.graph_sets)} microbatches for this "
                               f"chunk; install the runtime with the helper's order")
        return self.graph_sets[k]

    def check_replay(self, microbatch: int, frame: Frame) -> None:
        """The graph of ``microbatch`` writes the set the runtime's forward took for it (that
        forward's ``frame``)."""
        if self.runtime.sets.capacity == 1:
            return
        expected, taken = self.graph_sets[microbatch], frame.pset.index
        if expected != taken:
            raise RuntimeError(f"layer {self.steps.layer_number}: the graph of microbatch "
                               f"{microbatch} writes persistent set {expected}, but its forward "
                               f"took set {taken}; the schedule ran another order than the one "
                               f"the runtime was installed with")

    def _sublayers(self, x: Tensor, attention_mask: Tensor | None, kwargs: dict, pset) -> tuple:
        self.steps.bind(attention_mask, **kwargs)
        # the seed of the set this capture writes (its microbatch's, along the order)
        frame = Frame(pset, pset.seed if self.seeded else None)
        fn_outputs, states = [], []
        for record in self.whole:
            x, y, state = self.runtime.path.run(record, x, frame)
            # F's output and the state only feed the persistent set
            fn_outputs.append(y.detach())
            if state is not None:
                states.append(state.detach())
        head = moe_head(self.runtime, self.steps, self.head_record, x, frame) if self.moe_step \
            else ()
        self.layout = (len(fn_outputs), len(states))
        return (x, *fn_outputs, *states, *head)


class GraphedSublayerMixin:
    """The attention sublayer, mHC ops included, as the layer's TE graph; see the module docstring."""

    mhc_site: SublayerSite | None = None

    def get_layer_static_inputs(self, seq_length: int, micro_batch_size: int) -> dict:
        """megatron's static inputs with the hidden states on the n*C stream, in the layer's dtype."""
        inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        hidden = inputs["hidden_states"]
        cfg = self._site().runtime.layout.cfg
        inputs["hidden_states"] = torch.ones(
            (hidden.shape[0], hidden.shape[1], cfg.num_streams * cfg.hidden_size),
            dtype=self.config.params_dtype, device=hidden.device, requires_grad=True)
        return inputs

    def _te_cuda_graph_capture(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                               **kwargs) -> tuple:
        """The graph's body: the attention sublayer (and the MLP's, with ``mlp`` in scope)."""
        return self._site().graph_body(hidden_states, attention_mask, _attention_kwargs(kwargs))

    def _te_cuda_graph_replay(self, *args, **kwargs):
        from megatron.core.transformer.module import GraphableMegatronModule

        # megatron's replay of this microbatch's graph, without TransformerLayer's eager MLP after it
        return GraphableMegatronModule._te_cuda_graph_replay(self, *args, **kwargs)

    def _site(self) -> SublayerSite:
        if self.mhc_site is None:
            raise RuntimeError(f"{type(self).__name__} {self.layer_number}: no static runtime; call "
                               f"megatron_integration.capture.install.install_static_recompute on "
                               f"its decoder before the TE graph helper captures it")
        return self.mhc_site


def _attention_kwargs(kwargs: dict) -> dict:
    """The layer keywords the attention takes (TE adds ``is_first_microbatch`` for its modules)."""
    return {k: v for k, v in kwargs.items() if k != "is_first_microbatch"}


def graphs_mlp(config) -> bool:
    """``mlp`` is in the config's graph scope (``cuda_graph_modules``, or megatron-core 0.16's
    ``cuda_graph_scope``; enum members or strings)."""
    scopes = getattr(config, "cuda_graph_modules", None) or getattr(config, "cuda_graph_scope", None)
    return any(getattr(scope, "name", scope) == "mlp" for scope in scopes or ())
