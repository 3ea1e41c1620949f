"""Dropout whose mask is a pure function of (seed tensor, stream id, element index).

Note [dropout from the seed] (docs/design.md, item 8). A replayed CUDA graph cannot rewind a
stateful generator: a graph that captured ``torch.dropout``
draws the same Philox offsets on every replay, and a recompute graph cannot reproduce the mask the
forward graph drew. Here an element is kept when the top 24 bits of ``hash(seed, stream, index)``
reach ``p * 2**24``, built from integer tensor ops only, so the forward, an eager recompute, a tape
replay and a CUDA graph replay all produce the same mask bit for bit, as long as they see the same
``seed`` tensor.

The hash is ``mhc_cg.ops.kernels.hash.counter_hash``, 32-bit integer arithmetic that the fused Triton
bias-dropout-add kernel computes from the same source: this module's masks and the kernel's agree
bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhc_cg.ops.kernels.hash import counter_keep, keep_scale


def counter_dropout_mask(seed: Tensor, stream: int, shape: torch.Size, p: float,
                         dtype: torch.dtype) -> Tensor:
    """The scaled keep-mask ``keep / (1 - p)`` of ``shape``, in ``dtype`` (scaled in fp32)."""
    keep = counter_keep(seed, stream, int(torch.Size(shape).numel()), p)
    return (keep.to(torch.float32) * keep_scale(p)).to(dtype).view(shape)


def dropout(x: Tensor, p: float, training: bool, *, impl: str = "counter",
            seed: Tensor | None = None, stream: int = 0) -> Tensor:
    """Dropout with either the counter-based mask or torch's stateful generator.

    ``impl="counter"`` needs ``seed`` (an int64 scalar tensor; keep it at a static address when
    graphs replay it) and a ``stream`` id unique per call site within one microbatch.
    """
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if impl == "torch":
        return torch.nn.functional.dropout(x, p, training=True)
    if impl != "counter":
        raise ValueError(f"dropout impl must be 'counter' or 'torch', got {impl!r}")
    if seed is None:
        raise ValueError("counter dropout needs a seed tensor (one int64 scalar per microbatch)")
    mask = counter_dropout_mask(seed, stream, x.shape, p, torch.float32)
    return (x * mask).to(x.dtype)


def draws_from_generator(impl: str, p: float) -> bool:
    """Dropout ``impl`` at ``p`` draws its mask from torch's stateful generator."""
    return impl == "torch" and p > 0


def stateful_dropout_problem(dropout_impl: str, dropout: float, impl_field: str | None,
                             dropout_field: str, also: str = "") -> str | None:
    """The one rule of dropout under recompute into static slots (or a replayed graph): a mask
    drawn from torch's stateful generator cannot be redrawn, so the recompute would draw another
    mask and the gradients would be wrong. ``impl_field`` is ``None`` where the layer has no
    counter dropout to switch to (Megatron-LM main's)."""
    if not draws_from_generator(dropout_impl, dropout):
        return None
    fix = (f"set {impl_field}: counter (mask = hash(seed, index), the same on every replay), or "
           f"{dropout_field}: 0" if impl_field else f"set {dropout_field}: 0")
    what = (f"{impl_field}: 'torch' draws the mask" if impl_field
            else f"{dropout_field}: {dropout} draws its mask")
    return (f"{what} from the stateful generator, which a recompute into static slots (or a "
            f"replayed graph) cannot rewind, so the recompute would draw another mask; "
            f"{fix}{', ' + also if also else ''}")
