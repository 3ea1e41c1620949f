"""One graphed callable's replay: its graphs, static buffers and the autograd function around them.

A call copies the inputs into the static buffers (refusing one re-laid-out since capture),
replays the forward graph and returns the static outputs detached; autograd's backward copies
the incoming grads into the static grad-output buffers, replays the backward graph and returns
clones of the grads, except those lent uncloned (:mod:`~mhc_cg.graphs.grad_lending`) and
the parameter grads kept where the graph writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mhc_cg.core.regions import region
from mhc_cg.core.storage import is_buffer, storage_id
from mhc_cg.graphs.capture import Graph
from mhc_cg.graphs.grad_lending import EagerOp, GradBuffer, LentGrads, reads_grad_once
from mhc_cg.graphs.static_inputs import (BufferLayout, buffer_layout, check_input, describe,
                                                  layout_problem, load_input)


@dataclass
class GraphedState:
    """The static state behind one graphed callable: its captured graphs and static buffers."""

    label: str
    kwargs_keys: list[str]
    static_inputs: list[torch.Tensor]           # the user's flattened args + kwargs
    params: tuple[torch.nn.Parameter, ...]
    layouts: list[BufferLayout] = field(default_factory=list)  # the surface's, as the forward captured it
    fwd_graph: Graph | None = None
    bwd_graph: Graph | None = None
    static_outputs: list[torch.Tensor] = field(default_factory=list)
    output_spec: Any = None
    differentiable: list[bool] = field(default_factory=list)
    static_grad_outputs: list[torch.Tensor | None] = field(default_factory=list)
    grad_buffers: list[GradBuffer | None] = field(default_factory=list)  # the same, shared
    static_grad_inputs: list[torch.Tensor | None] = field(default_factory=list)
    saved_outputs: list[int] = field(default_factory=list)  # outputs the backward graph reads
    # surface index -> the parameter whose gradient stays where the backward graph writes it
    kept_grads: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    # surface index -> the parameter whose gradient the backward graph adds into its ``.grad``
    grads_into: dict[int, torch.nn.Parameter] = field(default_factory=dict)
    lend_to_eager: bool = False  # GraphOptions(lend_grads_to_eager=...)
    # GraphOptions(scratch=...): pool memory the caller may use from this forward's
    # replay to the pool's next replay (Note [forward scratch])
    scratch: torch.Tensor | None = None
    # the grad buffers the graphed callables made together share, and whom each is lent to
    lent: LentGrads = field(default_factory=LentGrads)

    @property
    def surface(self) -> list[torch.Tensor]:
        return list(self.static_inputs) + list(self.params)

    def copy_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self.static_inputs):
            raise TypeError(f"graphed callable {self.label}: got {len(inputs)} tensor inputs, "
                            f"captured with {len(self.static_inputs)}")
        n = len(self.static_inputs)
        for i, (t, captured) in enumerate(zip(self.surface, self.layouts)):
            if buffer_layout(t) != captured:  # every replay: compare first, word the error after
                what = f"input {i}" if i < n else f"parameter {i - n}"
                raise ValueError(layout_problem(f"graphed callable {self.label}: {what}", t,
                                                captured))
        for i, (static, given) in enumerate(zip(self.static_inputs, inputs)):
            check_input(f"graphed callable {self.label}: input {i}", given, static)
        with region("copy", "static inputs"):
            for static, given in zip(self.static_inputs, inputs):
                load_input(static, given)

    def saved_versions(self) -> tuple[int, ...]:
        """The version counters of the outputs the backward graph reads, as a replay left them."""
        return tuple(self.static_outputs[i]._version for i in self.saved_outputs)

    def check_saved_versions(self, versions: tuple[int, ...]) -> None:
        """Raise as autograd does when an output the backward reads was changed in place since
        the forward replay (the returned outputs share the static outputs' version counters)."""
        for i, version in zip(self.saved_outputs, versions):
            now = self.static_outputs[i]._version
            if now != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: output {i} of graphed callable {self.label} "
                    f"({describe(self.static_outputs[i])}) is at version {now}; expected version "
                    f"{version}. Its backward graph reads it: clone the output before editing it "
                    f"in place (out = out.clone())")

    def replay_forward(self) -> list[torch.Tensor]:
        self.fwd_graph.replay()
        self.lent.forget(self)  # a new forward: no backward of the last one reads or lends a grad
        return [o.detach() for o in self.static_outputs]

    def lendable_inputs(self, inputs: Sequence[torch.Tensor]) -> dict[int, tuple[Any, GradBuffer]]:
        """Inputs whose grad this backward may return uncloned: {input index: (reader, the
        shared buffer it lies in)}.

        An input qualifies when it is an output of another graphed callable P whose static
        grad-output buffer for it is the very buffer this backward writes the input's grad into
        (a fused backward writes the stream's grad over its grad output, and every backward graph
        shares the grad-output buffers): P's backward then reads it in place, copying nothing.
        With ``lend_to_eager`` it also qualifies when its producer is an eager op that reads its
        incoming grad once and keeps nothing of it (its Function says ``reads_grad_once``, as the
        streams' expand does) and the grad lies in one of the shared grad-output buffers: the op
        must read it before any other backward graph writes there (:class:`LentGrads` raises
        otherwise), which holds when one chain of graphs runs per backward.
        """
        lend = {}
        for i, (given, grad) in enumerate(zip(inputs, self.static_grad_inputs)):
            if grad is None or not isinstance(given, torch.Tensor) or not given.requires_grad:
                continue
            producer, target = grad_output_of(given)
            if producer is not None:
                if target is not None and is_buffer(target.tensor, grad):
                    lend[i] = (producer, target)
            elif self.lend_to_eager and reads_grad_once(given.grad_fn):
                mine = next((b for b in self.grad_buffers
                             if b is not None and is_buffer(b.tensor, grad)), None)
                if mine is not None:
                    lend[i] = (EagerOp.reading(given.grad_fn, self.lent), mine)
        return lend

    def replay_backward(self, grads: Sequence[torch.Tensor | None],
                        lend: Mapping[int, tuple[Any, GradBuffer]] | None = None) -> tuple:
        if self.bwd_graph is None:
            return tuple(None for _ in self.surface)
        self.lent.check_writer(self)
        self._reclaim_kept_grads()
        with region("copy", "grad outputs"):
            for static, grad in zip(self.static_grad_outputs, grads):
                if static is None:
                    continue
                if grad is None:
                    static.zero_()
                else:
                    load_input(static, grad)
        self.bwd_graph.replay()
        # Clones, not the static buffers: AccumulateGrad adopts a lone incoming gradient as
        # ``.grad`` (and the engine may add into it in place), so handing out a static buffer would
        # let the next replay overwrite an accumulated gradient. The exceptions: a grad lent to
        # the graphed producer whose backward reads it where it lies (``lendable_inputs``), and a
        # kept parameter grad, handed to ``.grad`` here (``_hand_over``).
        out = []
        for i, g in enumerate(self.static_grad_inputs):
            if lend and i in lend:
                reader, buffer = lend[i]
                buffer.lend(reader, self)
                out.append(g)
            elif i in self.kept_grads and g is not None:
                _hand_over(self.kept_grads[i], g)
                out.append(None)
            elif g is None:
                out.append(None)
            else:
                with region("copy", "grad clones"):
                    out.append(g.clone())
        return tuple(out)

    def _reclaim_kept_grads(self) -> None:
        """Before the replay overwrites the kept grads: a ``.grad`` that still is one of them (a
        later microbatch, or ``zero_grad(set_to_none=False)``) moves to a copy of itself."""
        for i, param in self.kept_grads.items():
            buffer = self.static_grad_inputs[i]
            if param.grad is not None and buffer is not None \
                    and storage_id(param.grad) == storage_id(buffer):
                with region("copy", "grad clones"), torch.no_grad():
                    param.grad = param.grad.clone()


