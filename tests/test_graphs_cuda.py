"""The graph-semantics checks of tests/test_graphs_tape.py, on a GPU through the ``cuda`` backend.

Skipped without CUDA. The pipeline comparison is exact on the tape; here it allows last-bit
differences, because cuBLAS and the attention kernels may pick another algorithm (split-K,
atomics) when captured on a side stream than when run eagerly.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mhc_cg.graphs import GraphReplayError, get_backend, make_graphed_callables

from helpers import (ILLEGAL_BODIES, check_backward_captured_with_autograd_grad,
                     check_data_assignment_rejected, check_illegal_op_rejected,
                     check_module_stays_module_and_python_does_not_rerun,
                     check_pipeline_matches_eager, check_replay_order_must_equal_capture_order,
                     check_replay_reruns_ops_without_python,
                     check_resize_op_on_foreign_tensor_rejected,
                     check_set_on_foreign_tensor_rejected, check_storage_resize_of_input_rejected)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def backend():
    return get_backend("cuda")


def test_backend_is_cuda(backend):
    assert (backend.name, backend.device) == ("cuda", "cuda")


def test_replay_reruns_ops_without_python(backend):
    check_replay_reruns_ops_without_python(backend)


def test_backward_captured_with_autograd_grad(backend):
    check_backward_captured_with_autograd_grad(backend)


def test_replay_order_must_equal_capture_order(backend):
    check_replay_order_must_equal_capture_order(backend)


@pytest.mark.parametrize("case", sorted(ILLEGAL_BODIES))
def test_illegal_op_rejected(backend, case):
    check_illegal_op_rejected(backend, case)


def test_storage_resize_of_input_rejected(backend):
    check_storage_resize_of_input_rejected(backend)


def test_resize_op_on_foreign_tensor_rejected(backend):
    check_resize_op_on_foreign_tensor_rejected(backend)


def test_set_on_foreign_tensor_rejected(backend):
    check_set_on_foreign_tensor_rejected(backend)


def test_data_assignment_rejected(backend):
    check_data_assignment_rejected(backend)


def test_module_stays_module_and_python_does_not_rerun():
    check_module_stays_module_and_python_does_not_rerun("cuda", "cuda")


def test_pipeline_matches_eager():
    close = functools.partial(torch.allclose, rtol=1e-5, atol=1e-6)
    check_pipeline_matches_eager("cuda", "cuda", same=close)


def test_graphed_callables_replay_order_on_cuda():
    layer = torch.nn.Linear(4, 4).cuda()
    layers = (layer, torch.nn.Linear(4, 4).cuda())
    samples = [(torch.randn(2, 4, device="cuda", requires_grad=True),) for _ in range(2)]
    _, second = make_graphed_callables(layers, samples, num_warmup_iters=1, backend="cuda")
    with pytest.raises(GraphReplayError, match="replay order differs"):
        second(torch.randn(2, 4, device="cuda"))
