"""The test-only TransformerEngine stand-in (``mhc_cg/megatron_harness/te_on_tape``): TE's ``make_graphed_callables``
mapped onto mhc_cg's on the tape, and FP8 refused. Its module is loaded by path under a private
name, so no ``transformer_engine`` enters this process (tests/test_megatron_helper.py runs it
under megatron's helper in a child process)."""

import importlib.util
from pathlib import Path

import pytest
import torch

GRAPH = Path(__file__).resolve().parents[1] / "mhc_cg" / "megatron_harness" / "te_on_tape" / "transformer_engine" / "pytorch" / "graph.py"


@pytest.fixture(scope="module")
def te_graph():
    spec = importlib.util.spec_from_file_location("te_standin_graph", GRAPH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layers():
    torch.manual_seed(0)
    return (torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)),
            torch.nn.Linear(4, 4))


def test_make_graphed_callables_takes_tes_arguments_and_replays_on_the_tape(te_graph):
    layers = _layers()
    samples = [(torch.randn(3, 4, requires_grad=True),) for _ in layers]
    graphed = te_graph.make_graphed_callables(
        layers, samples, num_warmup_iters=1, allow_unused_input=True, _order=[1, -1],
        _num_layers_per_chunk=[2], _reuse_graph_input_output_buffers=True, fp8_enabled=False)
    x = torch.randn(3, 4, requires_grad=True)
    out = graphed[1](graphed[0](x))
    out.square().sum().backward()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad()
    x_eager = x.detach().requires_grad_()
    layers[1](layers[0](x_eager)).square().sum().backward()
    assert torch.equal(x.grad, x_eager.grad)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, (p for l in layers for p in l.parameters())))
    states = [g.state for g in graphed]
    assert {r.fwd_graph.pool.kind for r in states} == {"tape"}
    assert [(r.fwd_graph.replays, r.bwd_graph.replays) for r in states] == [(1, 1), (1, 1)]


@pytest.mark.parametrize("fp8", [dict(fp8_enabled=True), dict(fp8_enabled=(False, True)),
                                 dict(fp8_calibrating=True), dict(fp8_weight_caching=True)])
def test_fp8_is_refused(te_graph, fp8):
    layers = _layers()
    with pytest.raises(NotImplementedError, match="no FP8.*TransformerEngine on a GPU"):
        te_graph.make_graphed_callables(layers, [(torch.randn(3, 4),)] * 2, **fp8)


def test_what_the_tape_cannot_stand_in_for_is_refused_by_name(te_graph):
    layers = _layers()
    samples = [(torch.randn(3, 4),)] * 2
    with pytest.raises(NotImplementedError, match="pre_warmup_hook"):
        te_graph.make_graphed_callables(layers, samples, pre_warmup_hook=lambda: None)
    with pytest.raises(NotImplementedError, match="retain_graph"):
        te_graph.make_graphed_callables(layers, samples, retain_graph_in_backward=True)
    with pytest.raises(NotImplementedError, match="FP8"):
        te_graph.save_fp8_tensors([], None)
