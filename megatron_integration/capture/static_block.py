"""megatron's mHC blocks on mhc_cg's static-buffer runtime (arena slots, recompute graphs).

``StaticMHCBlock(block, ...)`` runs an ``MHCTransformerBlock``'s layers through
``mhc_cg.runtime.static.StaticRecompute``: the mHC ops of each sublayer save into arena slots,
the block input and every F output go to a persistent slot set, and a hook on each recompute
block's output re-runs (or, after ``capture_recompute_graphs``, replays) the block's mHC ops
before its backward. Megatron's modules are used as they are, through the step adapters of
``megatron_integration.layers.steps``.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor, nn

from mhc_cg.ops.dropout import stateful_dropout_problem
from mhc_cg.core.errors import StaticRecomputeError

from mhc_cg.runtime.recompute_captures import capture_recompute_graphs
from mhc_cg.runtime.static import StaticRecompute, build_static_recompute

from megatron_integration.layers.dev_layer import dev_layer_steps
from megatron_integration.layers.fused_sublayer import uses_fused_mhc
from megatron_integration.layers.hybrid_layer import hybrid_layer_steps
from megatron_integration.layers.main_layer import MainBlock, main_layer_steps
from megatron_integration.layers.steps import LayerSteps


class StaticMHCBlock:
    """``block`` (an ``MHCTransformerBlock`` with mHC on) on static buffers.

    ``forward(hidden_states [s, b, C], attention_mask=None, dropout_seed=None)`` matches the block's
    own forward (expand on the first stage, contract + final norm on the last); shapes are fixed
    at construction (``seq_length``, ``micro_batch_size``); ``capacity`` microbatches may be in
    flight. Blocks of ``config.mhc_recompute_layer_num`` layers (all layers when unset).
    ``fused_mhc``: Megatron-LM's own layers run mhc_cg's fused kernels (``None``: the config's
    ``use_fused_mhc``, dev's field; main has none). Subclasses for another layer type override
    ``layer_steps``, ``mhc_enabled`` and the stream boundaries (``StaticMainBlock`` below).
    """

    steps_type = LayerSteps

    def __init__(self, block: nn.Module, *, seq_length: int, micro_batch_size: int,
                 capacity: int = 1, shared: StaticRecompute | None = None,
                 fused_mhc: bool | None = None):
        config = block.config
        if not self.mhc_enabled(config):
            raise ValueError(f"{type(self).__name__}: the block's config has mHC off")
        self.block = block
        self.order: list[int] | None = None  # the rank's schedule order it was sized for
        steps_type = self.layer_steps(uses_fused_mhc(config, fused_mhc))
        self.steps = [steps_type(layer) for layer in block.layers]
        for steps in self.steps:  # bound for the layout's discovery run
            steps.bind(**token_inputs(steps.layer, seq_length, micro_batch_size))
        size = config.mhc_recompute_layer_num or len(self.steps)
        dtype = config.params_dtype  # the stream's; mHC parameters may be kept in fp32
        with leaves_no_trace(block.layers[:size]):  # the layout's run of the first block
            self.runtime: StaticRecompute = build_static_recompute(
                self.steps, size, seq_length=seq_length, micro_batch_size=micro_batch_size,
                capacity=capacity, device=next(block.parameters()).device, dtype=dtype,
                arena=shared.arena if shared else None, sets=shared.sets if shared else None)

    def mhc_enabled(self, config) -> bool:
        return bool(getattr(config, "enable_hyper_connections", False))

    def layer_steps(self, fused_mhc: bool) -> type[LayerSteps]:
        """The step adapters of the block's layers (mhc_cg's own layer: always its own ops)."""
        return self.steps_type

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        return self.block.streams_in(hidden_states)

    def streams_out(self, x: Tensor) -> Tensor:
        return self.block.streams_out(x)

    @property
    def seeded(self) -> bool:
        """Dropout draws its mask from a seed (``counter``), so a forward passes one."""
        config = self.block.config
        return (getattr(config, "mhc_dropout_impl", "torch") == "counter"
                and config.hidden_dropout > 0)

    def draw_seed(self, like: Tensor) -> Tensor | None:
        """This forward's dropout seed, drawn as the block's own forward draws it."""
        draw = getattr(self.block, "draw_dropout_seed", None)
        return draw(like) if draw is not None else None

    def capture_recompute_graphs(self, backend) -> None:
        self.runtime.recompute_graphs.update(capture_recompute_graphs(self.runtime, backend))

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                dropout_seed: Tensor | None = None, sublayer_fns: dict | None = None,
                **attention_kwargs) -> Tensor:
        """``attention_kwargs`` go to each layer's attention (rotary embeddings, ...);
        ``sublayer_fns`` replace sublayers, as in ``StaticRecompute.forward``."""
        for steps in self.steps:  # the runtime holds these objects: rebind F's arguments
            steps.bind(attention_mask, **attention_kwargs)
        x = self.runtime.forward(self.streams_in(hidden_states), dropout_seed, sublayer_fns)
        return self.streams_out(x)

    __call__ = forward


@contextlib.contextmanager
def leaves_no_trace(layers):
    """Note [the layout run leaves no trace]: the runtime lays its arena out by running the
    first block once on zeros, F included. A MoE router counts the tokens it routes into a
    buffer that the optimizer step turns into the expert-bias update, and megatron's MoE metrics
    and DSA indexer loss trackers add what they see into the next iteration's log: the layers'
    buffers and those trackers are put back as they were, so the first iteration trains and
    logs as without mhc_cg."""
    buffers = [(buffer, buffer.clone()) for layer in layers for buffer in layer.buffers()]
    trackers = [(tracker, {name: _values(entry).clone() for name, entry in tracker.items()})
                for tracker in _loss_trackers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for tracker, saved in trackers:
            for name in [name for name in tracker if name not in saved]:
                del tracker[name]
            for name, values in saved.items():
                _set_values(tracker, name, values)


def _values(entry) -> Tensor:
    """A tracker entry's per-layer values: a MoE ``MetricEntry``'s, or the DSA dict's tensor."""
    return entry if isinstance(entry, Tensor) else entry.values


