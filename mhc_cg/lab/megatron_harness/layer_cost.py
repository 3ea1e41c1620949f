"""Kernels and bytes of one step of Megatron-LM's own mHC layer, native ops against mhc_cg's fused
kernels: ``mhc-cg megatron --config F --layer-cost``.

One ``HyperConnectionTransformerLayer`` of the branch (its own spec and config, built on the CPU,
then moved to the ``meta`` device) runs a forward and a backward on a meta input of the shape
given (the config's, or ``configs/bench_h100.yaml``'s), once on Megatron's native mHC ops and once
through the fused step adapters. Every op is counted at dispatch by the cost model's
:class:`mhc_cg.lab.cost.op_counters.OpCounter`: kernels (an aten op one, a fused op the launches
its Triton kernels make, a view none) and the bytes each reads and writes once. Attention and the
MLP are the same in both runs, so the difference is the mHC work's.

What the count assumes: every native op a kernel of its own, as in eager mode, an upper bound for
a compiled run. Megatron's native mHC functions carry ``torch.compile`` (dev's Sinkhorn iterations
among them), which on a GPU fuses their elementwise chains into fewer kernels (Inductor's choice,
not counted here: the GPU check times dev's layer compiled). The attention is the CPU spec's, the
same in both runs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_cg.lab.cost.op_counters import OpCounter


class _Counting(TorchDispatchMode):
    def __init__(self, counter: OpCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counter.add(func, args, kwargs, out)
        return out


def _step(forward, x: torch.Tensor) -> OpCounter:
    counter = OpCounter()
    with _Counting(counter):
        out = forward(x)
        out.backward(torch.ones_like(out))
    return counter


def layer_cost(config, spec, seq: int, micro_batch: int, fused_steps) -> dict:
    """``{"native": {...}, "fused": {...}}``: kernels, bytes read and written, and the fused ops'
    calls of one forward and backward of the first layer ``spec`` builds under ``config``;
    ``fused_steps``: the branch's fused step adapters (``main_layer_steps(True)``, ...)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mhc_cg.model.sublayer import sublayer_forward

    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    layer = TransformerBlock(config, spec).layers[0].train()
    if config.bf16 or config.fp16:  # the parameters as training holds them (dev's mHC: fp32)
        Float16Module(config, layer)
    layer = layer.to("meta")
    n = getattr(config, "num_residual_streams", None) or config.mhc_num_residual_streams
    x = torch.empty(seq, micro_batch, n * config.hidden_size, device="meta",
                    dtype=config.params_dtype, requires_grad=True)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device="meta").triu(diagonal=1)

    def native(h):
        return layer(hidden_states=h, attention_mask=mask)[0]

    def fused(h):
        steps = fused_steps(layer, mask)
        return sublayer_forward(steps.mlp, sublayer_forward(steps.attention, h, None), None)

    result = {}
    for name, forward in (("native", native), ("fused", fused)):
        counter = _step(forward, x)
        result[name] = {"kernels": counter.kernels, "bytes_read": counter.bytes_read,
                        "bytes_written": counter.bytes_written, "ops": counter.ops,
                        "fused_op_kernels": sum(k for op, k in counter.by_op.items()
                                                if op.startswith("mhc_cg."))}
    result["shape"] = {"seq": seq, "micro_batch": micro_batch, "hidden": config.hidden_size,
                       "streams": n, "dtype": str(config.params_dtype).replace("torch.", "")}
    return result
