"""Graph semantics that concern the ``tape`` backend and make_graphed_callables on the CPU; what
every backend must keep is in tests/test_graph_semantics.py."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_cg.graphs import GraphCaptureError, GraphReplayError
from mhc_cg.lab.emulation.backends import get_backend

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


def test_a_capture_frees_and_reallocates_its_own_storage(backend):
    """Eager block recompute inside a full-iteration capture: discard (``resize_(0)``) an output the
    graph allocated, allocate it again, recompute into it; the replay equals eager."""
    x = torch.randn(16, device=backend.device)
    out = torch.zeros(16, device=backend.device)
    left_freed = []

    def body():
        a = x * 2
        a.untyped_storage().resize_(0)
        a.untyped_storage().resize_(16 * 4)
        a.copy_(x * 3)
        out.copy_(a + 1)
        b = x * 5  # freed and left freed: its pool memory is the graph's, a replay writes there
        out.add_(b)
        b.untyped_storage().resize_(0)
        left_freed.append(b)

    graph = backend.new_graph()
    with graph.capture():
        body()
    assert graph.stats.violations == 0
    x.copy_(torch.randn(16, device=backend.device))
    out.zero_()
    graph.replay()
    assert torch.equal(out, x * 3 + 1 + x * 5)


def test_freeing_a_storage_the_graph_does_not_own_is_rejected(backend):
    """An input of the graph freed inside the capture: a replay would read freed memory."""
    x = torch.randn(16, device=backend.device)

    def body():
        y = x * 2
        x.untyped_storage().resize_(0)
        y + 1

    error = capture_error(backend, body)
    assert "resized or re-pointed during capture" in str(error)
    assert "the graph did not allocate it" in str(error)
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

from mhc_cg.graphs import GraphOptions, count_allocated_static_inputs, make_graphed_callables  # noqa: E402


def test_static_inputs_without_reuse_one_set_per_sample():
    layers = tuple(CountingScale(4) for _ in range(2))
    order = [1, 1, 2, -2, 2, -1, -2, -1]  # pp-style: 2 chunks x 2 microbatches, 1 layer each
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    graphed = make_graphed_callables(layers, samples, num_warmup_iters=1, _order=order,
                                     options=GraphOptions(backend=get_backend("tape")))
    assert count_allocated_static_inputs(graphed) == 4 == planner_prediction(order, [1, 1], False)
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(4)]
    graphed = make_graphed_callables(layers, samples, num_warmup_iters=1, _order=order,
                                     _reuse_graph_input_output_buffers=True,
                                     options=GraphOptions(backend=get_backend("tape")))
    assert count_allocated_static_inputs(graphed) == planner_prediction(order, [1, 1], True) == 3


def test_graphed_callables_must_replay_in_capture_order():
    layers = tuple(CountingScale(4) for _ in range(2))
    samples = [(torch.randn(2, 4, requires_grad=True),) for _ in range(2)]
    first, second = make_graphed_callables(layers, samples, num_warmup_iters=1,
                                           options=GraphOptions(backend=get_backend("tape")))
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
        make_graphed_callables((layer,), [(torch.randn(2, 4),)], _order=order,
                               _reuse_graph_input_output_buffers=True,
                               options=GraphOptions(backend=get_backend("tape")))


def test_module_hooks_are_rejected():
    layer = CountingScale(4)
    layer.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks run once at capture and never at replay"):
        make_graphed_callables((layer,), [(torch.randn(2, 4),)],
                               options=GraphOptions(backend=get_backend("tape")))


def test_non_tensor_sample_args_are_rejected():
    with pytest.raises(TypeError, match="only tensors"):
        make_graphed_callables((CountingScale(4),), [(torch.randn(2, 4), 3)],
                               options=GraphOptions(backend=get_backend("tape")))


def test_wrong_input_shape_at_call_is_rejected():
    graphed = make_graphed_callables(CountingScale(4), (torch.randn(2, 4),), num_warmup_iters=1,
                                     options=GraphOptions(backend=get_backend("tape")))
    with pytest.raises(ValueError, match="captured with \\[2, 4\\]"):
        graphed(torch.randn(3, 4))


def test_te_without_tes_python_says_how_to_get_it(tmp_path, monkeypatch):
    """``te`` is TransformerEngine's own function: where neither TE nor its wheel is at hand,
    one line says how to fetch the wheel."""
    from mhc_cg.lab.emulation.backends import resolve_backend_name
    from mhc_cg.graphs.te import te_installed
    from mhc_cg.lab.emulation.backends import graph_api

    if te_installed() and torch.cuda.is_available():
        pytest.skip("TransformerEngine is installed")
    monkeypatch.setenv("MHC_CG_TE_WHEEL", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="pip download --no-deps transformer-engine=="):
        graph_api("te")
    with pytest.raises(ValueError, match="'te' needs TransformerEngine's Python"):
        resolve_backend_name("te", "cpu")


def test_gradients_accumulate_over_microbatches_replaying_one_graph():
    """Without an order one graph serves every microbatch; ``.grad`` must sum them all."""
    module = CountingScale(5)
    graphed = make_graphed_callables(module, (torch.randn(3, 5, requires_grad=True),),
                                     num_warmup_iters=1, options=GraphOptions(backend=get_backend("tape")))
    reference = module.weight.detach().clone().requires_grad_()
    for _ in range(3):
        x = torch.randn(3, 5)
        graphed(x).sum().backward()
        torch.tanh(x * reference).sum().backward()
    assert torch.equal(module.weight.grad, reference.grad)


def _kept_grad_buffer(graphed) -> torch.Tensor:
    state = graphed.forward.state
    (index,) = state.kept_grads
    return state.static_grad_inputs[index]


def test_a_kept_param_grad_becomes_grad_uncopied_and_accumulates_as_autograd_does():
    """``keep_param_grads``: the first microbatch's ``.grad`` is the very buffer the backward graph
    wrote; later microbatches add into it as AccumulateGrad does (bit for bit), and the buffer's
    next replay leaves the accumulated ``.grad`` alone."""
    module = CountingScale(5)
    graphed = make_graphed_callables(module, (torch.randn(3, 5, requires_grad=True),),
                                     num_warmup_iters=1, clone_param_grads_on_return=False,
                                     options=GraphOptions(backend=get_backend("tape")))
    buffer = _kept_grad_buffer(graphed)
    reference = module.weight.detach().clone().requires_grad_()
    for step in range(2):
        for microbatch in range(3):
            x = torch.randn(3, 5)
            graphed(x).sum().backward()
            torch.tanh(x * reference).sum().backward()
            if microbatch == 0 and step == 0:
                assert module.weight.grad.untyped_storage().data_ptr() == \
                    buffer.untyped_storage().data_ptr()
            assert torch.equal(module.weight.grad, reference.grad)
        # the next step's first replay must not overwrite a zeroed .grad that still is the buffer
        module.weight.grad.zero_()
        reference.grad.zero_()


def test_a_param_shared_by_two_graphed_callables_gets_clones():
    """A parameter that two backward graphs compute grads for has no one buffer to keep: both
    graphs' grads reach ``.grad`` through AccumulateGrad, summed as eagerly."""
    first, second = CountingScale(5), CountingScale(5)
    second.weight = first.weight
    samples = [(torch.randn(3, 5, requires_grad=True),) for _ in range(2)]
    graphed = make_graphed_callables((first, second), samples, num_warmup_iters=1,
                                     clone_param_grads_on_return=False,
                                     options=GraphOptions(backend=get_backend("tape")))
    assert all(not state.kept_grads for state in graphed.states)
    reference = first.weight.detach().clone().requires_grad_()
    for _ in range(2):
        x = torch.randn(3, 5)
        graphed[1](graphed[0](x)).sum().backward()
        torch.tanh(torch.tanh(x * reference) * reference).sum().backward()
    assert torch.equal(first.weight.grad, reference.grad)


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