def _set_values(tracker: dict, name: str, values: Tensor) -> None:
    if isinstance(tracker[name], Tensor):
        tracker[name] = values
    else:
        tracker[name].values = values


def _loss_trackers() -> list[dict]:
    """megatron's logging trackers a layer's forward adds to (those its branch has): name to
    per-layer values."""
    trackers = []
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker

        trackers.append(get_moe_metrics_tracker().metrics)
    except ImportError:
        pass
    try:
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper)

        trackers.append(DSAIndexerLossLoggingHelper.tracker)
    except ImportError:
        pass
    return trackers


def token_inputs(layer, seq_length: int, micro_batch_size: int) -> dict:
    """The token ids a hash-routed MoE layer routes by, as zeros ``[b, s]`` (the shape megatron's
    own static inputs of such a layer give them); none for other layers."""
    router = getattr(getattr(layer, "mlp", None), "router", None)
    if not getattr(router, "is_hash_layer", False):
        return {}
    device = next(layer.parameters()).device
    return {"input_ids": torch.zeros(micro_batch_size, seq_length, dtype=torch.long,
                                     device=device)}


class StaticMegatronBlock(StaticMHCBlock):
    """A block of Megatron-LM's own ``HyperConnectionTransformerLayer`` (main's or dev's) on
    static buffers. ``hidden_dropout`` must be 0 (their dropout draws from torch's stateful
    generator, which a recompute into fixed slots and a replayed graph cannot rewind), unless the
    decoder was opted into counter dropout
    (:func:`megatron_integration.layers.counter_dropout.use_counter_dropout`)."""

    def __init__(self, block, *, seq_length: int, micro_batch_size: int, capacity: int = 1,
                 shared: StaticRecompute | None = None, fused_mhc: bool | None = None):
        impl = "counter" if getattr(block, "mhc_counter_dropout", False) else "torch"
        problem = stateful_dropout_problem(impl, block.config.hidden_dropout, None,
                                           "hidden_dropout")
        if problem is not None:
            raise StaticRecomputeError(f"{type(self).__name__}: {problem}; or call "
                                       f"megatron_integration.use_counter_dropout on the decoder")
        super().__init__(block, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         capacity=capacity, shared=shared, fused_mhc=fused_mhc)

    @property
    def seeded(self) -> bool:
        return getattr(self.block, "mhc_counter_dropout", False) and self.block.config.hidden_dropout > 0


