"""Graph semantics that concern the ``tape`` backend and make_graphed_callables on the CPU; what
every backend must keep is in tests/test_graph_semantics.py."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.runtime.graphs import GraphCaptureError, GraphReplayError, get_backend

from helpers import CountingScale, capture_error, planner_prediction


@pytest.fixture
def backend():
    return get_backend("tape")


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


def test_a_graph_is_captured_once_and_replayed_only_after_capture(backend):
    graph = backend.new_graph()
    with pytest.raises(GraphReplayError, match="never|new"):
        graph.replay()
    with graph.capture():
        torch.ones(2) * 2
    with pytest.raises(GraphCaptureError, match="capture\\(\\) called on a graph that is captured"):
        with graph.capture():
            pass


@torch.library.custom_op("mhc_cg_test::scale_into_and_sum", mutates_args=("out",))
def _scale_into_and_sum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 2)
    return x.sum(0)


@_scale_into_and_sum.register_fake
def _(x, out):
    return x.new_empty(x.shape[1:])


def test_an_op_writing_a_buffer_and_returning_a_new_tensor_replays_both(backend):
    """Like mhc_cg::pre_backward_into: the replay rewrites the buffer and the returned tensor."""
    x, out = torch.ones(3, 2), torch.zeros(3, 2)
    graph = backend.new_graph()
    with graph.capture():
        total = _scale_into_and_sum(x, out)
    x.fill_(5.0)
    graph.replay()
    assert torch.equal(out, torch.full((3, 2), 10.0))
    assert torch.equal(total, torch.full((2,), 15.0))


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


def test_freeing_a_graph_tensor_during_capture_rejected(backend):
    """Eager block recompute's discard (``untyped_storage().resize_(0)`` of a checkpointed output) in a graph."""
    x = torch.randn(16)

    def body():
        y = x * 2
        y.untyped_storage().resize_(0)

    error = capture_error(backend, body)
    assert "resized or re-pointed during capture" in str(error)
    assert len(error.report.resized_storages) == 1


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

from mhc_cg.runtime.graphs import count_allocated_static_inputs, make_graphed_callables  # noqa: E402


def test_static_inputs_without_reuse_one_set_per_sample():
    layers = tuple(CountingScale(4) for _ in range(2))
    order = [1, 1, 2, -2, 2, -1, -2, -1]  # pp-style: 2 chunks x 2 microbatches, 1 layer each
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    graphed = make_graphed_callables(layers, samples, order=order, reuse_input_buffers=False,
                                     num_warmup_iters=1, backend="tape")
    assert count_allocated_static_inputs(graphed) == 4 == planner_prediction(order, [1, 1], False)
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    graphed = make_graphed_callables(layers, samples, order=order, num_warmup_iters=1, backend="tape")
    assert count_allocated_static_inputs(graphed) == planner_prediction(order, [1, 1], True) == 3


def test_graphed_callables_must_replay_in_capture_order():
    layers = tuple(CountingScale(4) for _ in range(2))
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
    layer = CountingScale(4)
    with pytest.raises(ValueError, match=match):
        make_graphed_callables((layer,), [(torch.randn(2, 4),)], order=order, backend="tape")


def test_module_hooks_are_rejected():
    layer = CountingScale(4)
    layer.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks run once at capture and never at replay"):
        make_graphed_callables((layer,), [(torch.randn(2, 4),)], backend="tape")


def test_non_tensor_sample_args_are_rejected():
    with pytest.raises(TypeError, match="only tensors"):
        make_graphed_callables((CountingScale(4),), [(torch.randn(2, 4), 3)], backend="tape")


def test_wrong_input_shape_at_call_is_rejected():
    graphed = make_graphed_callables(CountingScale(4), (torch.randn(2, 4),), num_warmup_iters=1,
                                     backend="tape")
    with pytest.raises(ValueError, match="captured with \\[2, 4\\]"):
        graphed(torch.randn(3, 4))


def test_te_backend_without_te_says_so():
    from mhc_cg.runtime.graphs.backends import te_available
    if te_available() and torch.cuda.is_available():
        pytest.skip("TransformerEngine is installed")
    with pytest.raises(RuntimeError, match="(TransformerEngine|CUDA device)"):
        get_backend("te")


def test_gradients_accumulate_over_microbatches_replaying_one_graph():
    """Without an order one graph serves every microbatch; ``.grad`` must sum them all."""
    module = CountingScale(5)
    graphed = make_graphed_callables(module, (torch.randn(3, 5, requires_grad=True),),
                                     num_warmup_iters=1, backend="tape")
    reference = module.weight.detach().clone().requires_grad_()
    for _ in range(3):
        x = torch.randn(3, 5)
        graphed(x).sum().backward()
        torch.tanh(x * reference).sum().backward()
    assert torch.equal(module.weight.grad, reference.grad)


def test_a_released_output_is_poisoned_when_another_graph_of_the_pool_replays(backend):
    """After ``release_outputs`` a later capture may own the memory: the tape poisons released
    outputs at every replay of another graph of the pool, so a late reader sees NaN."""
    pool = backend.new_pool()
    x = torch.randn(4)
    first, second = backend.new_graph(pool), backend.new_graph(pool)
    with first.capture():
        out = x * 2
    with second.capture():
        other = x + 1
    (released,) = first.release_outputs([out])
    (kept,) = second.release_outputs([x])  # not the capture's: nothing to give back
    assert kept is x
    first.replay()
    assert torch.equal(released, x * 2)
    second.replay()
    assert torch.isnan(released).all() and torch.equal(other, x + 1)
    first.replay()
    assert torch.equal(released, x * 2)