class _IntoScratch(torch.nn.Module):
    """``x * w``, written into the forward scratch of its capture when there is one."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((4,), 3.0))

    def forward(self, x, scratch=None):
        out = x * self.w
        if scratch is None:
            return out
        into = scratch[:4]
        into.copy_(out)
        return into


def test_a_forward_scratch_holds_its_output_until_the_pools_next_replay():
    """Note [forward scratch]: the forward writes its output into the scratch; the caller gets
    the same memory (``scratch(i)``) and the right values after the forward's replay; the
    backward capture took the memory back, so the backward's replay poisons it (tape), and the
    gradients are those of eager."""
    from mhc_cg.core.storage import storage_id

    module, sample = _IntoScratch(), torch.randn(4, requires_grad=True)
    graphed = make_graphed_callables((module,), ((sample,),), num_warmup_iters=1,
                                     options=GraphOptions(backend=get_backend("tape"), scratch={0: 8}))
    memory = graphed.scratch(0)
    assert memory is not None and memory.numel() == 8
    x = torch.randn(4, requires_grad=True)
    out = graphed[0](x)
    assert storage_id(out) == storage_id(memory) and torch.equal(memory[:4], x.detach() * 3.0)
    out.sum().backward()
    assert torch.isnan(memory).all()
    assert torch.equal(x.grad, torch.full((4,), 3.0)) and torch.equal(module.w.grad, x.detach())


# ---------------------------------------------------------------------------------------------
# A chain of fused mHC sublayers: the stream's grad is lent from one backward graph to the next.

def _fused_sublayers(count: int):
    from mhc_cg.config import MHCGPTConfig
    from mhc_cg.model.sublayer import MHCSublayer

    cfg = MHCGPTConfig(vocab_size=32, seq_length=4, hidden_size=8, num_heads=2, num_layers=1,
                       hidden_dropout=0.0)
    torch.manual_seed(0)
    return [MHCSublayer(cfg, torch.nn.Linear(8, 8), stream) for stream in range(count)]


def _graphed_chain(subs):
    from mhc_cg.graphs import make_graphed_callables

    samples = tuple((torch.randn(4, 2, 32, requires_grad=True),) for _ in subs)
    return make_graphed_callables(tuple(subs), samples, num_warmup_iters=1,
                                  options=GraphOptions(backend=get_backend("tape"), grads_owned=True))


class StreamCopies(TorchDispatchMode):
    """Counts ``copy_`` and ``clone`` calls on stream-shaped tensors ``[4, 2, 32]``."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default) \
                and tuple(out.shape) == (4, 2, 32):
            self.counts[func.__name__.split(".")[0]] += 1
        return out


