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


def build_layer(config, spec, device) -> torch.nn.Module:
    """The first layer ``spec`` builds under ``config``, its parameters as training holds them
    (``Float16Module``'s cast: dev's mHC ones stay fp32), on ``device``."""
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlock

    torch.manual_seed(0)
    layer = TransformerBlock(config, spec).layers[0].train()
    if config.bf16 or config.fp16:
        Float16Module(config, layer)
    return layer.to(device)


class OneLayer:
    """A layer's step both ways on an input ``x`` of the shape given: ``native(layer, h)`` (its
    own forward) and ``fused(h)`` (through ``fused_steps``), causal mask, dropout as configured."""

    def __init__(self, config, layer, seq: int, micro_batch: int, fused_steps, make=torch.empty):
        self.layer, self.fused_steps = layer, fused_steps
        device = next(layer.parameters()).device
        self.n = getattr(config, "num_residual_streams", None) or config.mhc_num_residual_streams
        self.x = make(seq, micro_batch, self.n * config.hidden_size, device=device,
                      dtype=config.params_dtype, requires_grad=True)
        self.mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(diagonal=1)
        self.shape = {"seq": seq, "micro_batch": micro_batch, "hidden": config.hidden_size,
                      "streams": self.n, "dtype": str(config.params_dtype).replace("torch.", "")}

    def native(self, h: torch.Tensor, layer=None) -> torch.Tensor:
        return (layer or self.layer)(hidden_states=h, attention_mask=self.mask)[0]

    def fused(self, h: torch.Tensor) -> torch.Tensor:
        from mhc_cg.model.sublayer import sublayer_forward

        steps = self.fused_steps(self.layer, self.mask)
        return sublayer_forward(steps.mlp, sublayer_forward(steps.attention, h, None), None)


def layer_cost(config, spec, seq: int, micro_batch: int, fused_steps) -> dict:
    """``{"native": {...}, "fused": {...}}``: kernels, bytes read and written, and the fused ops'
    calls of one forward and backward of the first layer ``spec`` builds under ``config``;
    ``fused_steps``: the branch's fused step adapters (``main_layer_steps(True)``, ...)."""
    one = OneLayer(config, build_layer(config, spec, "meta"), seq, micro_batch, fused_steps)
    result = {}
    for name, forward in (("native", one.native), ("fused", one.fused)):
        counter = _step(forward, one.x)
        result[name] = {"kernels": counter.kernels, "bytes_read": counter.bytes_read,
                        "bytes_written": counter.bytes_written, "ops": counter.ops,
                        "fused_op_kernels": sum(k for op, k in counter.by_op.items()
                                                if op.startswith("mhc_cg."))}
    result["shape"] = one.shape
    return result
