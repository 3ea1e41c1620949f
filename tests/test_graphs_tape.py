"""Graph semantics on the CPU through the ``tape`` backend.

The same checks run on a GPU through ``cuda`` in tests/test_graphs_cuda.py, which imports the
backend-independent ones from here (they take the backend as a fixture).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from mhc_cg.graphs import GraphCaptureError, GraphReplayError, get_backend


@pytest.fixture
def backend():
    return get_backend("tape")


def _device(backend) -> str:
    return backend.device


# ---------------------------------------------------------------------------------------------
# The low-level primitive.

def test_auto_picks_tape_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("auto picks cuda or te on a GPU machine")
    backend = get_backend("auto")
    assert (backend.name, backend.device) == ("tape", "cpu")


def test_unknown_backend_name_is_rejected():
    with pytest.raises(ValueError, match="graph backend must be one of"):
        get_backend("xla")


def check_replay_reruns_ops_without_python(backend):
    dev = _device(backend)
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


def test_replay_reruns_ops_without_python(backend):
    check_replay_reruns_ops_without_python(backend)


def check_backward_captured_with_autograd_grad(backend):
    dev = _device(backend)
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


def test_backward_captured_with_autograd_grad(backend):
    check_backward_captured_with_autograd_grad(backend)


def check_replay_order_must_equal_capture_order(backend):
    dev = _device(backend)
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


def test_replay_order_must_equal_capture_order(backend):
    check_replay_order_must_equal_capture_order(backend)


def test_a_graph_is_captured_once_and_replayed_only_after_capture(backend):
    graph = backend.new_graph()
    with pytest.raises(GraphReplayError, match="never|new"):
        graph.replay()
    with graph.capture():
        torch.ones(2) * 2
    with pytest.raises(GraphCaptureError, match="capture\\(\\) called on a graph that is captured"):
        with graph.capture():
            pass


def test_in_place_metadata_change_keeps_earlier_ops_on_old_shape(backend):
    x = torch.randn(2, 3)
    graph = backend.new_graph()
    with graph.capture():
        y = x * 2          # uses y's shape [2, 3]
        z = y.sum(0)
        y.t_()             # metadata mutation of a graph-owned tensor
        w = y + 1          # uses [3, 2]
    x.copy_(torch.randn(2, 3))
    graph.replay()
    assert torch.equal(z, (x * 2).sum(0))
    assert torch.equal(w, (x * 2).t() + 1)


# ---------------------------------------------------------------------------------------------
# Graph-illegal code is rejected at capture, naming the op and the user's line.

def _capture_error(backend, body) -> GraphCaptureError:
    graph = backend.new_graph()
    with pytest.raises(GraphCaptureError) as info:
        with graph.capture():
            body()
    return info.value


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


def check_illegal_op_rejected(backend, case):
    body, op_pattern = ILLEGAL_BODIES[case]
    x = torch.randn(8, device=backend.device)
    error = _capture_error(backend, lambda: body(x))
    message = str(error)
    assert re.search(op_pattern, message), message
    assert "test_graphs_tape.py:" in message, "the error must point at the user's line"
    if case in ("rand", "bernoulli", "torch_dropout"):
        assert "mhc_cg.dropout" in message and "counter" in message


@pytest.mark.parametrize("case", sorted(ILLEGAL_BODIES))
def test_illegal_op_rejected(backend, case):
    check_illegal_op_rejected(backend, case)


def test_fixed_size_variants_of_data_dependent_ops_are_allowed(backend):
    x = torch.randn(4)
    repeats = torch.tensor([1, 2, 0, 1])
    graph = backend.new_graph()
    with graph.capture():
        by_int = torch.repeat_interleave(x, 2)
        by_tensor = torch.repeat_interleave(x, repeats, output_size=4)
    x.copy_(torch.randn(4))
    graph.replay()
    assert torch.equal(by_int, torch.repeat_interleave(x, 2))
    assert torch.equal(by_tensor, torch.repeat_interleave(x, repeats))


def check_storage_resize_of_input_rejected(backend):
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.untyped_storage().resize_(0)  # seed-000 style "free": invisible to a graph
        return y

    error = _capture_error(backend, body)
    assert "resized" in str(error) and error.report.resized_storages


def test_freeing_a_graph_tensor_during_capture_rejected(backend):
    """Eager block recompute's discard (``untyped_storage().resize_(0)`` of a checkpointed output) in a graph."""
    x = torch.randn(16)

    def body():
        y = x * 2
        y.untyped_storage().resize_(0)

    error = _capture_error(backend, body)
    assert "resized or re-pointed during capture" in str(error)
    assert len(error.report.resized_storages) == 1


