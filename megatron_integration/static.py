"""megatron-core's mHC block on mhc_cg's static-buffer runtime (arena slots, recompute graphs).

``StaticMHCBlock(block, ...)`` runs an ``MHCTransformerBlock``'s layers through
``mhc_cg.static_recompute.StaticRecompute``: the mHC ops of each sublayer save into arena slots,
the block input and every F output go to a persistent slot set, and a hook on each recompute
block's output re-runs (or, after ``capture_recompute_graphs``, replays) the block's mHC ops
before its backward. Megatron's modules are used as they are: the adapters below only present
each layer's parts (its ``HyperConnection``s, ``input_layernorm`` / ``pre_mlp_layernorm``,
``self_attention`` / ``mlp``, and its dropout) under the step names the runtime calls.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from mhc_cg.hyper_connection import contract_streams, expand_streams
from mhc_cg.static_recompute import StaticRecompute, build_static_recompute


class _SublayerSteps(nn.Module):
    """One megatron sublayer as the runtime's named steps (mappings ... bda)."""

    def __init__(self, layer: nn.Module, which: str):
        super().__init__()
        self.layer, self.which = layer, which
        self.hc = layer.attention_hc if which == "attention" else layer.mlp_hc
        self.norm = layer.input_layernorm if which == "attention" else layer.pre_mlp_layernorm
        self.stream = 0 if which == "attention" else 1
        config = layer.config
        self.cfg = SimpleNamespace(dropout_impl=config.mhc_dropout_impl,
                                   hidden_dropout=layer.hidden_dropout,
                                   num_streams=config.num_residual_streams,
                                   hidden_size=config.hidden_size)
        self.call_kwargs: dict = {"attention_mask": None}  # this forward's attention arguments

    def mappings(self, x: Tensor):
        return self.hc.compute_mappings(x)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        return self.hc.aggregate(x, h_pre)

    def fn(self, normed: Tensor) -> Tensor:
        if self.which == "attention":
            out, bias = self.layer.self_attention(normed, **self.call_kwargs)
        else:
            out, bias = self.layer.mlp(normed)
        return out if bias is None else out + bias

    def h_res_step(self, h_res: Tensor, x: Tensor) -> Tensor:
        return self.hc.apply_h_res(h_res, x)

    def h_post_step(self, y: Tensor, h_post: Tensor) -> Tensor:
        return self.hc.apply_h_post(y, h_post)

    def bda(self, post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        return mixed + self.layer._dropout(post, seed, self.stream)


class _LayerSteps(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer_number = layer.layer_number
        self.attention = _SublayerSteps(layer, "attention")
        self.mlp = _SublayerSteps(layer, "mlp")


class StaticMHCBlock:
    """``block`` (an ``MHCTransformerBlock`` with mHC on) on static buffers.

    ``forward(hidden_states [s, b, C], attention_mask=None, dropout_seed=None)`` matches the block's
    own forward (expand on the first stage, contract + final norm on the last); shapes are fixed
    at construction (``seq_length``, ``micro_batch_size``); ``capacity`` microbatches may be in
    flight. Blocks of ``config.mhc_recompute_layer_num`` layers (all layers when unset).
    """

    def __init__(self, block: nn.Module, *, seq_length: int, micro_batch_size: int,
                 capacity: int = 1):
        config = block.config
        if not getattr(config, "enable_hyper_connections", False):
            raise ValueError("StaticMHCBlock: the block's config has enable_hyper_connections off")
        self.block = block
        self.steps = [_LayerSteps(layer) for layer in block.layers]
        size = config.mhc_recompute_layer_num or len(self.steps)
        dtype = next(block.parameters()).dtype
        self.runtime: StaticRecompute = build_static_recompute(
            self.steps, size, seq_length=seq_length, micro_batch_size=micro_batch_size,
            capacity=capacity, device=next(block.parameters()).device, dtype=dtype)

    def capture_recompute_graphs(self, backend) -> None:
        self.runtime.capture_recompute_graphs(backend)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                dropout_seed: Tensor | None = None) -> Tensor:
        config = self.block.config
        for steps in self.steps:
            steps.attention.call_kwargs = {"attention_mask": attention_mask}
        x = expand_streams(hidden_states, config.num_residual_streams) \
            if self.block.pre_process else hidden_states
        x = self.runtime.forward(x, dropout_seed)
        if self.block.post_process:
            x = contract_streams(x, config.num_residual_streams)
            if getattr(self.block, "final_layernorm", None) is not None:
                x = self.block.final_layernorm(x)
        return x

    __call__ = forward
