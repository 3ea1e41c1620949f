"""What a GPU run depends on, checked where it can be on the CPU (and on CUDA when present):
GC paused during capture, libraries warmed before any capture, the backend resolved from the
device, bf16 losses compared with a stated tolerance, peaks counting graph pools."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from helpers import tiny_run_config
from mhc_cg.lab.benchmarks import runner as bench
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.resolve import resolve


@pytest.mark.parametrize("enabled_before", [True, False])
def test_gc_is_paused_during_capture_and_restored(enabled_before):
    seen = []
    (gc.enable if enabled_before else gc.disable)()
    try:
        graph = get_backend("tape").new_graph()
        with graph.capture():
            seen.append(gc.isenabled())
            torch.ones(2) + 1
        assert seen == [False] and gc.isenabled() == enabled_before
        failing = get_backend("tape").new_graph()
        with pytest.raises(RuntimeError):
            with failing.capture():
                raise RuntimeError("boom")
        assert gc.isenabled() == enabled_before  # restored on failure too
    finally:
        gc.enable()


def test_backend_follows_the_device_not_the_machine(monkeypatch):
    """``--device cpu`` on a GPU machine must graph on the tape: a CUDA graph of CPU ops is empty
    and its replays would return stale outputs."""
    cfg = tiny_run_config()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    assert resolve(cfg, "graphed_static", "cpu").plan.api == "tape"
    assert resolve(cfg, "graphed_none", "cpu").plan.api == "tape"


def test_bench_loss_comparison_has_a_stated_tolerance_and_never_matches_nan():
    ref = [4.0, 3.0]
    assert bench.losses_match([4.0, 3.0], ref, 0.0)
    assert not bench.losses_match([4.0, 3.0001], ref, 0.0)
    assert bench.losses_match([4.0, 3.03], ref, bench.LOSS_RTOL["bf16"])
    assert not bench.losses_match([4.0, 3.2], ref, bench.LOSS_RTOL["bf16"])
    assert not bench.losses_match([float("nan")] * 2, [float("nan")] * 2, 0.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_backend_warms_cublas_before_the_first_capture():
    from mhc_cg.graphs import cuda as cuda_backend

    backend = get_backend("cuda")
    assert torch.cuda.current_device() in cuda_backend._LIBRARIES_WARM
    a = torch.randn(32, 32, device="cuda", dtype=torch.bfloat16)
    graph = backend.new_graph()
    with graph.capture():
        out = a @ a
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a @ a) or torch.allclose(out.float(), (a @ a).float(), rtol=1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_peak_reserved_counts_graph_pools():
    cfg = tiny_run_config(steps=2)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cuda"),
                              graph=dataclasses.replace(cfg.graph, backend="cuda"))
    opts = bench.BenchOptions(modes=("graphed_static",), steps=2, warmup=1, profile_steps=1,
                              recompute_replays=1)
    entry = bench.run_bench([("tiny", cfg)], torch.device("cuda"), opts)[0]["modes"]["graphed_static"]
    # the mode's own process: reserved holds every allocated byte, graph pools whole
    assert entry["peak_reserved_bytes"] >= entry["peak_allocated_bytes"] > 0
    assert entry["profile"]["device"] == "cuda" and entry["profile"]["phases"]["forward"]["gpu_ms"] > 0


def test_make_graphed_callables_without_a_backend_follows_the_inputs_device(monkeypatch):
    """No backend given: the inputs' device decides, not whether a GPU is present. CPU inputs
    are refused with the backend to give (a CUDA graph of them would record no kernel)."""
    from mhc_cg.graphs import GraphOptions, make_graphed_callables
    from mhc_cg.lab.emulation.backends import get_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    args = ((torch.randn(2, 3, requires_grad=True),),)
    with pytest.raises(ValueError, match=r"inputs off a GPU and no backend.*TapeBackend"):
        make_graphed_callables((torch.nn.Linear(3, 3),), args, num_warmup_iters=1,
                               options=GraphOptions())
    graphed = make_graphed_callables((torch.nn.Linear(3, 3),), args, num_warmup_iters=1,
                                     options=GraphOptions(backend=get_backend("tape")))
    assert graphed.backend == "tape"
