"""Mixed-precision optimisation as Megatron does it: fp32 main parameters, low-precision model.

With ``train.dtype`` bf16 or fp16 the model's parameters and activations are in that dtype, but
the optimizer never touches them directly: it keeps an fp32 *main* copy of every parameter and its
AdamW state in fp32, steps the main copy with the model's gradients cast to fp32, and copies the
result back into the model's parameters **in place** (graphs read the parameters at the addresses
they were captured with). AdamW on fp16 parameters would underflow its ``eps`` (1e-8 is 0 in fp16)
and divide by zero on the first step.

fp16 also scales the loss (:class:`DynamicLossScaler`, Megatron's ``DynamicGradScaler``): the
backward runs on ``loss * scale`` so small gradients do not flush to zero; the fp32 gradients are
unscaled before the step. A step whose gradients hold an inf or NaN is skipped (the parameters
stay, the scale shrinks); it is counted in ``skipped_steps``. With fp32 the optimizer is plain
AdamW on the model's parameters. AdamW is :class:`~mhc_cg.training.adamw.SlicedAdamW`: torch's,
with a slice of a parameter as its only temporary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from mhc_cg.training.adamw import SlicedAdamW


@dataclass
class DynamicLossScaler:
    """Megatron's dynamic loss scale: back off on overflow (after ``hysteresis`` overflows in a
    row), grow after ``growth_interval`` clean steps, never below ``min_scale``."""

    scale: float = 2.0 ** 16
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2

    def __post_init__(self):
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._clean_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor


class MixedPrecisionOptimizer:
    """AdamW over fp32 main parameters for a model in ``model_dtype`` (see the module docstring).

    ``workspace``: memory the step may borrow for its scratch (see :class:`SlicedAdamW`).
    Use: ``zero_grad()``; ``backward(loss)`` per microbatch; ``step()`` returns
    ``(grad_norm, skipped)``; the norm is that of the unscaled fp32 gradients.
    """

    def __init__(self, params, *, lr: float, weight_decay: float, model_dtype: torch.dtype,
                 workspace: Callable[[], Tensor | None] | None = None):
        self.model_params = [p for p in params if p.requires_grad]
        self.low_precision = model_dtype != torch.float32
        if self.low_precision:
            self.main_params = [nn.Parameter(p.detach().to(torch.float32).clone())
                                for p in self.model_params]
        else:
            self.main_params = self.model_params
        self.optimizer = SlicedAdamW(self.main_params, lr=lr, weight_decay=weight_decay,
                                     workspace=workspace)
        self.scaler = DynamicLossScaler() if model_dtype == torch.float16 else None
        self.skipped_steps = 0

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (always set to ``None``; the flag is torch's signature)."""
        for p in self.model_params:
            p.grad = None
        if self.low_precision:
            for p in self.main_params:
                p.grad = None

    def backward(self, loss: Tensor) -> None:
        (loss * self.loss_scale if self.scaler is not None else loss).backward()

    def step(self) -> tuple[float, bool]:
        if not self.low_precision:
            norm = torch.nn.utils.clip_grad_norm_(self.main_params, float("inf"))
            self.optimizer.step()
            return float(norm), False
        inv_scale = 1.0 / self.loss_scale
        for main, p in zip(self.main_params, self.model_params):
            if p.grad is None:
                main.grad = None
                continue
            main.grad = p.grad.detach().to(torch.float32)
            if self.scaler is not None:
                main.grad.mul_(inv_scale)
        grads = [m.grad for m in self.main_params if m.grad is not None]
        found_inf = bool(grads) and not bool(torch.stack(
            [torch.isfinite(g).all() for g in grads]).all())
        norm = torch.nn.utils.clip_grad_norm_(self.main_params, float("inf"))
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped_steps += 1
            return float(norm), True
        self.optimizer.step()
        with torch.no_grad():
            for main, p in zip(self.main_params, self.model_params):
                p.copy_(main)  # in place: captured graphs keep reading this address
        return float(norm), False
