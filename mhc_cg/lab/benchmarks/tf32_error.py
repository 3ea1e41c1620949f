"""The error of the fused kernels' tensor-core products against fp64, TF32 emulated in torch.

Triton's interpreter multiplies in fp32 whatever ``input_precision`` says, so the CPU tests never
see TF32's rounding. Here each product the kernels run with fp32 operands (Note [TF32 products]
in ``mhc_cg/ops/kernels/triton_kernels.py``) is computed in fp64 from operands rounded as the
tensor cores take them, and compared with the exact fp64 product of the unrounded operands:

* TF32: the sm_90a PTX feeds fp32 registers to ``mma``/``wgmma`` ``.tf32`` with no conversion
  (``mhc-cg kernels``' PTX has no ``cvt.rna.tf32``), so the low 13 mantissa bits are dropped:
  emulated by truncation, the worse of the two roundings;
* 3xTF32: each operand split into a TF32 head and a TF32 tail, three products (head x head,
  head x tail, tail x head), as Triton's ``tf32x3``;
* bf16 operands are exact in TF32 (8-bit mantissa), so in a bf16 model only the fp32 operand
  (an fp32 mapping weight, the projection's gradient) is rounded;
* ``ieee``: the fp32 FMA loop the tensor cores replace (torch's fp32 matmul: fp32 sums too),
  for scale.

Each row: the largest error over the largest magnitude of the exact result, beside the rounding
that storing the result costs anyway (bf16: 2^-9; fp32: 2^-24). ``python -m
mhc_cg.lab.benchmarks.tf32_error`` prints the table docs/kernels.md carries.
"""

from __future__ import annotations

import argparse

import torch

FP64 = torch.float64
STORED = {"bf16": 2.0 ** -9, "fp32": 2.0 ** -24}  # half an ulp of the stored result


def tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the tensor cores read an fp32 register in TF32: the low 13 mantissa bits gone."""
    bits = t.to(torch.float32).contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def product(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` in fp64 from operands as ``precision`` ("ieee", "tf32", "tf32x3") takes them."""
    if precision == "ieee":  # the fp32 FMA loop these replace: fp32 products and sums
        return (a.float() @ b.float()).to(FP64)
    a_hi, b_hi = tf32(a), tf32(b)
    out = a_hi.to(FP64) @ b_hi.to(FP64)
    if precision == "tf32x3":
        a_lo, b_lo = tf32(a.float() - a_hi), tf32(b.float() - b_hi)
        out = out + a_hi.to(FP64) @ b_lo.to(FP64) + a_lo.to(FP64) @ b_hi.to(FP64)
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor, precision: str) -> float:
    exact = a.to(FP64) @ b.to(FP64)
    return ((product(a, b, precision) - exact).abs().max() / exact.abs().max()).item()


def table(tokens: int = 1024, hidden: int = 2048, n: int = 4, seed: int = 0) -> list[dict]:
    """One row per product and model dtype (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    m, width = n * n + 2 * n, n * hidden

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    x32, g_proj = randn(tokens, width), randn(tokens, m, scale=1e-3)
    w32 = randn(m, width, scale=width ** -0.5)
    x16, w16 = x32.to(torch.bfloat16), w32.to(torch.bfloat16)
    rows = []

    def row(op, model, weight, precision, a, b):
        rows.append({"op": op, "model": model, "weight": weight, "precision": precision,
                     "relative_error": relative_error(a, b, precision),
                     "stored_rounding": STORED[model]})

    for precision in ("tf32", "tf32x3"):
        model = "bf16" if precision == "tf32" else "fp32"
        x = x16 if model == "bf16" else x32
        row("projection x W^T", model, "fp32", precision, x, w32.t())
        row("x's gradient g_proj W", model, model, precision, g_proj,
            (w16 if model == "bf16" else w32))
        row("weight's gradient g_proj^T x", model, model, precision, g_proj.t(), x)
    row("projection x W^T", "fp32", "fp32", "tf32", x32, w32.t())  # why fp32 models take 3x
    row("projection x W^T", "fp32", "fp32", "ieee", x32, w32.t())  # the FMA loop it replaces
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| product | model | mapping weight | precision | error / max result | "
             "storing the result costs |", "|---|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['model']} | {r['weight']} | {r['precision']} | "
                     f"{r['relative_error']:.2e} | {r['stored_rounding']:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.lab.benchmarks.tf32_error",
                                     description="the kernels' tensor-core products against "
                                                 "fp64, TF32 emulated")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args(argv)
    print(markdown(table(args.tokens, args.hidden)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