def test_a_chain_of_graphed_sublayers_lends_the_stream_grad_and_matches_eager():
    """Each sublayer's backward writes its input's grad over its grad output (a buffer shared by
    every backward graph) and hands it uncloned to the graphed sublayer before, which reads it in
    place. Gradients equal eager's bit for bit, and the stream's grad is copied in and cloned
    once per chain (the incoming grad, the chain input's grad), not once per graph."""
    eager, subs = _fused_sublayers(3), _fused_sublayers(3)
    graphed = _graphed_chain(subs)
    for _ in range(2):
        x, g = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_g = xe, xg
        for e, s in zip(eager, graphed):
            out_e, out_g = e(out_e), s(out_g)
        assert torch.equal(out_e, out_g)
        out_e.backward(g)
        with StreamCopies() as seen:
            out_g.backward(g)
        assert seen.counts == {"copy_": 1, "clone": 1}, seen.counts
        assert torch.equal(xe.grad, xg.grad)
        for e, s in zip(eager, subs):
            for (name, pe), ps in zip(e.named_parameters(), s.parameters()):
                assert torch.equal(pe.grad, ps.grad), name


def _lending_chain(subs, lend: bool):
    from mhc_cg.graphs import make_graphed_callables

    samples = tuple((torch.randn(4, 2, 32, requires_grad=True),) for _ in subs)
    return make_graphed_callables(tuple(subs), samples, num_warmup_iters=1,
                                  options=GraphOptions(backend=get_backend("tape"), lend_grads_to_eager=lend,
                                                       grads_owned=True))


