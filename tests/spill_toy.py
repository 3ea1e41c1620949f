"""Toy kernels for the spill detector's negative control (compiled by tests/test_kernel_compile.py
in a child process): one holds 16384 fp32 values in a single warp across a reduction, 512 per
thread, far beyond 255 registers; the other holds 1024."""

import torch
import triton
import triton.language as tl

from mhc_cg.lab.benchmarks.kernel_compile import Case


@triton.jit
def _minus_max(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    tl.store(out_ptr + i, x - tl.max(x, axis=0))  # x stays live across the reduction


def minus_max(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _minus_max[(1,)](x, out, BLOCK=x.numel(), num_warps=1)
    return out


CASES = (
    Case("hungry", lambda k, s: minus_max(s.t(16384, dtype=torch.float32))),
    Case("modest", lambda k, s: minus_max(s.t(1024, dtype=torch.float32))),
)