class StaticMainBlock(StaticMegatronBlock):
    """``main``'s mHC block on static buffers (arena slots, persistent sets, recompute graphs)."""

    def __init__(self, block, *, seq_length: int, micro_batch_size: int, capacity: int = 1,
                 shared: StaticRecompute | None = None, fused_mhc: bool | None = None):
        self.main = MainBlock(block)
        super().__init__(block, seq_length=seq_length, micro_batch_size=micro_batch_size,
                         capacity=capacity, shared=shared, fused_mhc=fused_mhc)

    def layer_steps(self, fused_mhc: bool) -> type[LayerSteps]:
        return main_layer_steps(fused_mhc)

    def mhc_enabled(self, config) -> bool:
        return bool(getattr(config, "enable_mhc_connections", False))

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        return self.main.streams_in(hidden_states)

    def streams_out(self, x: Tensor) -> Tensor:
        return self.main.streams_out(x)


class StaticDevBlock(StaticMegatronBlock):
    """Megatron-LM ``dev``'s mHC block on static buffers; its stream boundaries are ``dev``'s own
    block methods (the pipeline's received tensor, expand, learned contraction, final norm)."""

    def layer_steps(self, fused_mhc: bool) -> type[LayerSteps]:
        return dev_layer_steps(fused_mhc)

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        return self.block.preprocess_for_layer_schedule(hidden_states)

    def streams_out(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """As dev's block returns: with MTP on mHC, the contracted output and the streams
        before the contraction (the MTP layers' input). Viewless, as the pipeline schedule
        frees what it sends (the runtime's last post returns a view of its sum)."""
        from megatron.core.utils import make_viewless_tensor

        out, streams = self.block.postprocess_for_layer_schedule(x, return_mhc_multistream=True)
        out = make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True)
        return out if streams is None else (out, streams)


class StaticHybridBlock(StaticDevBlock):
    """Megatron-LM dev's ``HybridStack`` of mHC layers (one sublayer each,
    :mod:`megatron_integration.layers.hybrid_layer`) on static buffers; its stream boundaries are
    the stack's own: the n-fold expand on the first stage (not in an MTP layer's nested stack),
    and on the last the streams kept for MTP, dev's learned contraction and the final norm."""

    def layer_steps(self, fused_mhc: bool) -> type[LayerSteps]:
        return hybrid_layer_steps(fused_mhc)

    def streams_in(self, hidden_states: Tensor) -> Tensor:
        from megatron.core.transformer.hyper_connection import HyperConnectionModule

        stack = self.block
        if stack.pre_process and not stack.is_mtp_layer:
            return HyperConnectionModule.input_expand(hidden_states,
                                                      stack.config.num_residual_streams)
        return hidden_states

    def streams_out(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """As the stack's forward ends: with MTP on, the contracted output and the streams
        before the contraction (the MTP layers' input)."""
        from megatron.core.transformer.hyper_connection import learned_output_contract
        from megatron.core.utils import make_viewless_tensor

        stack, config = self.block, self.block.config
        streams = None
        if stack.post_process and not stack.is_mtp_layer:
            if (config.mtp_num_layers or 0) > 0:
                streams = x
            x = learned_output_contract(x, stack.hc_head_fn, stack.hc_head_base,
                                        stack.hc_head_scale, config.num_residual_streams,
                                        config.layernorm_epsilon)
        if stack.post_process and stack.post_layer_norm:
            x = stack.final_norm(x)
        x = make_viewless_tensor(inp=x, requires_grad=x.requires_grad, keep_graph=True)
        return x if streams is None else (x, streams)
