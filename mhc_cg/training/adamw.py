"""AdamW whose temporaries are bounded: torch's arithmetic, one slice of a parameter at a time.

``torch.optim.AdamW`` (``foreach=False``) makes two temporaries the size of the parameter it
updates (``sqrt(v)`` and its quotient); with ``foreach`` the temporaries of every parameter at
once. At the end of a step, with every gradient alive, those are the step's peak for a model with
a large embedding or output layer (two vocabulary-by-hidden tensors). :class:`SlicedAdamW` runs the
same element-wise operations, in the same order and with the same scalars, over slices of at most
``slice_bytes`` of each parameter and writes the denominator into one scratch slice: the
result is bit-identical (every operation is element-wise; a slice changes none of its inputs), the
bytes moved are the same, and the step's temporary is one slice, not two parameters.

A ``workspace`` (a callable giving a byte buffer, or None) lends memory the step may write its
scratch into instead of allocating: a graphed mode's static arena, idle between steps
(:meth:`~mhc_cg.runtime.modes.lifecycle.ModeModel.idle_workspace`). The slices are then as long
as the workspace holds, at least ``slice_bytes``: no temporary, and fewer launches.

Only what the training here uses: no amsgrad, no maximize, real parameters, the step count in a
CPU scalar as torch keeps it (so ``state_dict`` round-trips with ``torch.optim.AdamW``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# The step's only temporary: 64 MiB per slice. Smaller slices launch more kernels (a slice of a
# few MiB is all launch overhead on an H100); at hidden 2048 only the embedding and head are cut.
SLICE_BYTES = 64 << 20


class SlicedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` with every parameter updated
    in slices of at most ``slice_bytes`` (see the module docstring)."""

    def __init__(self, params, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2,
                 slice_bytes: int = SLICE_BYTES,
                 workspace: Callable[[], Tensor | None] | None = None):
        if slice_bytes < 1:
            raise ValueError(f"slice_bytes must be >= 1, got {slice_bytes}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=False)
        self.slice_bytes = slice_bytes
        self.workspace = workspace

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lent = self.workspace() if self.workspace is not None else None  # once: valid all step
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("SlicedAdamW takes dense real parameters only")
                self._update(p, group, lent)
        return loss

    def _state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:  # as torch makes it: the count on the CPU, the moments like the parameter
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _update(self, p: Tensor, group: dict, lent: Tensor | None) -> None:
        state = self._state(p)
        state["step"] += 1
        step = state["step"].item()
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        # the scalars exactly as torch's single-tensor AdamW computes them
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        params, grads = _flat(p), _flat(p.grad)
        exp_avgs, exp_avg_sqs = _flat(state["exp_avg"]), _flat(state["exp_avg_sq"])
        denom = self._scratch(p, params.numel(), lent)
        width = denom.numel()
        for start in range(0, params.numel(), width):
            s = slice(start, start + width)
            param, grad, exp_avg, exp_avg_sq = params[s], grads[s], exp_avgs[s], exp_avg_sqs[s]
            d = denom[:param.numel()]
            if wd != 0:
                param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            torch.sqrt(exp_avg_sq, out=d)
            d.div_(bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, d, value=-step_size)

    def _scratch(self, p: Tensor, numel: int, lent: Tensor | None) -> Tensor:
        """The denominator's slice: the lent workspace's bytes when they hold a whole slice, else
        a new tensor of one slice."""
        item = p.element_size()
        width = min(max(self.slice_bytes // item, 1), numel)
        if lent is not None and lent.device == p.device and lent.numel() >= width * item:
            return lent[:min(lent.numel() // item, numel) * item].view(p.dtype)
        return torch.empty(width, dtype=p.dtype, device=p.device)


def _flat(t: Tensor) -> Tensor:
    """``t`` as one dimension, without a copy: the update writes through it."""
    if not t.is_contiguous():
        raise RuntimeError(f"SlicedAdamW needs contiguous tensors, got strides {t.stride()}")
    return t.view(-1)
