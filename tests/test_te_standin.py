"""mhc_cg's ``make_graphed_callables`` as TransformerEngine's drop-in, beside TE's own from its
wheel: the same signature, the same hooks at the same moments, FP8 refused; and the
``transformer_engine`` tree megatron's helper imports on a CPU (``te_on_tape``) hands it TE's own
function. The tree's modules are loaded by path under private names, so no
``transformer_engine`` enters this process (tests/test_megatron_helper.py runs megatron's helper
over it in a child process)."""

from __future__ import annotations

from mhc_cg.lab.emulation.backends import get_backend

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from mhc_cg.graphs import GraphOptions, graph_capturing, make_graphed_callables
from mhc_cg.lab.emulation.backends import graph_api

TREE = Path(__file__).resolve().parents[1] / "mhc_cg" / "lab" / "megatron_harness" / "te_on_tape" / \
    "transformer_engine"


def _layers():
    torch.manual_seed(0)
    return (torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)),
            torch.nn.Linear(4, 4))


def test_ours_takes_exactly_tes_arguments():
    """Every parameter of TE 2.20.2's function, by name, kind and default; ours adds one
    keyword-only argument, ``options``."""
    tes = inspect.signature(graph_api("te").function).parameters
    ours = dict(inspect.signature(make_graphed_callables).parameters)
    assert ours.pop("options").kind is inspect.Parameter.KEYWORD_ONLY
    assert list(ours) == list(tes)
    assert [(p.kind, p.default) for p in ours.values()] == [(p.kind, p.default) for p in tes.values()]


@pytest.mark.parametrize("which", ["ours", "te"])
def test_hooks_run_as_te_runs_them(which):
    """``pre_warmup_hook`` and ``post_warmup_hook`` once around the warm-ups; each capture-time
    hook once per warm-up iteration and once at capture, never inside a capture, around its own
    callable's forward and backward; a hook that returns a value raises."""
    layers = _layers()
    api = graph_api("te" if which == "te" else "tape")
    calls: list[tuple] = []

    def hook(name, index):
        def run(module):
            assert module is layers[index] and not graph_capturing()
            calls.append((name, index))
        return run

    names = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    hooks = [{name: {"h": hook(name, i)} for name in names} for i in range(2)]
    samples = [(torch.randn(3, 4, requires_grad=True),) for _ in layers]
    api.make_graphed_callables(layers, samples, num_warmup_iters=2, capture_time_hooks=hooks,
                               pre_warmup_hook=lambda: calls.append(("pre", None)),
                               post_warmup_hook=lambda: calls.append(("post", None)))
    assert calls[0] == ("pre", None) and calls.count(("pre", None)) == 1
    post = calls.index(("post", None))
    assert calls.count(("post", None)) == 1
    for name in names:
        for i in range(2):
            assert calls[:post].count((name, i)) == 2 and calls[post:].count((name, i)) == 1
    # around its own pass: forward_pre before forward, backward_pre before backward, per callable
    captured = calls[post + 1:]
    for i in range(2):
        assert captured.index(("forward_pre_hooks", i)) < captured.index(("forward_hooks", i)) \
            < captured.index(("backward_pre_hooks", i)) < captured.index(("backward_hooks", i))
    bad = [{"backward_pre_hooks": {"h": lambda module: 1}}, None]
    with pytest.raises(RuntimeError, match="must not return a value"):
        api.make_graphed_callables(_layers(), samples, num_warmup_iters=1, capture_time_hooks=bad)


@pytest.mark.parametrize("fp8", [dict(fp8_enabled=True), dict(enabled=(False, True)),
                                 dict(fp8_calibrating=True), dict(cache_quantized_params=True)])
def test_fp8_is_refused_by_ours(fp8):
    with pytest.raises(NotImplementedError, match="FP8"):
        make_graphed_callables(_layers(), [(torch.randn(3, 4),)] * 2,
                               options=GraphOptions(backend=get_backend("tape")), **fp8)


def _tree_module(relative: str, name: str):
    spec = importlib.util.spec_from_file_location(name, TREE / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tree_megatron_imports_hands_it_tes_own_function():
    """``transformer_engine.pytorch.graph.make_graphed_callables`` there is the wheel's, and it
    replays on the tape bit for bit like eager; the version megatron reads is the wheel's."""
    graph = _tree_module("pytorch/graph.py", "te_tree_graph")
    package = _tree_module("__init__.py", "te_tree_package")
    assert graph.make_graphed_callables.__code__.co_filename.endswith(
        ".whl/transformer_engine/pytorch/graph.py")
    assert package.__version__ == "2.20.2" and package.STANDIN
    layers = _layers()
    samples = [(torch.randn(3, 4, requires_grad=True),) for _ in layers]
    graphed = graph.make_graphed_callables(
        layers, samples, num_warmup_iters=1, allow_unused_input=True, _order=[1, -1],
        _num_layers_per_chunk=[2], _reuse_graph_input_output_buffers=True, enabled=False)
    x = torch.randn(3, 4, requires_grad=True)
    graphed[1](graphed[0](x)).square().sum().backward()
    grads = [p.grad.clone() for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.zero_grad()
    x_eager = x.detach().requires_grad_()
    layers[1](layers[0](x_eager)).square().sum().backward()
    assert torch.equal(x.grad, x_eager.grad)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, (p for l in layers for p in l.parameters())))
