"""What a CUDA graph cannot hold is refused at capture, by the tape too, with the op and the
user's source line: boolean-mask indexing, ``torch.tensor([...])``, ``.cpu()``; on CUDA also a
0-dim CPU tensor read by a device op (its value would be baked in at capture)."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.core.errors import GraphCaptureError
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.graphs.guard import illegal_op_reason

X = torch.arange(6.0) - 2.5  # three positive: more than one value selected
MASK = X > 0
VALUES = torch.ones(int(MASK.sum()))  # one value per selected element: not a masked fill

CASES = {
    "mask_read": (lambda: X[MASK], "aten.index.Tensor", "boolean mask"),
    "mask_write_values": (lambda: X.__setitem__(MASK, VALUES), "aten.index_put_",
                          "boolean mask"),
    "tensor_from_list": (lambda: torch.tensor([1.0, 2.0]), "aten.lift_fresh", "torch.tensor([...])"),
    "cpu": (lambda: X.cpu(), "Tensor.cpu()", "copies device memory to the host"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_at_capture_with_the_op_and_the_source_line(case):
    fn, op, reason = CASES[case]
    graph = get_backend("tape").new_graph()
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            fn()
    message = str(info.value)
    assert op in message and reason in message
    assert "test_capture_refusals.py" in message  # the user's line, not torch's


def test_what_stays_legal():
    graph = get_backend("tape").new_graph()
    y = torch.zeros(6)
    idx = torch.tensor([0, 2])
    with graph.capture():
        z = torch.where(MASK, X, y)  # the fixed-shape spelling of a masked write
        w = X[idx]  # integer indexing: fixed shape
        X2 = X.clone()
        X2[1] = 0.5  # a Python number is a wrapped scalar
        t = torch.tensor(2.0) * X  # a 0-dim constant made inside the capture
    graph.replay()
    assert torch.equal(z, torch.where(MASK, X, y)) and torch.equal(w, X[idx])
    assert X2[1] == 0.5 and torch.equal(t, 2.0 * X)


def test_a_masked_scalar_write_is_a_masked_fill_that_follows_the_mask_at_replay():
    """Note [x[mask] = scalar is a masked fill]: ``x[mask] = scalar`` (a Python number or a 0-dim
    host tensor, read at capture as ATen reads it) is recorded as ``masked_fill_`` and each
    replay fills where the mask is true then; the capture allocates nothing for it."""
    mask = torch.zeros(2, 6, dtype=torch.bool)
    x = torch.zeros(3, 2, 6)
    graph = get_backend("tape").new_graph()
    with graph.capture():
        x[:, mask] = 1.5
        x[0][mask] = torch.tensor(-2.0)
    for trial in range(3):
        x.zero_()
        mask.copy_(torch.rand(2, 6, generator=torch.Generator().manual_seed(trial)) > 0.5)
        graph.replay()
        want = torch.where(mask, 1.5, 0.0).expand(3, 2, 6).clone()
        want[0][mask] = -2.0
        assert torch.equal(x, want), trial


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_0_dim_cpu_tensor_in_a_device_op_is_refused():
    x = torch.randn(4, device="cuda")
    scale = torch.tensor(2.0)
    reason = illegal_op_reason(torch.ops.aten.mul.Tensor, (x, scale), {})
    assert reason is not None and "0-dim CPU tensor" in reason
    graph = get_backend("cuda").new_graph()
    with pytest.raises(GraphCaptureError, match="0-dim CPU tensor"):
        with graph.capture():
            x * scale
