"""The tape's replay computes what a CUDA graph computes where the graph and eager disagree without
any CUDA error: a CPU scalar read inside the capture, and an input whose sizes, strides or offset
changed in place after it. Graphed callables refuse the second before replaying, in one line."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.graphs import GraphOptions, GraphReplayError, make_graphed_callables
from mhc_cg.lab.emulation.backends import get_backend


@pytest.fixture
def tape():
    return get_backend("tape")


# ---------------------------------------------------------------------------------------------
# CPU scalars.

def test_a_cpu_scalar_read_in_a_capture_keeps_its_captured_value(tape):
    """CUDA's rule: a 0-dim CPU tensor among a CUDA op's operands is a *CPU scalar*; TensorIterator
    reads its value on the host when the kernel is launched and passes it by value in the kernel's
    arguments. A capture records the launch with those arguments, so every replay uses the value
    the scalar had at capture (the host copy is never read again)."""
    x = torch.ones(3)
    step = torch.tensor(1.0)  # a step counter, a learning rate, a loss scale kept on the host
    graph = tape.new_graph()
    with graph.capture():
        y = x * step
    step.fill_(7.0)
    graph.replay()
    assert torch.equal(x * step, torch.full((3,), 7.0))  # eager reads the new value
    assert torch.equal(y, torch.ones(3))  # the graph keeps 1


def test_a_cpu_scalar_is_baked_per_op_at_the_value_it_had_there(tape):
    """Each launch reads the host value when it is enqueued, so two ops of one capture may bake two
    values of one scalar that Python changed between them."""
    x, scale = torch.ones(2), torch.tensor(2.0)
    graph = tape.new_graph()
    with graph.capture():
        a = x * scale
        scale.fill_(3.0)  # a host write: on a GPU it happens once, at capture
        b = x * scale
    scale.fill_(5.0)
    graph.replay()
    assert torch.equal(a, torch.full((2,), 2.0)) and torch.equal(b, torch.full((2,), 3.0))
    assert scale.item() == 5.0  # nor does a replay repeat the host write


def test_device_scalars_are_read_at_replay(tape):
    """What is on the device in a GPU run stays live: a scalar the graph computes, a parameter, a
    graphed callable's input, and a tensor a custom op reads (a kernel reads device memory through
    a pointer; a CPU tensor there is an error on a GPU, never a baked value)."""
    x = torch.ones(3)
    weight = torch.nn.Parameter(torch.tensor(2.0))
    graph = tape.new_graph()
    with graph.capture(), torch.no_grad():
        total = x.sum()  # a 0-dim tensor the graph makes
        y = x / total * weight
    x.fill_(2.0)
    with torch.no_grad():
        weight.fill_(4.0)
    graph.replay()
    assert torch.equal(y, torch.full((3,), 4.0 / 3.0))

    scaled = make_graphed_callables(lambda v, s: v * s, (torch.ones(3), torch.tensor(1.0)),
                                    options=GraphOptions(backend=get_backend("tape")))
    for s in (2.0, 7.0):
        assert torch.equal(scaled(torch.ones(3), torch.tensor(s)), torch.full((3,), s))


# ---------------------------------------------------------------------------------------------
# Geometry changed in place after capture.

def _transpose(x):
    x.t_()


def _as_strided(x):
    x.as_strided_((3, 3), (1, 3))


def _shift(x):
    x.as_strided_((3, 3), (3, 1), 3)


def _resize(x):
    x.resize_(9)  # same bytes: the storage is neither freed nor moved


GEOMETRY_CHANGES = {"t_": _transpose, "as_strided_": _as_strided, "offset": _shift,
                    "resize_": _resize}


@pytest.mark.parametrize("change", list(GEOMETRY_CHANGES))
def test_an_input_whose_geometry_changed_after_capture_is_read_with_the_captured_one(tape, change):
    """CUDA's rule: a kernel's arguments hold the data pointer, sizes and strides of each tensor as
    they were at launch (TensorIterator bakes them into its offset calculator), so a replay reads
    the captured layout at the captured address. ``t_``, ``as_strided_`` and ``resize_`` within
    the storage's bytes change only the tensor's metadata on the host: the graph never sees it and
    raises nothing."""
    x = torch.arange(12.0)[:9].view(3, 3)  # [[0, 1, 2], [3, 4, 5], [6, 7, 8]], three spare elements
    graph = tape.new_graph()
    with graph.capture():
        y = x.sum(0)
    assert torch.equal(y, torch.tensor([9.0, 12.0, 15.0]))
    GEOMETRY_CHANGES[change](x)
    y.zero_()
    graph.replay()
    assert torch.equal(y, torch.tensor([9.0, 12.0, 15.0]))  # eager: t_ gives [3, 12, 21]


def test_a_tensor_moved_to_another_storage_after_capture_is_refused_at_replay(tape):
    """A graph keeps the old address, whose memory may since have gone to another tensor."""
    base = torch.arange(9.0)
    x = base.view(3, 3)
    graph = tape.new_graph()
    with graph.capture():
        base * 2  # the storage's first user is base, not x
        x.sum(0)
    x.set_(torch.zeros(9).untyped_storage(), 0, (3, 3), (3, 1))
    with pytest.raises(GraphReplayError, match="moved to another storage"):
        graph.replay()


@pytest.mark.parametrize("change", list(GEOMETRY_CHANGES))
def test_graphed_callables_refuse_an_input_whose_geometry_changed_in_one_line(change):
    x = torch.arange(12.0)[:9].view(3, 3)
    layer = torch.nn.Linear(3, 3)
    graphed = make_graphed_callables(layer, (x,), options=GraphOptions(backend=get_backend("tape")))
    GEOMETRY_CHANGES[change](x)
    with pytest.raises(ValueError) as info:
        graphed(x)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("graphed callable #0: input 0 ")
    assert "captured" in message and "strides" in message
