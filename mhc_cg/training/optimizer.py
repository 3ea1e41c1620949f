"""The optimizer step Megatron runs, from torch's parts: fp32 main parameters, fused AdamW.

:class:`MainParamAdamW` is the one optimizer of training, pipeline ranks, the bench and the cost
model (which records this object's step). What it holds, per parameter of the model's dtype
(bf16 or fp16; fp32 keeps no copy):

* the model's parameters, laid out in one contiguous buffer, each ``p.data`` a view of it
  (Megatron's DDP parameter buffer): the copy back after the step is one kernel;
* their gradients in one contiguous buffer of the model's dtype, each ``p.grad`` a view of it
  (torch DDP's ``gradient_as_bucket_view``); autograd accumulates into it in place;
* fp32 main parameters and AdamW's two fp32 moments, each one flat buffer: 14 B per bf16
  parameter with the 2 of its gradient, 16 in all;
* one fp32 staging bucket the gradients are cast into, bucket by bucket, before each bucket's
  fused AdamW kernel (or a buffer the caller lends: a graphed mode's arena, idle between steps).

Note [cast bucket by bucket]: Megatron's DDP keeps a persistent fp32 ``main_grad`` buffer (4 B per
parameter, held through the backward and the step); casting the model-dtype gradients bucket by
bucket holds 2 B per parameter plus one bucket, which is less at the step's peak (and in the
backward) whenever the bucket is under 2 B per parameter: 256 MiB against 1.0 GiB for the bench
model. Microbatch gradients therefore accumulate in the model's dtype, as autograd does.

Note [one host synchronisation]: :meth:`MainParamAdamW.step` reads nothing back. The norm, the
inf check (torch's ``_amp_foreach_non_finite_check_and_unscale_`` on the norm) and the skip of a
step with a non-finite gradient (fused AdamW's ``found_inf``, which also leaves the step count)
stay on the device; the caller reads the norm and the flag once per step, with the loss, and
hands the flag to :meth:`MainParamAdamW.update` (fp16's loss scale lives on the host).

Note [one step count]: every bucket is one call of ``torch._fused_adamw_``, the kernel
``torch.optim.AdamW(fused=True)`` launches, all with the one step tensor: the functional wrapper
would bump a count per call. AdamW is element-wise, so buckets cut anywhere, across parameters
too, and the result equals ``torch.optim.AdamW(fused=True)`` over per-parameter fp32 copies bit
for bit (``tests/test_optimizer.py``).

Note [no parameter-sized temporary]: on CUDA every pass is one kernel over a flat buffer: the
norm (``linalg.vector_norm`` upcasts bf16 in its kernel), each bucket's cast and update, the copy
back and the zeroing. CPU torch's ``vector_norm`` casts a bf16 input to fp32 first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

# The staging bucket: fewer, larger buckets launch fewer kernels (one cast and at least one
# AdamW launch each); a bucket over 2 B per parameter would hold more than an fp32 main_grad.
BUCKET_BYTES = 256 << 20
FP32 = torch.float32


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


@dataclass
class StepResult:
    """What a step leaves on the device: the unscaled gradient norm (fp32 scalar) and whether a
    gradient was not finite (1.0: the step was skipped, 0.0 otherwise; valid until the next
    step)."""

    grad_norm: Tensor
    found_inf: Tensor


def lay_out_flat(params: Sequence[nn.Parameter], dtype: torch.dtype,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """Move ``params`` into one contiguous buffer and give each a gradient view of another:
    ``(params buffer, grads buffer)``. The values do not change;
    the addresses do, so this runs before any graph captures the parameters."""
    spans, start = [], 0
    for p in params:
        spans.append((start, start + p.numel()))
        start += p.numel()
    flat = torch.empty(start, dtype=dtype, device=device)
    grads = torch.zeros(start, dtype=dtype, device=device)
    with torch.no_grad():
        for p, (a, b) in zip(params, spans):
            flat[a:b].copy_(p.detach().reshape(-1))
            p.data = flat[a:b].view_as(p)
            p.grad = grads[a:b].view_as(p)
    return flat, grads


class MainParamAdamW:
    """AdamW over fp32 main parameters for a model in ``model_dtype`` (see the module docstring).

    Construct it before anything captures the parameters (it moves them into one buffer). Use:
    ``backward(loss)`` per microbatch (scales an fp16 loss), ``step(workspace)`` once (returns
    a :class:`StepResult` on the device; the gradients are zero again afterwards), then
    ``update(found_inf)`` with the flag read back. ``reduce_norm``: sums a squared norm over
    ranks in place (pipeline ranks), so every rank gets the global norm and skips together.
    """

    def __init__(self, params, *, lr: float, weight_decay: float, model_dtype: torch.dtype,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 bucket_bytes: int = BUCKET_BYTES,
                 reduce_norm: Callable[[Tensor], None] | None = None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MainParamAdamW: no parameter requires a gradient")
        device = self.params[0].device
        wrong = [tuple(p.shape) for p in self.params if p.dtype != model_dtype or p.device != device]
        if wrong:
            raise ValueError(f"MainParamAdamW: every parameter must be {model_dtype} on {device}; "
                             f"these are not: {wrong[:3]}")
        if bucket_bytes < FP32.itemsize:
            raise ValueError(f"bucket_bytes must be >= {FP32.itemsize}, got {bucket_bytes}")
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, betas, eps
        self.device = device
        self.flat, self.grads = lay_out_flat(self.params, model_dtype, device)
        self.low_precision = model_dtype != FP32
        self.main = self.flat.to(FP32, copy=True) if self.low_precision else self.flat
        self.exp_avg = torch.zeros_like(self.main)
        self.exp_avg_sq = torch.zeros_like(self.main)
        self.step_count = torch.zeros((), dtype=FP32, device=device)
        self.found_inf = torch.zeros((), dtype=FP32, device=device)
        self.scaler = DynamicLossScaler() if model_dtype == torch.float16 else None
        # fused AdamW divides the gradients by this (fp16's loss scale), set before each step
        self.grad_scale = torch.ones((), dtype=FP32, device=device) if self.scaler else None
        self.unit = torch.ones((), dtype=FP32, device=device)
        self.bucket_elements = min(max(bucket_bytes // FP32.itemsize, 1), self.main.numel())
        self.staging: Tensor | None = None  # the own bucket, when nothing is lent
        self._reduce_norm = reduce_norm
        self.skipped_steps = 0

    # -- what it holds ---------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def state_tensors(self) -> list[Tensor]:
        """Every tensor the optimizer keeps between steps (parameters and gradients included)."""
        held = [self.flat, self.grads, self.exp_avg, self.exp_avg_sq, self.step_count,
                self.found_inf, self.unit]
        if self.low_precision:
            held.append(self.main)
        held += [t for t in (self.grad_scale, self.staging) if t is not None]
        return held

    def reserve_staging(self, workspace: Tensor | None = None) -> None:
        """Allocate the own staging bucket now unless ``workspace`` (what :meth:`step` will be
        lent) holds one; so that no step allocates it."""
        if self.low_precision and self._staging(workspace) is None and self.staging is None:
            self.staging = torch.empty(self.bucket_elements, dtype=FP32, device=self.device)

    def _staging(self, workspace: Tensor | None) -> Tensor | None:
        need = self.bucket_elements * FP32.itemsize
        if workspace is None or workspace.device != self.device or \
                workspace.numel() * workspace.element_size() < need:
            return None
        return workspace.reshape(-1).view(torch.uint8)[:need].view(FP32)

    # -- the step ----------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient (one kernel); they stay views of the gradient buffer, so
        ``set_to_none`` is accepted and ignored."""
        self.grads.zero_()

    def backward(self, loss: Tensor) -> None:
        (loss * self.loss_scale if self.scaler is not None else loss).backward()

    @torch.no_grad()
    def step(self, workspace: Tensor | None = None) -> StepResult:
        """One AdamW step over the accumulated gradients, which are zero afterwards; a
        non-finite gradient skips it on the device. ``workspace``: memory idle for the step's
        duration, used as the staging bucket when it holds one."""
        norm = torch.linalg.vector_norm(self.grads, 2, dtype=FP32)
        if self._reduce_norm is not None:
            norm = norm.square()
            self._reduce_norm(norm)
            norm = norm.sqrt()
        if self.scaler is not None:
            self.grad_scale.fill_(self.scaler.scale)
        # the norm of the scaled gradients, unscaled; a non-finite one sets found_inf
        self.found_inf.zero_()
        inv_scale = self.unit if self.scaler is None else self.grad_scale.reciprocal()
        torch._amp_foreach_non_finite_check_and_unscale_([norm.view(1)], self.found_inf, inv_scale)
        self.step_count.add_(1)
        staging = self._staging(workspace)
        if staging is None and self.low_precision:
            self.reserve_staging()
            staging = self.staging
        beta1, beta2 = self.betas
        for start in range(0, self.main.numel(), self.bucket_elements):
            end = min(start + self.bucket_elements, self.main.numel())
            if self.low_precision:
                grad = staging[:end - start]
                grad.copy_(self.grads[start:end])
            else:
                grad = self.grads[start:end]
            torch._fused_adamw_([self.main[start:end]], [grad], [self.exp_avg[start:end]],
                                [self.exp_avg_sq[start:end]], [], [self.step_count],
                                lr=self.lr, beta1=beta1, beta2=beta2,
                                weight_decay=self.weight_decay, eps=self.eps, amsgrad=False,
                                maximize=False, grad_scale=self.grad_scale,
                                found_inf=self.found_inf)
        self.step_count.sub_(self.found_inf)
        if self.low_precision:
            self.flat.copy_(self.main)  # in place: graphs keep reading these addresses
        self.grads.zero_()
        return StepResult(norm, self.found_inf)

    def finish(self, result: StepResult, *also: Tensor) -> tuple[float, bool, list[float]]:
        """The step's one host synchronisation: ``result``'s norm and flag read back with
        ``also`` (fp32 scalars, e.g. the loss), then :meth:`update`; returns ``(norm, skipped,
        also's values)``."""
        norm, found_inf, *values = torch.stack([result.grad_norm, result.found_inf, *also]).tolist()
        self.update(found_inf != 0)
        return norm, found_inf != 0, values

    def update(self, found_inf: bool) -> None:
        """After the caller read the step's flag: the loss scale follows it; a skip is counted."""
        if found_inf:
            self.skipped_steps += 1
        if self.scaler is not None:
            self.scaler.update(found_inf)
