"""The counter hash behind every dropout mask: ``bits = counter_hash(seed, stream, index)``.

One function body, written only with ``+ * ^ & >>`` on 32-bit signed integers and int32 literals,
serves both torch (int32 tensors, the CPU reference and ``mhc_cg.ops.dropout``) and Triton (jitted from
this very source in ``mhc_cg.ops.kernels.triton_kernels``). Both wrap multiplication and addition
modulo 2**32 and shift right arithmetically; every right shift is masked, which turns it into the
logical shift of MurmurHash3, so the two produce the same bits for every input.

``seed`` is the int32 view of the microbatch's seed tensor (seeds are drawn below 2**31),
``stream`` the dropout call site (unique per sublayer within a microbatch), ``index`` the element's
flat index (int32: a mask covers fewer than 2**31 elements). A mask element is kept when the top
24 bits, ``keep_bits(h)``, reach ``keep_threshold(p)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_ELEMENTS = 2 ** 31 - 1


def counter_hash(seed, stream, index):
    """MurmurHash3's finaliser of ``index ^ fmix(seed * golden + stream)`` (all int32, wrapping)."""
    key = seed * -1640531527 + stream  # 0x9E3779B9 as int32
    key = key ^ ((key >> 16) & 0xFFFF)
    key = key * -2048144789  # 0x85EBCA6B
    key = key ^ ((key >> 13) & 0x7FFFF)
    key = key * -1028477387  # 0xC2B2AE35
    key = key ^ ((key >> 16) & 0xFFFF)
    h = index ^ key
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * -2048144789
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * -1028477387
    h = h ^ ((h >> 16) & 0xFFFF)
    return h


def keep_bits(h):
    """The top 24 bits of ``h`` as a non-negative int32, uniform over ``[0, 2**24)``."""
    return (h >> 8) & 0xFFFFFF


def keep_threshold(p: float) -> int:
    """Elements with ``keep_bits >= keep_threshold(p)`` are kept: a drop rate of p to 2**-24."""
    return min(int(round(p * 2 ** 24)), 2 ** 24)


def keep_scale(p: float) -> float:
    """``1 / (1 - p)``, the scale of kept elements, as a Python float (applied in fp32)."""
    return 1.0 / (1.0 - p)


def seed32(seed: Tensor) -> Tensor:
    """The seed tensor's value as an int32 scalar tensor on its device (no host sync)."""
    return seed.reshape(()).to(torch.int32)


def counter_bits(seed: Tensor, stream: int, numel: int) -> Tensor:
    """``counter_hash`` of indices ``0 .. numel-1``: int32, on ``seed``'s device."""
    if numel > MAX_ELEMENTS:
        raise ValueError(f"counter dropout: a mask covers at most {MAX_ELEMENTS} elements, got {numel}")
    index = torch.arange(numel, dtype=torch.int32, device=seed.device)
    return counter_hash(seed32(seed), stream, index)


def counter_keep(seed: Tensor, stream: int, numel: int, p: float) -> Tensor:
    """The boolean keep-mask of ``numel`` elements for drop rate ``p``."""
    return keep_bits(counter_bits(seed, stream, numel)) >= keep_threshold(p)
