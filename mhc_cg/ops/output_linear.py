"""F's last Linear, able to write its output straight into a buffer its caller passes.

The static runtime keeps each sublayer's F output in the persistent set (the block recompute reads
it there). Copying it in after F costs a read and a write of C per token and sublayer; instead the
runtime passes the slot down F's call (``F(x, out=slot)``) and F's last Linear
(:class:`OutputLinear`) computes into it with ``addmm(..., out=)``. Without a buffer, or one that
does not fit, it is a plain ``nn.Linear``.

Bit-identity with ``nn.Linear`` (training, the weight requiring grad): on a contiguous input
``F.linear`` is ``addmm`` on the flattened input; on another (attention's output, batch-major on a
GPU) it is ``matmul``, which folds the input into a contiguous 2-d copy and calls ``mm``, then
adds the bias in place. Autograd's backward of either computes ``g @ W``, ``g^T @ x2d`` and the
bias grad summed over every dim but the last; :class:`_LinearInto` makes exactly those calls.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mhc_cg.core.storage import alias

class _LinearInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
        out2d = out.view(-1, out.shape[-1])
        ctx.folded = bias is None or not x.is_contiguous()  # F.linear's matmul path
        x2d = x.reshape(-1, x.shape[-1])  # a copy where x is not contiguous, as matmul's fold
        if ctx.folded:
            torch.mm(x2d, weight.t(), out=out2d)
            if bias is not None:
                out.add_(bias)
        else:
            torch.addmm(bias, x2d, weight.t(), out=out2d)
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        # an alias, so that the output is this node's and not a view of the argument
        return alias(out)

    @staticmethod
    def backward(ctx, g: Tensor):
        x2d, weight = ctx.saved_tensors
        g2d = g.reshape(-1, g.shape[-1])
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        g_x = g2d.mm(weight).view(ctx.x_shape) if need_x else None
        g_w = g2d.t().mm(x2d) if need_w else None
        g_b = None
        if need_b and ctx.has_bias:  # autograd's sum to the bias's shape, over the grad it got
            summed = g if ctx.folded else g2d
            g_b = summed.sum(tuple(range(summed.dim() - 1)), keepdim=True).view(-1)
        return g_x, g_w, g_b, None


class OutputLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) that writes into ``out`` where it fits."""

    def forward(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if out is None or not _fits(out, x, self):
            return super().forward(x)
        return _LinearInto.apply(x, self.weight, self.bias, out)


def _fits(out: Tensor, x: Tensor, layer: nn.Linear) -> bool:
    # matmul's fold (mirrored above) is what it does when the weight needs a grad
    return (x.dim() == 3 and out.is_contiguous() and layer.weight.requires_grad
            and torch.is_grad_enabled() and tuple(out.shape) == (*x.shape[:-1], layer.out_features)
            and out.dtype == x.dtype == layer.weight.dtype and out.device == x.device)