def _hand_over(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """What AccumulateGrad does with a first-order gradient, without its clone of a tensor that
    something else holds: adopt it as ``.grad``, or add it into ``.grad`` in place. The parameter's
    AccumulateGrad node still runs (with no gradient), so its post-accumulate hooks fire after."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


def grad_output_of(t: torch.Tensor) -> tuple[GraphedState | None, GradBuffer | None]:
    """The graphed callable that produced ``t`` (``None`` if none did) and the static
    grad-output buffer its backward reads ``t``'s grad from (``None`` if it has none)."""
    state = getattr(t.grad_fn, "state", None)
    if not isinstance(state, GraphedState):
        return None, None
    buffers = state.grad_buffers
    return state, buffers[t.output_nr] if t.output_nr < len(buffers) else None


def grad_output_buffer(t: torch.Tensor) -> torch.Tensor | None:
    """The static grad-output buffer from which the backward graph that produced ``t`` reads
    ``t``'s grad, for the eager consumer of ``t`` to write that grad into (``contract_streams(...,
    grad_into=)``): the replay then copies nothing in. ``None`` when ``t`` is no graphed
    callable's output. Until that backward replays, any other backward graph that would write
    the buffer raises (:class:`LentGrads`)."""
    state, shared = grad_output_of(t)
    buffer = None if shared is None else shared.tensor
    if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype \
            or not buffer.is_contiguous():
        return None
    writer = EagerOp(f"the eager consumer of {state.label}'s output")

    def lend(grad: torch.Tensor) -> None:
        if is_buffer(buffer, grad):
            shared.lend(state, writer)

    t.register_hook(lend)
    return buffer


class _ReplayGraphs(torch.autograd.Function):
    """Forward replays the forward graph; backward replays the backward graph."""

    @staticmethod
    def forward(ctx, state: GraphedState, *inputs: torch.Tensor):
        # before the copies: one may write a buffer that a given input is a view of
        ctx.lend = state.lendable_inputs(inputs[:len(state.static_inputs)])
        state.copy_inputs(inputs[:len(state.static_inputs)])
        outputs = state.replay_forward()
        ctx.state = state
        ctx.saved_versions = state.saved_versions()
        # an output no grad reaches comes to backward as None, not as zeros made to be copied:
        # replay_backward zeroes its static grad buffer, if it has one, in place
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, state.differentiable) if not d])
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.check_saved_versions(ctx.saved_versions)
        return (None,) + ctx.state.replay_backward(grads, ctx.lend)


def graphed_function(state: GraphedState) -> Callable:
    def graphed(*user_args: Any, **user_kwargs: Any) -> Any:
        missing = [k for k in state.kwargs_keys if k not in user_kwargs]
        if missing:
            raise TypeError(f"graphed callable {state.label} was captured with keyword arguments "
                            f"{state.kwargs_keys}; missing {missing}")
        flat = tree_flatten(user_args)[0] + tree_flatten(
            [user_kwargs[k] for k in state.kwargs_keys])[0]
        outputs = _ReplayGraphs.apply(state, *flat, *state.params)
        return tree_unflatten(list(outputs), state.output_spec)

    graphed.state = state  # type: ignore[attr-defined]
    return graphed


def graphed_forward(module: torch.nn.Module, graphed: Callable) -> Callable:
    captured_training = module.training
    eager_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        # A graph captured for training replays only when a backward may follow: under no_grad
        # its forward replay would wait forever for the backward replay that comes next in order.
        if module.training == captured_training and (
                not captured_training or torch.is_grad_enabled()):
            return graphed(*args, **kwargs)
        return eager_forward(*args, **kwargs)

    forward.state = graphed.state  # type: ignore[attr-defined]
    return forward
