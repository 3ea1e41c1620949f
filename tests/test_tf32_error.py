"""Note [TF32 products]: the kernels' tensor-core products, TF32 emulated in torch against fp64
(the interpreter multiplies in fp32 whatever the precision, so only an emulation shows it)."""

from __future__ import annotations

import torch

from mhc_cg.lab.benchmarks import tf32_error as te
def test_tf32_keeps_ten_mantissa_bits_and_bf16_whole():
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, -3.0 - 2.0 ** -12])
    assert te.tf32(x).tolist() == [1.0 + 2.0 ** -10, 1.0, -3.0]
    b = torch.randn(64).bfloat16().float()
    assert torch.equal(te.tf32(b), b)


def test_bf16_models_lose_less_to_tf32_than_storing_in_bf16_and_fp32_models_take_3x():
    """In a bf16 model each TF32 product's error stays under the rounding of its bf16 result (the
    tolerances of the bf16 kernel tests hold); an fp32 model's 3xTF32 is as close as the fp32
    FMA loop it replaces, where plain TF32 would be 1000 times off."""
    rows = te.table(tokens=256, hidden=256)
    by = {(r["op"], r["model"], r["precision"]): r["relative_error"] for r in rows}
    for (op, model, precision), error in by.items():
        if model == "bf16":
            assert precision == "tf32" and error < te.STORED["bf16"] / 2
    ieee = by[("projection x W^T", "fp32", "ieee")]
    for (op, model, precision), error in by.items():
        if precision == "tf32x3":
            assert error < 4 * ieee
    assert by[("projection x W^T", "fp32", "tf32")] > 100 * ieee
