"""An RMSNorm for megatron layers on the CPU that sequence parallelism accepts.

megatron-core's local norm (``WrappedTorchNorm``, what its local layer specs use without
TransformerEngine) refuses ``sequence_parallel``: under it each tensor-parallel rank normalises
its own slice of the sequence, so the norm's weight gradient is partial and must be summed over
the tensor-parallel ranks, which megatron does for parameters marked ``sequence_parallel``
(``finalize_model_grads``). TransformerEngine's norm marks its weight; ``SequenceParallelRMSNorm``
is ``torch.nn.RMSNorm`` (the same arithmetic as megatron's local one) with its weight marked the
same way. Layer specs use it on the CPU (``dev_mhc_layer_spec(cpu=True)``,
``get_mhc_layer_spec(cpu_attention=True)``), and :func:`block_spec_on_cpu` as a decoder's final
norm.
"""

from __future__ import annotations

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built as megatron builds a norm, its weight marked ``sequence_parallel``
    when the config is."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm: normalization={config.normalization!r}; "
                             f"set normalization='RMSNorm'")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def block_spec_on_cpu(layer_spec, config, vp_stage: int | None):
    """A decoder spec of one model chunk: ``layer_spec`` for each of its layers and
    ``SequenceParallelRMSNorm`` as the final norm (megatron's default on the CPU is its local
    norm, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers,
                                      layer_norm=SequenceParallelRMSNorm)
