"""mHC layers under megatron-core's TE layer graphs, on mhc_cg's static-buffer runtime.

megatron-core's ``TECudaGraphHelper`` (``cuda_graph_impl: transformer_engine``) graphs each
``GraphableMegatronModule`` layer: TE's ``make_graphed_callables`` calls the layer, whose
``__call__`` routes to ``_te_cuda_graph_capture`` while the helper captures, and to
``_te_cuda_graph_replay`` once the layer holds graphs. ``GraphedSublayerMixin`` (put before the
layer class in the bases) makes both the *attention sublayer on the n*C stream* of the static
runtime, mHC ops included:

* capture: ``StaticRecompute.sublayer`` of the attention steps, so its mHC ops save into arena
  slots and F's output and the block input go to the persistent slot set; the graph returns
  ``(output, F output)``;
* replay: megatron's own replay (its manual parameter hooks, the graph of this microbatch);
  the MLP sublayer stays with the runtime, eager.

``install_static_recompute(decoder, ...)`` puts a decoder (megatron's ``TransformerBlock`` of such
layers) on the runtime: the decoder's training forward becomes the runtime's chunk forward
(persistent set per microbatch, block hooks that run or replay the recompute), and every layer
that holds graphs is called through megatron's ``__call__`` for its attention sublayer, so each
layer graph replays once per microbatch. Evaluation and ``no_grad`` run the decoder's own forward.

One persistent slot set (one microbatch in flight: no pipeline parallelism): a captured graph
writes the set it was captured with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.runtime.recompute.static import StaticRecompute

from .static import StaticMHCBlock
from .steps import LayerSteps


@dataclass
class SublayerSite:
    """Where a layer's attention sublayer runs on the runtime: its steps and block position."""

    runtime: StaticRecompute
    steps: LayerSteps
    position: int
    seed: Tensor | None  # the persistent set's seed buffer, when dropout draws from seeds

    def attention(self, x: Tensor, attention_mask: Tensor | None, kwargs: dict) -> tuple:
        """The attention sublayer with its mHC ops in slots: ``(output, F output)``, and the
        mapping state after them for a fused sublayer (a graph's outputs are tensors)."""
        self.steps.bind(attention_mask, **kwargs)
        out, y, state = self.runtime.sublayer(self.steps.attention, self.position, 0, x, self.seed)
        # F's output and the state only feed the persistent set
        return (out, y.detach()) if state is None else (out, y.detach(), state.detach())


class GraphedSublayerMixin:
    """The attention sublayer, mHC ops included, as the layer's TE graph; see the module docstring."""

    mhc_site: SublayerSite | None = None

    def get_layer_static_inputs(self, seq_length: int, micro_batch_size: int) -> dict:
        """megatron's static inputs with the hidden states on the n*C stream, in the layer's dtype."""
        inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        hidden = inputs["hidden_states"]
        cfg = self._site().steps.attention.cfg
        inputs["hidden_states"] = torch.ones(
            (hidden.shape[0], hidden.shape[1], cfg.num_streams * cfg.hidden_size),
            dtype=self.config.params_dtype, device=hidden.device, requires_grad=True)
        return inputs

    def _te_cuda_graph_capture(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                               **kwargs) -> tuple:
        return self._site().attention(hidden_states, attention_mask, _attention_kwargs(kwargs))

    def _te_cuda_graph_replay(self, *args, **kwargs):
        from megatron.core.transformer.module import GraphableMegatronModule

        # megatron's replay of this microbatch's graph, without TransformerLayer's eager MLP after it
        return GraphableMegatronModule._te_cuda_graph_replay(self, *args, **kwargs)

    def _site(self) -> SublayerSite:
        if self.mhc_site is None:
            raise RuntimeError(f"{type(self).__name__} {self.layer_number}: no static runtime; call "
                               f"megatron_integration.graphed_layer.install_static_recompute on "
                               f"its decoder before the TE graph helper captures it")
        return self.mhc_site


def _attention_kwargs(kwargs: dict) -> dict:
    """The layer keywords the attention takes (TE adds ``is_first_microbatch`` for its modules)."""
    return {k: v for k, v in kwargs.items() if k != "is_first_microbatch"}


class StaticDecoderMixin:
    """A ``TransformerBlock`` whose training forward runs on ``self.mhc_static`` (its runtime)."""

    mhc_static: StaticMHCBlock

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(hidden_states, attention_mask, **kwargs)
        static = self.mhc_static
        graphed = graphed_sublayer_fns(self.layers, attention_mask, kwargs)
        return static.forward(hidden_states, attention_mask, static.draw_seed(hidden_states),
                              sublayer_fns=graphed, **kwargs)


def graphed_sublayer_fns(layers, attention_mask: Tensor | None,
                         kwargs: dict) -> dict[tuple[int, int], Callable]:
    """``{(layer number, 0): fn}`` for the layers that hold TE graphs: ``fn(x, seed)`` calls the
    layer through megatron's ``__call__`` (which replays this microbatch's graph)."""
    fns = {}
    for layer in layers:
        if getattr(layer, "cuda_graphs", None):
            def replay(x: Tensor, seed: Tensor | None, layer=layer) -> tuple:
                out, y, *state = layer(hidden_states=x, attention_mask=attention_mask, **kwargs)
                return out, y, (state[0] if state else None)
            fns[(layer.layer_number, 0)] = replay
    return fns


_STATIC_DECODERS: dict[type, type] = {}


def _static_decoder_class(cls: type) -> type:
    if cls not in _STATIC_DECODERS:
        _STATIC_DECODERS[cls] = type(f"Static{cls.__name__}", (StaticDecoderMixin, cls), {})
    return _STATIC_DECODERS[cls]


def install_static_recompute(decoder, static_type: type[StaticMHCBlock], *, seq_length: int,
                             micro_batch_size: int) -> StaticMHCBlock:
    """Put ``decoder``'s training forward on a ``static_type`` runtime (see the module docstring).

    The decoder keeps its parameters and submodules; its class becomes a subclass of its own
    with the static forward (as ``torch.nn.utils.parametrize`` does). Every layer must be a
    ``GraphedSublayerMixin`` when megatron's TE graphs are on, or the helper would capture the
    layer's own attention path, whose mHC state is not in the slots.
    """
    if decoder.config.pipeline_model_parallel_size > 1:
        raise NotImplementedError(
            f"install_static_recompute: pipeline_model_parallel_size="
            f"{decoder.config.pipeline_model_parallel_size}: a layer graph writes the one persistent "
            f"slot set it was captured with, so one microbatch may be in flight here; run pipeline "
            f"parallelism on mhc_cg's own pipeline driver (mhc-cg train with parallel.pp_size)")
    if decoder.config.cuda_graph_impl == "transformer_engine":
        plain = [type(layer).__name__ for layer in decoder.layers
                 if not isinstance(layer, GraphedSublayerMixin)]
        if plain:
            raise TypeError(f"install_static_recompute: layers {sorted(set(plain))} are not "
                            f"GraphedSublayerMixin layers; build the model from the graphed layer "
                            f"spec (main_mhc_layer_spec(graphed=True) for Megatron-LM main)")
    static = static_type(decoder, seq_length=seq_length, micro_batch_size=micro_batch_size)
    decoder.mhc_static = static
    decoder.__class__ = _static_decoder_class(type(decoder))
    runtime = static.runtime
    seed = runtime.sets.all_sets()[0].seed if static.seeded else None
    for index, (layer, steps) in enumerate(zip(decoder.layers, static.steps)):
        layer.mhc_site = SublayerSite(runtime, steps, index % runtime.block_size, seed)
    return static
