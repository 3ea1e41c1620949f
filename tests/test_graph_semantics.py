"""Graph semantics every capture backend must keep, run on the ``tape`` (always) and on ``cuda``
(with a GPU): replay without Python, captured backward, replay order, refusal of what a graph
cannot hold, static addresses, and make_graphed_callables along a pipeline order.
"""

from __future__ import annotations

from mhc_cg.lab.emulation.backends import get_backend

import functools
import re

import pytest
import torch
import torch.nn.functional as F

from mhc_cg.graphs import (GraphOptions, GraphReplayError, count_allocated_static_inputs,
                           make_graphed_callables)
from mhc_cg.graphs.graphed_callables import order_layout
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.model import MHCTransformerLayer

from helpers import (LAYER_BATCH, LAYER_SEQ, CountingScale, capture_error, drive_pipeline,
                     iteration_data, layer_param_grads, planner_prediction, rank0_interleaved_order,
                     tiny_layers_config)

BACKENDS = ["tape", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return get_backend(request.param)


def device_of(backend) -> str:
    return backend.device


def test_replay_reruns_ops_without_python(backend):
    dev = device_of(backend)
    x = torch.randn(4, 3, device=dev)
    w = torch.randn(3, 5, device=dev)
    side_effects = []
    graph = backend.new_graph()
    with graph.capture():
        side_effects.append("ran")
        y = torch.relu(x @ w).sum(0) * 2.0
        y.add_(1.0)
    backend.synchronize()
    assert side_effects == ["ran"]
    for _ in range(2):
        x.copy_(torch.randn(4, 3, device=dev))
        graph.replay()
        backend.synchronize()
        assert torch.equal(y, torch.relu(x @ w).sum(0) * 2.0 + 1.0)
    assert side_effects == ["ran"], "Python in the captured body must not run at replay"
    assert graph.stats.violations == 0


def test_backward_captured_with_autograd_grad(backend):
    dev = device_of(backend)
    x = torch.randn(6, 4, device=dev)
    w = torch.randn(4, 4, device=dev, requires_grad=True)
    grad_out = torch.randn(6, 4, device=dev)
    pool = backend.new_pool()
    fwd, bwd = backend.new_graph(pool=pool), backend.new_graph(pool=pool)
    with fwd.capture():
        out = torch.tanh(x @ w) * torch.sigmoid(x)
    with bwd.capture():
        (grad_w,) = torch.autograd.grad(out, w, grad_out)
    for _ in range(2):
        x.copy_(torch.randn(6, 4, device=dev))
        grad_out.copy_(torch.randn(6, 4, device=dev))
        fwd.replay()
        bwd.replay()
        backend.synchronize()
        w_ref = w.detach().clone().requires_grad_()
        out_ref = torch.tanh(x @ w_ref) * torch.sigmoid(x)
        out_ref.backward(grad_out)
        assert torch.equal(out, out_ref)
        assert torch.equal(grad_w, w_ref.grad)


def test_replay_order_must_equal_capture_order(backend):
    dev = device_of(backend)
    x = torch.randn(3, device=dev)
    pool = backend.new_pool()
    first, second = backend.new_graph(pool=pool), backend.new_graph(pool=pool)
    with first.capture():
        a = x * 2
    with second.capture():
        a * 3
    first.replay()
    second.replay()
    first.replay()  # the cursor wrapped: a new iteration
    with pytest.raises(GraphReplayError, match="replay order differs from capture order"):
        first.replay()
    private = backend.new_graph()
    with private.capture():
        x + 1
    private.replay()
    private.replay()  # a private pool holds one graph: any order is its order


ILLEGAL_BODIES = {
    "item": (lambda x: x.sum().item(), "_local_scalar_dense"),
    "tolist": (lambda x: x.tolist(), "_local_scalar_dense|_to_copy|tolist"),
    "bool": (lambda x: bool(x[0] > 0), "_local_scalar_dense|is_nonzero"),
    "nonzero": (lambda x: torch.nonzero(x > 0), "nonzero"),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), "masked_select"),
    "unique": (lambda x: torch.unique(x), "unique"),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, (x > 0).long()), "repeat_interleave"),
    "rand": (lambda x: torch.rand(3, device=x.device), "aten.rand"),
    "bernoulli": (lambda x: torch.bernoulli(x.sigmoid()), "bernoulli"),
    "torch_dropout": (lambda x: F.dropout(x, 0.5, training=True), "dropout|bernoulli"),
}


@pytest.mark.parametrize("case", sorted(ILLEGAL_BODIES))
def test_illegal_op_rejected(backend, case):
    body, op_pattern = ILLEGAL_BODIES[case]
    x = torch.randn(8, device=backend.device)
    error = capture_error(backend, lambda: body(x))
    message = str(error)
    assert re.search(op_pattern, message), message
    where = f"{body.__code__.co_filename}:{body.__code__.co_firstlineno}"
    assert where in message, f"the error must point at the user's line {where}: {message}"
    if case in ("rand", "bernoulli", "torch_dropout"):
        assert "mhc_cg.ops.dropout" in message and "counter" in message


def test_storage_resize_of_input_rejected(backend):
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.untyped_storage().resize_(0)  # seed-000 style "free": invisible to a graph
        return y

    error = capture_error(backend, body)
    assert "resized" in str(error) and error.report.resized_storages


