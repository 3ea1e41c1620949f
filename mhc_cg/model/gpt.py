"""A tiny GPT whose residual stream is widened n-fold by mHC (or, with ``model.residual: plain``,
the same GPT on a plain residual: the baseline mHC's overhead is measured against).

``MHCGPT(input_ids [b, s]) -> logits [b, s, vocab]``: embed, expand to n streams, then per layer an
attention and an MLP sublayer (:mod:`mhc_cg.model.sublayer`: mHC around F), contract the streams,
final norm, head; :func:`lm_loss` is the training loss. The model runs its layers plainly; recompute (eager block recompute, static
buffers, graphs) is the runtime's (:mod:`mhc_cg.runtime`), chosen by the training mode, which
calls ``embed``, ``run_layers`` or the layers themselves, and ``logits``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from mhc_cg.config import MHCGPTConfig
from mhc_cg.model import delayed_pre
from mhc_cg.model.delayed_pre import DelayedPreSublayer, DelayedStreams
from mhc_cg.model.layers import MLP, CausalSelfAttention, RMSNorm
from mhc_cg.model.moe import MoEMLP
from mhc_cg.model.sublayer import MHCSublayer, PlainSublayer, run_chain
from mhc_cg.ops import kernels as fused
from mhc_cg.ops.hyper_connection import contract_streams, expand_streams
from mhc_cg.ops.output_linear import OutputLinear


def lm_loss(logits: Tensor, targets: Tensor, kernels: str = "auto", *,
            grad_over_logits: bool = False) -> Tensor:
    """The mean token cross entropy of ``logits [b, s, vocab]`` against ``targets [b, s]``, in
    fp32 without an fp32 copy of the logits; ``grad_over_logits``: their gradient is written
    over them, for logits the loss alone reads (:func:`mhc_cg.ops.kernels.cross_entropy`)."""
    return fused.cross_entropy(logits, targets, kernels, grad_over_logits=grad_over_logits)


def microbatch_loss(logits: Tensor, targets: Tensor, kernels: str, num_microbatches: int) -> Tensor:
    """One microbatch's share of a training step's loss: :func:`lm_loss` over logits it alone
    reads (their gradient goes where they lie), over the step's ``num_microbatches``."""
    return lm_loss(logits, targets, kernels, grad_over_logits=True) / num_microbatches


class MHCTransformerLayer(nn.Module):
    """``eager_recompute``: how an eager forward recomputes an MLP's gelu where the config asks
    for it (:class:`~mhc_cg.model.layers.MLP`); ``None``: the activation is kept there."""

    def __init__(self, cfg: MHCGPTConfig, layer_number: int,
                 eager_recompute: Callable | None = None):
        super().__init__()
        self.layer_number = layer_number
        sublayer = (PlainSublayer if cfg.residual == "plain" else
                    DelayedPreSublayer if cfg.arithmetic == "v41" else MHCSublayer)
        # the dropout stream: the sublayer's number in the model, unique within a microbatch
        self.attention = sublayer(cfg, CausalSelfAttention(cfg), 2 * layer_number)
        mlp = MoEMLP(cfg) if cfg.is_moe else MLP(
            cfg, recompute_activation=cfg.recompute_activation_of(layer_number),
            eager_recompute=eager_recompute)
        self.mlp = sublayer(cfg, mlp, 2 * layer_number + 1)

    @property
    def stream_sublayers(self) -> tuple:
        """``(k, sublayer)`` in stream order (:class:`mhc_cg.runtime.chunk.ChunkLayout`)."""
        return ((0, self.attention), (1, self.mlp))

    def forward(self, x: Tensor, seed: Tensor | None = None) -> Tensor:
        return run_chain([self.attention, self.mlp], x, seed)


class MHCGPT(nn.Module):
    """``model(input_ids [b, s]) -> logits [b, s, vocab]``; ``eager_recompute``: how an eager
    forward recomputes the gelu of the MLPs that ask for it (:class:`MHCTransformerLayer`)."""

    def __init__(self, cfg: MHCGPTConfig, eager_recompute: Callable | None = None):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.layers = nn.ModuleList(MHCTransformerLayer(cfg, i, eager_recompute)
                                    for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        # nn.Linear's parameters and bits; a mode may pass where it writes the logits
        self.head = OutputLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    def sublayers(self) -> list[MHCSublayer]:
        """Every sublayer, in the order the stream runs through them."""
        return [sub for layer in self.layers for sub in (layer.attention, layer.mlp)]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def new_dropout_seed(self, device: torch.device | str | None = None) -> Tensor:
        """One int64 seed per microbatch, drawn from torch's generator (the only stateful draw)."""
        return torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64).to(device or "cpu")

    @property
    def delayed_pre(self) -> bool:
        """The layers hand on :class:`~mhc_cg.model.delayed_pre.DelayedStreams` (``v41``)."""
        return self.cfg.residual != "plain" and self.cfg.arithmetic == "v41"

    def embed(self, input_ids: Tensor, out: Tensor | None = None,
              grad_into: Tensor | None = None) -> Tensor | DelayedStreams:
        """``[b, s] -> [s, b, n*C]``, written into ``out`` when given; the backward writes the
        embeddings' ``[s, b, C]`` gradient into ``grad_into`` when given (see
        :func:`expand_streams`). With the delayed pre, the streams and the entry's pre-mix."""
        if input_ids.dim() != 2:
            raise ValueError(f"MHCGPT: expected input_ids of shape [b, s], got {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if s > self.cfg.seq_length:
            raise ValueError(f"MHCGPT: sequence length {s} exceeds seq_length={self.cfg.seq_length}")
        pos = torch.arange(s, device=input_ids.device)
        h = (self.embedding(input_ids) + self.position(pos)).transpose(0, 1)
        if self.cfg.residual == "plain":  # one stream, nothing to expand
            return h
        streams = expand_streams(h, self.cfg.num_streams, out, grad_into)
        return delayed_pre.entry(streams, self.cfg.num_streams) if self.delayed_pre else streams

    def run_layers(self, x: Tensor | DelayedStreams, seed: Tensor | None) -> Tensor:
        """Every sublayer in stream order, each post handing the next pre its state."""
        return run_chain(self.sublayers(), x, seed)

    def logits(self, x: Tensor | DelayedStreams, grad_into: Tensor | None = None,
               out: Tensor | None = None) -> Tensor:
        """``[s, b, n*C] -> [b, s, vocab]``; the backward writes x's gradient into ``grad_into``
        when given; the head writes the logits (``[s, b, vocab]``) into ``out`` when given. With
        the delayed pre the last site's pre-mix folds the streams (``grad_into`` is not taken)."""
        if self.delayed_pre:
            x = delayed_pre.fold(x, self.cfg.num_streams)
        elif self.cfg.residual != "plain":
            x = contract_streams(x, self.cfg.num_streams, grad_into)
        h = self.final_norm(x)
        return self.head(h, out).transpose(0, 1)

    def dropout_seed_for(self, input_ids: Tensor, dropout_seed: Tensor | None) -> Tensor | None:
        """``dropout_seed``, or a new one when a training forward with dropout was given none."""
        if dropout_seed is None and self.training and self.cfg.hidden_dropout > 0:
            return self.new_dropout_seed(input_ids.device)
        return dropout_seed

    def forward(self, input_ids: Tensor, dropout_seed: Tensor | None = None) -> Tensor:
        seed = self.dropout_seed_for(input_ids, dropout_seed)
        return self.logits(self.run_layers(self.embed(input_ids), seed))