def test_storage_resize_of_input_rejected(backend):
    check_storage_resize_of_input_rejected(backend)


def check_resize_op_on_foreign_tensor_rejected(backend):
    x = torch.randn(16, device=backend.device)
    error = _capture_error(backend, lambda: x.resize_(32))
    assert "aten.resize_" in str(error) and "did not allocate" in str(error)
    assert "test_graphs_tape.py" in str(error)


def test_resize_op_on_foreign_tensor_rejected(backend):
    check_resize_op_on_foreign_tensor_rejected(backend)


def check_set_on_foreign_tensor_rejected(backend):
    x = torch.randn(16, device=backend.device)
    other = torch.randn(16, device=backend.device)
    error = _capture_error(backend, lambda: x.set_(other.untyped_storage(), 0, (16,), (1,)))
    assert "aten.set_" in str(error) and "re-point" in str(error)


def test_set_on_foreign_tensor_rejected(backend):
    check_set_on_foreign_tensor_rejected(backend)


def check_data_assignment_rejected(backend):
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.data = torch.zeros(16, device=x.device)  # no op dispatches: caught by the address book
        return y + x

    error = _capture_error(backend, body)
    assert "changed address" in str(error) or "re-pointed" in str(error)


def test_data_assignment_rejected(backend):
    check_data_assignment_rejected(backend)


def test_set_on_graph_owned_tensor_is_allowed(backend):
    """The arena's writer alias: a fresh tensor re-pointed at a slot, inside a capture."""
    slot = torch.zeros(4)
    x = torch.randn(4)
    graph = backend.new_graph()
    with graph.capture():
        writer = torch.empty(0).set_(slot.untyped_storage(), 0, (4,), (1,))
        writer.copy_(x * 3)
    x.copy_(torch.randn(4))
    graph.replay()
    assert torch.equal(slot, x * 3)
    assert graph.stats.violations == 0


def test_freeing_an_input_after_capture_is_caught_at_replay(backend):
    x = torch.randn(16)
    graph = backend.new_graph()
    with graph.capture():
        x * 2
    x.untyped_storage().resize_(0)
    with pytest.raises(GraphReplayError, match="resized or freed since capture"):
        graph.replay()


# ---------------------------------------------------------------------------------------------
# make_graphed_callables over a real pipeline order, on a small mHC layer with counter dropout.

from mhc_cg.graphs import count_allocated_static_inputs, make_graphed_callables  # noqa: E402
from mhc_cg.graphs.graphed_callables import order_layout  # noqa: E402
from mhc_cg.model import MHCGPTConfig, MHCTransformerLayer  # noqa: E402

SEQ, BATCH = 8, 2


def _tiny_config() -> MHCGPTConfig:
    return MHCGPTConfig(vocab_size=32, seq_length=SEQ, hidden_size=16, num_heads=2, num_layers=4,
                        num_streams=4, hidden_dropout=0.25, dropout_impl="counter",
                        sinkhorn_iterations=4)


def _rank0_interleaved_order() -> list[int]:
    """Rank 0 of pp=2 with 2 virtual chunks and 4 microbatches."""
    try:
        from mhc_cg.pipeline.schedule import pipeline_order
    except ImportError:  # hand-written equivalent, for a checkout without the schedule module
        return [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]
    return pipeline_order(2, 0, 4, vpp_size=2)


def expected_static_input_sets(order: list[int], layers_per_chunk: list[int], reuse: bool) -> int:
    """Independent walk: a forward takes a released buffer set per layer if one is free, else a
    new one; a chunk's backward releases one set per layer of that chunk."""
    free = allocated = 0
    for code in order:
        layers = layers_per_chunk[abs(code) - 1]
        if code < 0:
            free += layers if reuse else 0
            continue
        for _ in range(layers):
            if free:
                free -= 1
            else:
                allocated += 1
    return allocated


