"""Toy copy kernels for the in-flight estimate's negative control (compiled by
tests/test_kernel_compile.py in a child process): ``sip`` has each thread load one bf16 element
(2 bytes) from one-warp blocks, ``gulp`` 32 of them (64 bytes) from four-warp blocks."""

import torch
import triton
import triton.language as tl

from mhc_cg.lab.benchmarks.kernel_compile import STREAM_LOADS, Case, tile


@triton.jit
def _copy(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i))


def copy(x: torch.Tensor, block: int, warps: int) -> torch.Tensor:
    out = torch.empty_like(x)
    _copy[(x.numel() // block,)](x, out, BLOCK=block, num_warps=warps)
    return out


STREAM_LOADS["_copy"] = lambda b: [(*tile("x", b, "x_ptr", "BLOCK"), False)]

CASES = (
    Case("sip", lambda k, s: copy(s.t(1 << 22), 32, 1)),
    Case("gulp", lambda k, s: copy(s.t(1 << 22), 4096, 4)),
)