def test_a_chain_between_the_streams_expand_and_contraction_copies_no_stream_grad():
    """At a chunk's ends the eager expand reads the first graph's input grad where the backward
    wrote it, and the contraction writes the last graph's grad where its backward reads it: the
    stream's grad is neither copied in nor cloned, and every gradient equals eager's."""
    from mhc_cg.ops.hyper_connection import contract_streams, expand_streams
    from mhc_cg.graphs.graphed_callables import grad_output_buffer

    eager, subs = _fused_sublayers(3), _fused_sublayers(3)
    graphed = _lending_chain(subs, lend=True)
    for _ in range(2):
        h, g = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
        he, hg = h.clone().requires_grad_(), h.clone().requires_grad_()
        out_e, out_g = expand_streams(he, 4), expand_streams(hg, 4)
        for e, s in zip(eager, graphed):
            out_e, out_g = e(out_e), s(out_g)
        contract_streams(out_e, 4).backward(g)
        y = contract_streams(out_g, 4, grad_into=grad_output_buffer(out_g))
        with StreamCopies() as seen:
            y.backward(g)
        assert seen.counts == {}, seen.counts
        assert torch.equal(he.grad, hg.grad)
        for e, s in zip(eager, subs):
            for (name, pe), ps in zip(e.named_parameters(), s.parameters()):
                assert torch.equal(pe.grad, ps.grad), name


def test_a_grad_lent_to_the_eager_expand_is_never_overwritten_before_it_is_read():
    """Two chains in one backward: the second chain's backward runs before the first chain's
    expand reads the grad lent to it. Lending raises rather than feed it the other chain's grad;
    without lending the grads are cloned and equal eager's."""
    from mhc_cg.ops.hyper_connection import expand_streams

    a, b = torch.randn(4, 2, 8, requires_grad=True), torch.randn(4, 2, 8, requires_grad=True)
    left, right = _lending_chain(_fused_sublayers(2), lend=True)

    def two_chains(first, second, a, b):
        xa, xb = expand_streams(a, 4), expand_streams(b, 4)  # both expands before both chains
        (first(xa).sum() + second(xb).sum()).backward()

    with pytest.raises(RuntimeError, match="lend_grads_to_eager=False"):
        two_chains(left, right, a, b)
    eager = _fused_sublayers(2)
    ae, be = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    two_chains(eager[0], eager[1], ae, be)
    a.grad = b.grad = None
    two_chains(*_lending_chain(_fused_sublayers(2), lend=False), a, b)
    assert torch.equal(a.grad, ae.grad) and torch.equal(b.grad, be.grad)


def test_a_backward_that_stops_before_the_expand_reads_its_lent_grad_leaves_no_lending_behind():
    """A backward that raises between the first graph's backward and the expand's leaves a grad
    lent to a reader that never runs: the lender's next forward ends that lending, so the next
    step trains."""
    from mhc_cg.ops.hyper_connection import expand_streams

    graphed = _lending_chain(_fused_sublayers(2), lend=True)

    def stop(grad):
        raise RuntimeError("stopped by a hook")

    def step(hook=None):
        h = torch.randn(4, 2, 8, requires_grad=True)
        out = expand_streams(h, 4)
        if hook is not None:
            out.register_hook(hook)
        for sub in graphed:
            out = sub(out)
        out.sum().backward()
        return h.grad

    with pytest.raises(RuntimeError, match="stopped by a hook"):
        step(stop)
    assert step() is not None


def test_a_graphed_output_feeding_two_graphed_consumers_is_refused_not_mixed_up():
    """A lent grad lives in the buffer every backward graph writes: if a second graphed consumer
    of the same output replays its backward before the producer's reads the grad, the replay
    raises rather than hand the producer the wrong gradient."""
    subs = _fused_sublayers(3)
    graphed = _graphed_chain(subs)
    first, left, right = graphed
    x = torch.randn(4, 2, 32, requires_grad=True)
    h = first(x)
    loss = left(h).sum() + right(h).sum()
    with pytest.raises(RuntimeError, match="must feed only that one"):
        loss.backward()
    # cloned for the second use, such graphs give eager's gradients
    first, left, right = _graphed_chain(_fused_sublayers(3))
    eager = _fused_sublayers(3)
    xe = x.detach().clone().requires_grad_()
    he = eager[0](xe)
    (eager[1](he).sum() + eager[2](he).sum()).backward()
    x.grad = None
    h = first(x)
    (left(h).sum() + right(h.clone()).sum()).backward()
    assert torch.equal(x.grad, xe.grad)
