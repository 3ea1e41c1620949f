"""The reference mhc_cg's Megatron runs with fused kernels are held to: Megatron-LM's own decoder
with its layers' mHC on mhc_cg's fused kernels, eager, without recompute or graphs.

``use_fused_eager(decoder)`` makes the decoder's training forward run each layer's two sublayers
through the fused step adapters (:func:`megatron_integration.layers.main_layer.main_layer_steps`,
:func:`megatron_integration.layers.dev_layer.dev_layer_steps`), between the branch's own stream
boundaries, with the counter-dropout seed the decoder draws. The static runtime's forward, its
recompute and its graphs must then give the same bits (``mhc-cg megatron --compare`` with
``megatron.use_fused_mhc``). A comparison's reference, so it lives with the harness: the decoder's
class becomes a subclass of its own with this forward, as the static runtime's install does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.model.sublayer import sublayer_forward
from megatron_integration.layers.dev_layer import is_dev_config, layer_steps_of


class FusedEagerDecoderMixin:
    """A ``TransformerBlock`` of Megatron's mHC layers whose training forward runs them on
    mhc_cg's fused kernels, eagerly."""

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return super().forward(hidden_states, attention_mask, **kwargs)
        dev = is_dev_config(self.config)
        if dev:
            x = self.preprocess_for_layer_schedule(hidden_states)
        else:
            from megatron_integration.layers.main_layer import MainBlock

            boundaries = MainBlock(self)
            x = boundaries.streams_in(hidden_states if self.pre_process else self.input_tensor)
        draw = getattr(self, "draw_dropout_seed", None)
        seed = draw(x) if draw is not None else None
        steps_type = layer_steps_of(self.config, True)
        for layer in self.layers:
            steps = steps_type(layer, attention_mask, **kwargs)
            x = sublayer_forward(steps.attention, x, seed)
            x = sublayer_forward(steps.mlp, x, seed)
        return self.postprocess_for_layer_schedule(x) if dev else boundaries.streams_out(x)


_CLASSES: dict[type, type] = {}


def use_fused_eager(decoder) -> None:
    """``decoder``'s training forward on mhc_cg's fused kernels (see the module docstring)."""
    cls = type(decoder)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FusedEager{cls.__name__}", (FusedEagerDecoderMixin, cls), {})
    decoder.__class__ = _CLASSES[cls]
