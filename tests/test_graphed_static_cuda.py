"""tests/test_graphed_static.py's training checks on a GPU through the ``cuda`` backend.

CUDA kernels may pick other algorithms inside a capture than eagerly, so values are compared
with a tolerance here; addresses, capture safety and the recompute path are checked exactly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch


from helpers import build_for_mode

from helpers import SCOPE_CASES, assert_training_close, small_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_config(case):
    scopes, experts = SCOPE_CASES[case]
    cfg = small_config(scopes, experts)
    cfg.train = dataclasses.replace(cfg.train, device="cuda")
    cfg.graph = dataclasses.replace(cfg.graph, backend="cuda")
    return cfg


@pytest.mark.parametrize("case", list(SCOPE_CASES))
def test_five_steps_match_eager_without_recompute_on_cuda(case):
    assert_training_close(cuda_config(case), "graphed_static", 5)


def test_static_addresses_and_capture_safety_on_cuda():
    cfg = cuda_config("attn_mlp")
    graphed = build_for_mode(cfg, "graphed_static", torch.device("cuda"))
    model, forward = graphed.model, graphed
    rt = graphed.runtime
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def step():
        optimizer.zero_grad(set_to_none=True)
        for _ in range(2):
            ids = torch.randint(0, 32, (4, 16), generator=g).cuda()
            seed = torch.randint(0, 2 ** 31 - 1, (), generator=g).cuda()
            torch.nn.functional.cross_entropy(forward(ids, seed).flatten(0, 1).float(),
                                              ids.flatten()).backward()
        optimizer.step()

    step()
    step()
    torch.cuda.synchronize()
    ptrs, before = rt.arena.data_ptrs(), torch.cuda.memory_allocated()
    for _ in range(48):
        step()
    torch.cuda.synchronize()
    assert rt.arena.data_ptrs() == ptrs
    assert torch.cuda.memory_allocated() <= before  # nothing outlives a step
    assert all(r.violations == 0 for r in (g.stats for g in graphed.graphs()))
    assert all(line.endswith("(graph)") for line in rt.trace)
