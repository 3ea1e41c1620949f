"""Counter dropout in Megatron-LM's own mHC layers (main's and dev's): the opt-in that makes
dropout replayable.

Their mHC bias-dropout-add (``HyperConnectionModule.fused_h_res_h_post_bda``) draws its mask from
torch's stateful generator, which neither a recompute into static slots nor a replayed graph can
rewind, so with ``hidden_dropout > 0`` mhc_cg refuses it. ``use_counter_dropout(decoder)`` makes
that dropout mhc_cg's counter dropout (:mod:`mhc_cg.ops.dropout`): the mask of each sublayer is a
function of (the forward's seed, the sublayer's stream id ``2 * layer_number + k``, the element
index). The eager layer, Megatron's own ``[mhc]`` recompute, mhc_cg's graphed forward and its
recompute graph then draw the same mask.

What it does: the decoder draws one seed per forward (a forward pre-hook, from torch's CPU
generator, the draw mhc_cg's own block makes) and hands it out through ``draw_dropout_seed``, which
the static runtime reads; each layer's two hyper-connection modules get a counter version of
``fused_h_res_h_post_bda`` (their own dropout path, op for op: ``H_res`` applied, ``H_post`` to F's
output and bias, ``mixed + dropout(...)``, with the counter mask in place of torch's), and the
layer is marked ``mhc_counter_dropout`` for the step adapters
(:class:`megatron_integration.layers.main_layer.MainSublayerSteps`,
:class:`megatron_integration.layers.dev_layer.DevSublayerSteps`). Call it before the TE graph
helper is made, on every run that must draw the same masks.

A seed given to the decoder (``decoder.mhc_dropout_seed_feed``, a 0-dim int64 tensor: the
microbatch's own, from its batch) is taken in place of a draw, as it lies: under one graph of the
whole iteration (Megatron's ``FullCudaGraphWrapper``) a draw from the host generator would be
made once, at capture, and every replay would use its mask; the batch's seed is copied into the
wrapper's static buffers before each replay, like the tokens.

:func:`use_counter_embedding_dropout` does the same for the GPT's embedding dropout (torch's
``Dropout(hidden_dropout)`` on the first stage), from the seed given to the decoder: where the
whole iteration is one graph, that dropout is inside it too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.ops.dropout import dropout


# the embedding's counter-dropout stream: megatron's layer numbers start at 1, so no sublayer's
# stream (2 * layer_number + k) is below 2
EMBEDDING_STREAM = 0


def sublayer_stream(layer_number: int, k: int) -> int:
    """The counter-dropout stream of sublayer ``k`` (0 attention, 1 MLP) of a layer: unique in
    the model (megatron's layer numbers are global across pipeline stages)."""
    return 2 * layer_number + k


def use_counter_dropout(decoder) -> None:
    """Counter dropout for every mHC sublayer of ``decoder`` (a ``TransformerBlock`` of main's or
    dev's ``HyperConnectionTransformerLayer``); see the module docstring."""
    if getattr(decoder, "mhc_counter_dropout", False):
        return
    decoder.mhc_counter_dropout = True
    decoder.mhc_dropout_seed = None

    def draw(module, args, kwargs=None):
        fed = getattr(module, "mhc_dropout_seed_feed", None)
        if fed is not None:  # this microbatch's own (see the module docstring)
            module.mhc_dropout_seed = fed
            return
        seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64)
        if module.mhc_dropout_seed is None:
            module.mhc_dropout_seed = seed
        else:  # in place: a layer graph captured by Megatron's helper reads it where it lies
            module.mhc_dropout_seed.copy_(seed)

    decoder.register_forward_pre_hook(draw)
    decoder.draw_dropout_seed = lambda like: decoder.mhc_dropout_seed.to(like.device, copy=True)
    for layer in decoder.layers:
        layer.mhc_counter_dropout = True
        for k, hc in enumerate((layer.self_attention_hyper_connection,
                                layer.mlp_hyper_connection)):
            hc.fused_h_res_h_post_bda = _counter_bda(hc, decoder,
                                                     sublayer_stream(layer.layer_number, k))


def _counter_bda(hc, decoder, stream: int):
    dropout_free = hc.fused_h_res_h_post_bda  # Megatron's own, for p = 0 and evaluation

    def fused_h_res_h_post_bda(h_res: Tensor, original_residual: Tensor, h_post: Tensor,
                               layer_output_with_bias, dropout_prob: float, training: bool,
                               fused: bool, manager=None) -> Tensor:
        if dropout_prob == 0.0 or not training:
            return dropout_free(h_res, original_residual, h_post, layer_output_with_bias,
                                dropout_prob, training, fused, manager)
        x, bias = layer_output_with_bias
        # a copy: a recompute later in the step (pipelining) redraws this forward's mask
        seed = decoder.mhc_dropout_seed.to(x.device, copy=True)

        def post(h_res, residual, h_post, x, *bias):
            # Megatron's dropout path: H_res applied (dev: transposed), H_post y (+ H_post bias),
            # residual + dropout(...)
            mixed = hc.apply_h_res(h_res, residual)
            out = hc._apply_h_post(x, h_post)
            if bias:
                out = out + hc._apply_h_post(bias[0], h_post)
            return mixed + dropout(out, dropout_prob, True, impl="counter", seed=seed,
                                   stream=stream)

        args = (h_res, original_residual, h_post, x, *(() if bias is None else (bias,)))
        if manager is None:
            return post(*args)
        from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

        return CheckpointWithoutOutput(ckpt_manager=manager).checkpoint(post, *args)

    return fused_h_res_h_post_bda


class CounterEmbeddingDropout(torch.nn.Module):
    """The embedding's ``Dropout(p)`` with its mask from the seed given to ``decoder``
    (``mhc_dropout_seed_feed``) on stream :data:`EMBEDDING_STREAM`."""

    def __init__(self, p: float, decoder):
        super().__init__()
        self.p = p
        self._decoder = [decoder]  # not a submodule: the decoder is the model's already

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        fed = getattr(self._decoder[0], "mhc_dropout_seed_feed", None)
        if fed is None:
            raise RuntimeError("CounterEmbeddingDropout: no seed was given to the decoder "
                               "(decoder.mhc_dropout_seed_feed); give each microbatch's seed "
                               "before the forward")
        seed = fed.to(x.device, copy=True)
        return dropout(x, self.p, True, impl="counter", seed=seed, stream=EMBEDDING_STREAM)


def use_counter_embedding_dropout(model) -> None:
    """Counter dropout for ``model``'s embedding (a GPT chunk of the first pipeline stage; others
    have none): its mask from the seed given to its decoder (see the module docstring)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None or isinstance(embedding.embedding_dropout, CounterEmbeddingDropout):
        return
    embedding.embedding_dropout = CounterEmbeddingDropout(embedding.embedding_dropout.p,
                                                          model.decoder)