def planner_prediction(order: list[int], layers_per_chunk: list[int], reuse: bool) -> int:
    """The schedule planner's figure, which must agree with the independent walk."""
    walked = expected_static_input_sets(order, layers_per_chunk, reuse)
    try:
        from mhc_cg.pipeline.planner import count_static_input_buffers
    except ImportError:  # a checkout without the planner
        return walked
    planned = count_static_input_buffers(order, layers_per_chunk, reuse)
    assert planned == walked
    return planned


def drive_pipeline(order, layout, call, xs, seeds, grad_outs):
    """Run ``order`` on one rank: chunk c+1 takes chunk c's output as a received (detached) input.

    ``call(chunk, microbatch, layer, x, seed)`` runs one layer. Returns the last chunk's outputs
    and the first chunk's input grads, per microbatch.
    """
    last = layout.num_chunks - 1
    received, sent = {}, {}
    for is_forward, chunk, mb in layout.passes():
        if is_forward:
            source = xs[mb] if chunk == 0 else sent[(chunk - 1, mb)]
            x = source.detach().requires_grad_()
            h = x
            for layer in range(layout.layers_per_chunk[chunk]):
                h = call(chunk, mb, layer, h, seeds[mb])
            received[(chunk, mb)], sent[(chunk, mb)] = x, h
        else:
            grad = grad_outs[mb] if chunk == last else received[(chunk + 1, mb)].grad
            torch.autograd.backward(sent[(chunk, mb)], grad)
    outputs = [sent[(last, mb)].detach().clone() for mb in range(len(xs))]
    input_grads = [received[(0, mb)].grad.clone() for mb in range(len(xs))]
    return outputs, input_grads


def _iteration_data(cfg, num_microbatches, generator):
    width = cfg.num_streams * cfg.hidden_size
    xs = [torch.randn(SEQ, BATCH, width, generator=generator) for _ in range(num_microbatches)]
    seeds = [torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64, generator=generator)
             for _ in range(num_microbatches)]
    grad_outs = [torch.randn(SEQ, BATCH, width, generator=generator) for _ in range(num_microbatches)]
    return xs, seeds, grad_outs


def _param_grads(layers):
    return {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(layers)
            for n, p in layer.named_parameters()}


def check_pipeline_matches_eager(backend_name: str, device: str, same=torch.equal):
    """``same(actual, expected)``: ``torch.equal`` (bit-identical) unless a backend's kernels may
    legitimately differ between eager and captured runs (cuBLAS/attention algorithm choice)."""
    torch.manual_seed(0)
    cfg = _tiny_config()
    layers = [MHCTransformerLayer(cfg, i).to(device) for i in range(cfg.num_layers)]
    order = _rank0_interleaved_order()
    layout = order_layout(order, 2, len(layers), 2 * 4 * 2)
    width = cfg.num_streams * cfg.hidden_size
    sample_args = [(torch.randn(SEQ, BATCH, width, device=device, requires_grad=True),
                    torch.zeros((), dtype=torch.int64, device=device))
                   for _ in range(len(layers) * layout.num_microbatches)]
    graphed = make_graphed_callables(tuple(layers), sample_args, order=order, num_layers_per_chunk=2,
                                     backend=backend_name)
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
                                _iteration_data(cfg, layout.num_microbatches, generator)]
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        ref_out, ref_in_grads = drive_pipeline(order, layout, eager, xs, seeds, grad_outs)
        ref_param_grads = _param_grads(layers)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        out, in_grads = drive_pipeline(order, layout, replayed, xs, seeds, grad_outs)
        param_grads = _param_grads(layers)
        for mb in range(layout.num_microbatches):
            assert same(out[mb], ref_out[mb]), f"output of microbatch {mb}"
            assert same(in_grads[mb], ref_in_grads[mb]), f"input grad of microbatch {mb}"
        assert param_grads.keys() == ref_param_grads.keys()
        for name, grad in ref_param_grads.items():
            assert same(param_grads[name], grad), f"grad of {name}"
    # Dropout was on: two microbatches with different seeds see different masks.
    assert not torch.equal(out[0], out[1])


