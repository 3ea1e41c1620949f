"""Dropout whose mask is a pure function of (seed tensor, stream id, element index).

A replayed CUDA graph cannot rewind a stateful generator: a graph that captured ``torch.dropout``
draws the same Philox offsets on every replay, and a recompute graph cannot reproduce the mask the
forward graph drew. Here the mask is ``hash(seed, stream, index) >= p * 2**32`` built from integer
tensor ops only, so the forward, an eager recompute, a tape replay and a CUDA graph replay all
produce the same mask bit for bit, as long as they see the same ``seed`` tensor.

All arithmetic stays in int64 with every product below 2**63, so it is exact on CPU and CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _mul32_(x: Tensor, c: int) -> Tensor:
    """:func:`_mul32` in place: one temporary instead of four."""
    lo, hi = c & 0xFFFF, c >> 16
    t = x * hi
    t &= 0xFFFF
    t <<= 16
    x *= lo
    x += t
    x &= _MASK32
    return x


def _fmix32_(h: Tensor) -> Tensor:
    """:func:`_fmix32` in place (same values): at most one temporary alive beside ``h``."""
    h ^= h >> 16
    _mul32_(h, 0x85EBCA6B)
    h ^= h >> 13
    _mul32_(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def counter_uniform_bits(seed: Tensor, stream: int, numel: int, start: int = 0) -> Tensor:
    """Pseudo-random 32-bit integers (as int64) for ``(seed, stream)`` at element indices
    ``start .. start + numel - 1``.

    Below index 2**32 the index is its own low word and its high word is 0, so the hash runs in
    place on the index: two int64 tensors of ``numel`` alive at most, not the five or more the
    functional form keeps at its peak (at 8 bytes an element, that peak is what a graph's pool sees).
    """
    key = _fmix32((seed.to(torch.int64) + stream * _GOLDEN) & _MASK32)
    idx = torch.arange(start, start + numel, dtype=torch.int64, device=seed.device)
    if start + numel <= 2 ** 32:
        idx ^= key
        return _fmix32_(_fmix32_(idx))
    h = _fmix32((idx & _MASK32) ^ key)
    return _fmix32((h + (idx >> 32)) & _MASK32)


# Elements hashed at a time: bounds the int64 temporaries of a larger mask (2 x 64 MiB); more
# chunks cost more kernels, larger ones more pool memory at the peak of every mHC graph
MASK_CHUNK = 2 ** 23


def counter_dropout_mask(seed: Tensor, stream: int, shape: torch.Size, p: float,
                         dtype: torch.dtype) -> Tensor:
    """The scaled keep-mask ``keep / (1 - p)`` of ``shape``, in ``dtype``; hashed in chunks of
    :data:`MASK_CHUNK` elements, so a large mask never needs int64 temporaries of its full size."""
    threshold = min(int(round(p * 2 ** 32)), 2 ** 32)
    scale = 1.0 / (1.0 - p)
    numel = int(torch.Size(shape).numel())
    if numel <= MASK_CHUNK:
        keep = counter_uniform_bits(seed, stream, numel) >= threshold
        return (keep.to(dtype) * scale).view(shape)
    mask = torch.empty(numel, dtype=dtype, device=seed.device)
    for start in range(0, numel, MASK_CHUNK):
        count = min(MASK_CHUNK, numel - start)
        keep = counter_uniform_bits(seed, stream, count, start) >= threshold
        torch.mul(keep.to(dtype), scale, out=mask[start:start + count])
    return mask.view(shape)


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
    return x * counter_dropout_mask(seed, stream, x.shape, p, x.dtype)
