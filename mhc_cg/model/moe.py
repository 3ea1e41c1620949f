"""megatron-core's MoE partial-capture types, imported once and quietly.

``MoECudaGraphPartialCaptureSignal`` ends a MoE layer's graph capture early (after the router, or
after the dispatcher's preprocess); ``MoECudaGraphTensorStore`` carries the replayed graph's outputs
into the eager remainder. We use megatron-core's own classes, not look-alikes, so that code which
catches Megatron's signal catches ours. Importing megatron.core warns about TE and Apex on machines
without them; those warnings say nothing about this use and are silenced here.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
        MoECudaGraphPartialCaptureSignal,
        MoECudaGraphTensorStore,
    )

__all__ = ["MoECudaGraphPartialCaptureSignal", "MoECudaGraphTensorStore"]