def test_pipeline_bit_identical_to_eager():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only contend on a busy CI machine
    try:
        check_pipeline_matches_eager("tape", "cpu")
    finally:
        torch.set_num_threads(threads)


class _CountingScale(torch.nn.Module):
    """``x * weight``, counting its Python calls (a side effect a replay must not repeat)."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x * self.weight)


def check_module_stays_module_and_python_does_not_rerun(backend_name: str, device: str):
    module = _CountingScale(5).to(device)
    sample = torch.randn(3, 5, device=device, requires_grad=True)
    graphed = make_graphed_callables(module, (sample,), num_warmup_iters=2, backend=backend_name)
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


def test_module_stays_module_and_python_does_not_rerun():
    check_module_stays_module_and_python_does_not_rerun("tape", "cpu")


def test_static_inputs_without_reuse_one_set_per_sample():
    layers = tuple(_CountingScale(4) for _ in range(2))
    order = [1, 1, 2, -2, 2, -1, -2, -1]  # pp-style: 2 chunks x 2 microbatches, 1 layer each
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    graphed = make_graphed_callables(layers, samples, order=order, reuse_input_buffers=False,
                                     num_warmup_iters=1, backend="tape")
    assert count_allocated_static_inputs(graphed) == 4 == planner_prediction(order, [1, 1], False)
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    graphed = make_graphed_callables(layers, samples, order=order, num_warmup_iters=1, backend="tape")
    assert count_allocated_static_inputs(graphed) == planner_prediction(order, [1, 1], True) == 3


def test_graphed_callables_must_replay_in_capture_order():
    layers = tuple(_CountingScale(4) for _ in range(2))
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(2)]
    first, second = make_graphed_callables(layers, samples, num_warmup_iters=1, backend="tape")
    with pytest.raises(GraphReplayError, match="replay order differs from capture order"):
        second(torch.randn(2, 4))  # captured order: forward 1, forward 2, backward 2, backward 1


@pytest.mark.parametrize("order, match", [
    ([1, -1, 2], "not a multiple"),
    ([-1, 1], "backward of chunk 1 microbatch 0 before its forward"),
    ([1, 1, -1, -1], "one entry per \\(chunk, microbatch, layer\\)"),
    ([1, 0, -1, -1], "non-zero"),
])
def test_invalid_order_is_rejected(order, match):
    layer = _CountingScale(4)
    with pytest.raises(ValueError, match=match):
        make_graphed_callables((layer,), [(torch.randn(2, 4),)], order=order, backend="tape")


def test_module_hooks_are_rejected():
    layer = _CountingScale(4)
    layer.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks run once at capture and never at replay"):
        make_graphed_callables((layer,), [(torch.randn(2, 4),)], backend="tape")


def test_non_tensor_sample_args_are_rejected():
    with pytest.raises(TypeError, match="only tensors"):
        make_graphed_callables((_CountingScale(4),), [(torch.randn(2, 4), 3)], backend="tape")


def test_wrong_input_shape_at_call_is_rejected():
    graphed = make_graphed_callables(_CountingScale(4), (torch.randn(2, 4),), num_warmup_iters=1,
                                     backend="tape")
    with pytest.raises(ValueError, match="captured with \\[2, 4\\]"):
        graphed(torch.randn(3, 4))


def test_te_backend_without_te_says_so():
    from mhc_cg.graphs.backend import te_available
    if te_available() and torch.cuda.is_available():
        pytest.skip("TransformerEngine is installed")
    with pytest.raises(RuntimeError, match="(TransformerEngine|CUDA device)"):
        get_backend("te")


def test_gradients_accumulate_over_microbatches_replaying_one_graph():
    """Without an order one graph serves every microbatch; ``.grad`` must sum them all."""
    module = _CountingScale(5)
    graphed = make_graphed_callables(module, (torch.randn(3, 5, requires_grad=True),),
                                     num_warmup_iters=1, backend="tape")
    reference = module.weight.detach().clone().requires_grad_()
    for _ in range(3):
        x = torch.randn(3, 5)
        graphed(x).sum().backward()
        torch.tanh(x * reference).sum().backward()
    assert torch.equal(module.weight.grad, reference.grad)
