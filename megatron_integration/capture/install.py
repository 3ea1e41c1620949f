"""Put a megatron decoder's training forward on mhc_cg's static-buffer runtime.

``install_static_recompute(decoder, ...)`` puts a decoder (megatron's ``TransformerBlock`` of
``GraphedSublayerMixin`` layers) on the runtime: the decoder's training forward becomes the
runtime's chunk forward (persistent set per microbatch, block hooks that run or replay the
recompute), and every layer that holds graphs is called through megatron's ``__call__`` for its
attention sublayer, so each layer graph replays once per microbatch. Evaluation and ``no_grad``
run the decoder's own forward. ``install_rank(decoders, ..., order)`` does it for every model
chunk of one pipeline rank: one arena and one pool of persistent sets shared by the chunks,
``max_persistent_slot_sets(order)`` sets, and each layer told which set each microbatch's graph
writes (``SublayerSite.graph_sets``).

What it does to the model: the decoder's class becomes a subclass of its own with the static
forward (as ``torch.nn.utils.parametrize`` does), and it gains ``mhc_static``; each layer gains
``mhc_site`` and, under megatron's TE graphs, becomes its class with ``GraphedSublayerMixin``
(the user's own layers, whatever spec built them). Parameters and submodules are untouched.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.core.pipeline_order import assign_persistent_slot_sets, max_persistent_slot_sets
from mhc_cg.runtime.static import StaticRecompute

from megatron_integration.capture.static_block import StaticMHCBlock
from megatron_integration.layers.graphed_sublayer import (GraphedSublayerMixin, SublayerSite,
                                                         graphs_mlp)
from megatron_integration.layers.hybrid_layer import is_hybrid_layer
from megatron_integration.layers.main_layer import graphed_layer_class
from megatron_integration.layers.moe_partial import moe_capture_step, moe_tail


class StaticDecoderMixin:
    """A ``TransformerBlock`` whose training forward runs on ``self.mhc_static`` (its runtime)."""

    mhc_static: StaticMHCBlock

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(hidden_states, attention_mask, **kwargs)
        static = self.mhc_static
        if not getattr(self, "pre_process", True):
            hidden_states = self.input_tensor  # the pipeline's received n-stream tensor
        graphed = graphed_sublayer_fns(self.layers, attention_mask, kwargs)
        return static.forward(hidden_states, attention_mask, static.draw_seed(hidden_states),
                              sublayer_fns=graphed, **kwargs)


def graphed_sublayer_fns(layers, attention_mask: Tensor | None,
                         kwargs: dict) -> dict[int, Callable]:
    """``{record's order: fn}`` for the sublayers of the layers that hold TE graphs: ``fn(x,
    frame)`` for the first sublayer the graph holds calls the layer through megatron's
    ``__call__`` (which replays this microbatch's graph; ``frame`` is the runtime's forward's,
    with the persistent set it took). Where the graph holds more of the layer, the later
    sublayers' fns take their parts of the same replay: with the MLP in the layer graph its F
    output and state (the first fn's output is already the MLP's: the runtime passes it on);
    with a MoE MLP's head in it, the MoE's eager rest from the replay's outputs
    (:func:`megatron_integration.layers.moe_partial.moe_tail`)."""
    fns = {}
    for layer in layers:
        if not getattr(layer, "cuda_graphs", None):
            continue
        site = layer.mhc_site
        replayed: deque = deque()  # what the later fns take from the replay, in order

        def replay(x: Tensor, frame, layer=layer, site=site, replayed=replayed):
            site.check_replay(getattr(layer, "current_microbatch", 0) % len(layer.cuda_graphs),
                              frame)
            outputs = layer(hidden_states=x, attention_mask=attention_mask, **kwargs)
            out, ys, states, head = site.split_outputs(outputs)
            states = states + [None] * (len(ys) - len(states))  # hooked sublayers keep none
            replayed.extend((out, y, state) for y, state in zip(ys, states))
            if site.moe_step:
                replayed.append(head)
            return out

        def take(x: Tensor, frame, replayed=replayed):
            return replayed.popleft()

        def tail(x: Tensor, frame, site=site, replayed=replayed):
            return moe_tail(site.runtime, site.steps, site.head_record, site.moe_step,
                            replayed.popleft(), frame)

        def first(x: Tensor, frame, replay=replay, later=take if site.whole else tail):
            replay(x, frame)
            return later(x, frame)

        graphed = site.whole + ([site.head_record] if site.moe_step else [])
        fns[graphed[0].order] = first
        for record in site.whole[1:]:
            fns[record.order] = take
        if site.moe_step and site.whole:
            fns[site.head_record.order] = tail
    return fns


_STATIC_DECODERS: dict[type, type] = {}


def _static_decoder_class(cls: type) -> type:
    if cls not in _STATIC_DECODERS:
        _STATIC_DECODERS[cls] = type(f"Static{cls.__name__}", (StaticDecoderMixin, cls), {})
    return _STATIC_DECODERS[cls]


def graphed_layer_of(layer) -> type:
    """The graphed subclass of a layer's class as Megatron's builders made it (same parameters
    and submodules: only its capture and replay differ)."""
    if not (hasattr(layer, "self_attention_hyper_connection") or is_hybrid_layer(layer)):
        raise TypeError(f"install_static_recompute: {type(layer).__name__} is not an mHC layer; "
                        f"mhc_cg's static runtime takes Megatron-LM's "
                        f"HyperConnectionTransformerLayer or the hybrid stack's "
                        f"HyperConnectionHybridLayer (enable its hyper-connections)")
    return graphed_layer_class(type(layer))


def install_static_recompute(decoder, static_type: type[StaticMHCBlock], *, seq_length: int,
                             micro_batch_size: int, slot_sets: int = 1,
                             shared: StaticRecompute | None = None,
                             graph_sets: list[int] | None = None,
                             fused_mhc: bool | None = None) -> StaticMHCBlock:
    """Put ``decoder``'s training forward on a ``static_type`` runtime (see the module docstring).

    ``slot_sets``: persistent slot sets, the most microbatches in flight on this rank
    (:func:`mhc_cg.core.pipeline_order.max_persistent_slot_sets` of the rank's order; 1 without
    pipeline parallelism). ``shared``: a runtime of another chunk of this rank whose arena and
    sets this one shares. ``graph_sets``: the set each microbatch of this chunk takes along the
    order (see :class:`SublayerSite`). ``seq_length`` is the rank's own (divided by the tensor
    parallel size under sequence parallelism). ``fused_mhc``: Megatron-LM's layers on mhc_cg's
    fused kernels (``None``: the config's ``use_fused_mhc``; see :class:`StaticMHCBlock`).

    The decoder keeps its parameters and submodules; its class becomes a subclass of its own
    with the static forward (as ``torch.nn.utils.parametrize`` does). Every layer must be a
    ``GraphedSublayerMixin`` when megatron's TE graphs are on, or the helper would capture the
    layer's own attention path, whose mHC state is not in the slots.
    """
    if decoder.config.cuda_graph_impl == "transformer_engine":
        for layer in decoder.layers:  # the user's own layers, as Megatron's builders made them
            if not isinstance(layer, GraphedSublayerMixin):
                layer.__class__ = graphed_layer_of(layer)
    static = static_type(decoder, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         capacity=slot_sets, shared=shared, fused_mhc=fused_mhc)
    decoder.mhc_static = static
    decoder.__class__ = _static_decoder_class(type(decoder))
    runtime = static.runtime
    with_mlp = graphs_mlp(decoder.config)
    for index, (layer, steps) in enumerate(zip(decoder.layers, static.steps)):
        layer.mhc_site = SublayerSite(runtime, steps, runtime.layout.layer_records(index),
                                      static.seeded, list(graph_sets or [0]),
                                      with_mlp=with_mlp and not getattr(steps.layer, "is_moe_layer",
                                                                        False),
                                      moe_step=moe_capture_step(steps.layer))
    return static


def install_rank(decoders: list, static_type: type[StaticMHCBlock], *, seq_length: int,
                 micro_batch_size: int, order: list[int],
                 fused_mhc: bool | None = None) -> list[StaticMHCBlock]:
    """Every model chunk of one rank on one arena and one pool of persistent sets, sized by the
    rank's ``order`` (megatron's, as its TE graph helper computes it: ``+c`` forward, ``-c``
    backward of chunk c); see the module docstring."""
    depths = {len(decoder.layers) for decoder in decoders}
    if len(depths) != 1:
        raise ValueError(f"install_rank: model chunks of {sorted(depths)} layers; the chunks of a "
                         f"rank share one pool of persistent sets and need the same depth")
    slot_sets = max_persistent_slot_sets(order)
    taken = assign_persistent_slot_sets(order)
    forwards = [code for code in order if code > 0]
    statics, shared = [], None
    for chunk, decoder in enumerate(decoders, start=1):
        graph_sets = [s for code, s in zip(forwards, taken) if code == chunk]
        static = install_static_recompute(decoder, static_type, seq_length=seq_length,
                                          micro_batch_size=micro_batch_size, slot_sets=slot_sets,
                                          shared=shared, graph_sets=graph_sets,
                                          fused_mhc=fused_mhc)
        static.order = list(order)
        shared = shared or static.runtime
        statics.append(static)
    return statics
