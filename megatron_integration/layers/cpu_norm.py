"""An RMSNorm for megatron layers on the CPU that sequence parallelism accepts.

megatron-core's local norm (``WrappedTorchNorm``, what its local layer specs use without
TransformerEngine) refuses ``sequence_parallel``: under it each tensor-parallel rank normalises
its own slice of the sequence, so the norm's weight gradient is partial and must be summed over
the tensor-parallel ranks, which megatron does for parameters marked ``sequence_parallel``
(``finalize_model_grads``). TransformerEngine's norm marks its weight; ``SequenceParallelRMSNorm``
is ``torch.nn.RMSNorm`` (the same arithmetic as megatron's local one) with its weight marked the
same way. Layer specs use it on the CPU (``dev_mhc_layer_spec(cpu=True)``).
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