def test_resize_op_on_foreign_tensor_rejected(backend):
    x = torch.randn(16, device=backend.device)
    body = lambda: x.resize_(32)  # noqa: E731
    error = capture_error(backend, body)
    assert "aten.resize_" in str(error) and "did not allocate" in str(error)
    assert f"{body.__code__.co_filename}:{body.__code__.co_firstlineno}" in str(error)


def test_set_on_foreign_tensor_rejected(backend):
    x = torch.randn(16, device=backend.device)
    other = torch.randn(16, device=backend.device)
    error = capture_error(backend, lambda: x.set_(other.untyped_storage(), 0, (16,), (1,)))
    assert "aten.set_" in str(error) and "re-point" in str(error)


def test_data_assignment_rejected(backend):
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.data = torch.zeros(16, device=x.device)  # no op dispatches: caught by the address book
        return y + x

    error = capture_error(backend, body)
    assert "changed address" in str(error) or "re-pointed" in str(error)


def test_pipeline_matches_eager(backend):
    # exact on the tape; on a GPU cuBLAS and attention may pick another algorithm when captured
    same = torch.equal if backend.name == "tape" else functools.partial(torch.allclose, rtol=1e-5, atol=1e-6)
    backend_name, device = backend.name, backend.device
    """``same(actual, expected)``: ``torch.equal`` (bit-identical) unless a backend's kernels may
    legitimately differ between eager and captured runs (cuBLAS/attention algorithm choice)."""
    torch.manual_seed(0)
    cfg = tiny_layers_config()
    layers = [MHCTransformerLayer(cfg, i).to(device) for i in range(cfg.num_layers)]
    order = rank0_interleaved_order()
    layout = order_layout(order, 2, len(layers), 2 * 4 * 2)
    width = cfg.num_streams * cfg.hidden_size
    sample_args = [(torch.randn(LAYER_SEQ, LAYER_BATCH, width, device=device, requires_grad=True),
                    torch.zeros((), dtype=torch.int64, device=device))
                   for _ in range(len(layers) * layout.num_microbatches)]
    graphed = make_graphed_callables(tuple(layers), sample_args, _order=order,
                                     _reuse_graph_input_output_buffers=True,
                                     _num_layers_per_chunk=2,
                                     options=GraphOptions(backend=get_backend(backend_name)))
    assert len(graphed) == len(sample_args)
    assert all(g.stats.violations == 0 for g in graphed.graphs())
    assert count_allocated_static_inputs(graphed) == planner_prediction(order, [2, 2], True)
    assert count_allocated_static_inputs(graphed) < len(sample_args)

    def eager(chunk, mb, layer, x, seed):
        return layers[layout.callable_index(chunk, layer)](x, seed)

    def replayed(chunk, mb, layer, x, seed):
        return graphed[layout.sample_index(chunk, mb, layer)](x, seed)

    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second iteration replays graphs whose buffers hold the first one's data
        xs, seeds, grad_outs = [[t.to(device) for t in ts] for ts in
                                iteration_data(cfg, layout.num_microbatches, generator)]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        ref_out, ref_in_grads = drive_pipeline(order, layout, eager, xs, seeds, grad_outs)
        ref_param_grads = layer_param_grads(layers)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        out, in_grads = drive_pipeline(order, layout, replayed, xs, seeds, grad_outs)
        param_grads = layer_param_grads(layers)
        for mb in range(layout.num_microbatches):
            assert same(out[mb], ref_out[mb]), f"output of microbatch {mb}"
            assert same(in_grads[mb], ref_in_grads[mb]), f"input grad of microbatch {mb}"
        assert param_grads.keys() == ref_param_grads.keys()
        for name, grad in ref_param_grads.items():
            assert same(param_grads[name], grad), f"grad of {name}"
    # Dropout was on: two microbatches with different seeds see different masks.
    assert not torch.equal(out[0], out[1])


def test_module_stays_module_and_python_does_not_rerun(backend):
    backend_name, device = backend.name, backend.device
    module = CountingScale(5).to(device)
    sample = torch.randn(3, 5, device=device, requires_grad=True)
    graphed = make_graphed_callables(module, (sample,), num_warmup_iters=2,
                                     options=GraphOptions(backend=get_backend(backend_name)))
    assert graphed is module and isinstance(graphed, torch.nn.Module)
    calls_at_capture = module.calls
    assert calls_at_capture == 2 + 1  # warmup iterations, then the capture
    for _ in range(3):
        x = torch.randn(3, 5, device=device, requires_grad=True)
        out = module(x)
        out.backward(torch.ones_like(out))
        x_ref = x.detach().clone().requires_grad_()
        w_ref = module.weight.detach().clone().requires_grad_()
        ref = torch.tanh(x_ref * w_ref)
        ref.backward(torch.ones_like(ref))
        assert torch.equal(out, ref) and torch.equal(x.grad, x_ref.grad)
        assert torch.equal(module.weight.grad, w_ref.grad)
        module.weight.grad = None
    assert module.calls == calls_at_capture, "the module's Python ran at replay"
    module.eval()  # a mode the graph was not captured in: the eager forward runs
    module(torch.randn(3, 5, device=device))
    assert module.calls == calls_at_capture + 1
