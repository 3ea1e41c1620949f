"""What only the ``cuda`` backend has to show (the shared semantics run on it in
tests/test_graph_semantics.py). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.graphs import GraphReplayError, get_backend, make_graphed_callables

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def backend():
    return get_backend("cuda")


def test_backend_is_cuda(backend):
    assert (backend.name, backend.device) == ("cuda", "cuda")


def test_graphed_callables_replay_order_on_cuda():
    layer = torch.nn.Linear(4, 4).cuda()
    layers = (layer, torch.nn.Linear(4, 4).cuda())
    samples = [(torch.randn(2, 4, device="cuda", requires_grad=True),) for _ in range(2)]
    _, second = make_graphed_callables(layers, samples, num_warmup_iters=1, backend="cuda")
    with pytest.raises(GraphReplayError, match="replay order differs"):
        second(torch.randn(2, 4, device="cuda"))
