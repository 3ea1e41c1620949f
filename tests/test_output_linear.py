"""F's last Linear writing into a buffer its caller passes: the same bits as ``nn.Linear``,
forward and backward, and the buffer really holds the output (the static runtime then copies
nothing)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mhc_cg.core.storage import storage_id
from mhc_cg.ops.output_linear import OutputLinear


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
    out = named(xb, buffer)
    want = plain(xa)
    assert storage_id(out) == storage_id(buffer) and torch.equal(buffer, want)
    assert torch.equal(out, want)
    want.backward(g)
    out.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (name, p), q in zip(plain.named_parameters(), named.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_only_the_call_given_the_buffer_writes_it_and_one_that_does_not_fit_is_left_alone():
    _, named = _pair()
    x = torch.randn(5, 3, 24)
    buffer = torch.zeros(5, 3, 16)
    first, second = named(x, buffer), named(x)
    assert storage_id(first) == storage_id(buffer) and storage_id(second) != storage_id(buffer)
    wrong = torch.zeros(5, 3, 16, dtype=torch.float64)
    out = named(x, wrong)
    assert storage_id(out) != storage_id(wrong) and not wrong.any()
    assert torch.equal(named(x), out)  # no buffer: a plain Linear
