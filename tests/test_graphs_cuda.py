"""What only the ``cuda`` backend has to show (the shared semantics run on it in
tests/test_graph_semantics.py). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.graphs import GraphOptions, GraphReplayError, make_graphed_callables
from mhc_cg.lab.emulation.backends import get_backend

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
    _, second = make_graphed_callables(layers, samples, num_warmup_iters=1,
                                       options=GraphOptions(backend=get_backend("cuda")))
    with pytest.raises(GraphReplayError, match="replay order differs"):
        second(torch.randn(2, 4, device="cuda"))


def test_a_released_output_frees_its_block_and_keeps_its_values(backend):
    """``release_outputs`` on CUDA: an alias over the same memory that does not keep it allocated,
    so the pool can hand the block to a later capture (which then overwrites it)."""
    pool = backend.new_pool()
    x = torch.randn(1 << 20, device="cuda")
    first, second = backend.new_graph(pool), backend.new_graph(pool)
    with first.capture():
        out = x * 2
    (alias,) = first.release_outputs([out])
    assert alias.data_ptr() == out.data_ptr() and alias.shape == out.shape
    first.replay()
    assert torch.equal(alias, x * 2)
    address = out.data_ptr()
    del out
    with second.capture():
        later = x + 1  # same size, same pool: the freed block is the first fit
    assert later.data_ptr() == address
    first.replay()
    second.replay()
    assert torch.equal(alias, x + 1)  # what the release contract warns about
