"""F's last Linear writing into a named buffer: the same bits as ``nn.Linear``, forward and
backward, and the buffer really holds the output (the static runtime then copies nothing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mhc_cg.core.storage import storage_id
from mhc_cg.ops.output_linear import OutputLinear, output_into


def _pair(bias: bool = True):
    torch.manual_seed(0)
    plain = nn.Linear(24, 16, bias=bias)
    named = OutputLinear(24, 16, bias=bias)
    named.load_state_dict(plain.state_dict())
    return plain, named


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "batch-major"])
def test_writes_into_the_named_buffer_with_nn_linears_bits_forward_and_backward(bias, layout):
    """Contiguous (F.linear's addmm) and batch-major as attention's output is on a GPU
    (F.linear's matmul + add)."""
    plain, named = _pair(bias)
    x = torch.randn(5, 3, 24) if layout == "contiguous" else \
        torch.randn(3, 5, 24).transpose(0, 1)
    xa = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    xb = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    assert xb.is_contiguous() == (layout == "contiguous")
    g = torch.randn(5, 3, 16)
    buffer = torch.full((5, 3, 16), float("nan"))
    with output_into(buffer):
        out = named(xb)
    want = plain(xa)
    assert storage_id(out) == storage_id(buffer) and torch.equal(buffer, want)
    assert torch.equal(out, want)
    want.backward(g)
    out.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(plain.named_parameters(), named.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_one_call_only_and_a_buffer_that_does_not_fit_is_left_alone():
    _, named = _pair()
    x = torch.randn(5, 3, 24)
    buffer = torch.zeros(5, 3, 16)
    with output_into(buffer):
        first, second = named(x), named(x)
    assert storage_id(first) == storage_id(buffer) and storage_id(second) != storage_id(buffer)
    wrong = torch.zeros(5, 3, 16, dtype=torch.float64)
    with output_into(wrong):
        out = named(x)
    assert storage_id(out) != storage_id(wrong) and not wrong.any()
    assert torch.equal(named(x), out)  # outside the context: a plain Linear
