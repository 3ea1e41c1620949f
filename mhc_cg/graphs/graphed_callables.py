"""``make_graphed_callables`` with TransformerEngine's semantics, over any graph backend.

Note [graphed callables as TE's] (docs/design.md, item 5). What a caller relies on (the same as
TE's ``make_graphed_callables``):

* **Layout.** Without ``_order``: one graphed callable per callable, forwards captured 1..N and
  backwards N..1. With ``_order`` (TE's: ``+c`` forward of model chunk ``c``, ``-c`` its
  backward, 1-based, chunk ``c``'s microbatches in FIFO order), ``callables`` holds every chunk's
  layers back to back and ``sample_args`` one entry per (chunk, microbatch, layer) at index
  ``prefix[c] * M + m * L_c + l``; one graphed callable comes back per entry, and the forward and
  backward graphs are captured in the order's sequence, all in one pool.
* **Static inputs.** Each graph reads its inputs from static buffers: the ``sample_args``
  tensors. With ``_order`` and ``_reuse_graph_input_output_buffers``, a chunk's backward
  releases the input buffers of that chunk's oldest in-flight microbatch to a free queue keyed
  by (shape, dtype, stride, device), and a later forward with the same key takes them: the number of buffers then
  follows the pipeline depth, not the number of microbatches
  (:func:`count_allocated_static_inputs`). Backward graphs always share grad-output buffers (one
  per shape), and each backward graph's grad inputs go back to the pool once it is captured
  (:meth:`~mhc_cg.graphs.capture.Graph.release_outputs`): a later capture may reuse their memory,
  since every replay clones them before any other graph runs, as TE does; without
  ``_reuse_graph_input_output_buffers``, every backward graph keeps its weight and input
  gradients in the pool for good.
* **A call** first refuses, in one line naming it, a static input or parameter re-laid-out in
  place or moved to another storage since capture (the graph would keep its captured layout and
  address, unseen: :func:`~mhc_cg.graphs.static_inputs.layout_problem`). It then copies
  each input into its static buffer only when it is not that buffer already, replays the forward
  graph and returns *detached static outputs*: they are overwritten by the next replay of the
  same graph. Autograd sees an ``autograd.Function`` whose backward copies the
  incoming grads into static grad-output buffers, replays the backward graph and returns the
  grads it computed, those of the module's parameters included (parameters are inputs of the
  Function, so autograd accumulates them into ``.grad``).
* **Replay order** must follow the capture order (pool rule); the backends raise otherwise.
* Modules stay modules without ``_order`` (their ``forward`` replays while their ``training``
  flag equals the captured one); with ``_order`` the entries are plain functions, as in TE.

One deliberate difference from TE: the backward returns *clones* of the static grad inputs. TE
returns the static buffers themselves, and autograd's ``AccumulateGrad`` adopts a lone incoming
gradient as ``.grad`` and adds later ones into it in place; without an order one graph serves
every microbatch, so its next backward replay would overwrite the accumulated ``.grad``
(tests/test_graphs_tape.py::test_gradients_accumulate_over_microbatches_replaying_one_graph).
The exception is a grad *lent* down a chain of graphs: when an input is another graphed
callable's output and this backward wrote the input's grad into the very grad-output buffer the
producer's backward reads (a fused mHC backward writes the stream's grad over its grad output,
and every backward graph shares those buffers), the buffer goes to autograd uncloned and the
producer reads it where it lies. A backward graph that would overwrite a lent buffer before its
reader replays raises (:class:`~mhc_cg.graphs.grad_lending.LentGrads`). As with TE's static grads, a tensor hook that keeps
the grad of such an input sees it change when the producer's backward replays: clone it there.
With ``GraphOptions(lend_grads_to_eager=True)`` the same holds for an input made by an eager op that reads its grad
once (the streams' expand at a chunk's start). The other way round, an eager consumer of a graphed
output may write its grad straight into the buffer the backward graph reads it from
(:func:`grad_output_buffer`; the streams' contraction at a chunk's end): no copy in either.

With ``clone_param_grads_on_return=False`` a parameter's grad is not cloned either. Where the parameter has a
``.grad`` buffer when the graphs are captured (the training's optimizer keeps every gradient in
one), the backward graph adds the grad into it (Note [grads accumulated inside the graph]).
Otherwise it stays in the pool where its one backward graph writes it and is handed to ``.grad``
directly (Megatron writes weight grads straight into ``main_grad`` for the same reason); the
price is TE's: a ``.grad`` that is such a buffer is moved to a copy before that graph replays
again, so a reference to ``.grad`` taken before it was set to ``None`` sees the next replay's
values.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten

from mhc_cg.core.regions import region
from mhc_cg.core.storage import storage_id
from mhc_cg.graphs.autograd_graph import saved_storages
from mhc_cg.graphs.capture import Graph, GraphBackend
from mhc_cg.graphs.cuda import CudaBackend
from mhc_cg.graphs.grad_lending import GradBuffer, LentGrads
from mhc_cg.graphs.order_layout import (OrderLayout, buffer_key, flat_tensors, label_of,
                                                order_layout, share_static_inputs)
from mhc_cg.graphs.replay_state import (GraphedState, graphed_forward, graphed_function,
                                                grad_output_buffer)
from mhc_cg.graphs.static_inputs import buffer_layout, static_buffer

__all__ = ["GraphOptions", "GraphedCallables", "GraphedState", "OrderLayout",
           "count_allocated_static_inputs", "grad_output_buffer", "make_graphed_callables",
           "order_layout"]

# Note [forward scratch]: ``GraphOptions(scratch={i: numel})`` has sample i's forward capture
# allocate ``numel`` elements of its pool before the callable runs, and call the callable with
# that memory as its keyword argument ``scratch`` (at capture only: warm-up calls pass none); it
# may write an output there. The memory goes back to the pool when that sample's backward is
# captured (``Graph.free_early``): the backward and every later capture may take it. So what the
# forward wrote there, and anything the caller puts there after the forward's replay
# (``GraphedCallables.scratch(i)``), lives until the pool's next replay: a chain whose next graph
# is this sample's backward lends the caller that memory for the work between the two, without
# a byte more of pool. An output there must not be one the backward reads; the forward's static
# outputs are re-pointed at the returned memory.


# --------------------------------------------------------------------------------------------
# The result.

class GraphedCallables(tuple):
    """The graphed callables (a tuple, as TE returns), with what was built for them: the
    ``backend``'s name, the ``pool``, each callable's ``states`` (``None`` under TE, which keeps
    its own), how many distinct static input sets they read, and the graphs (:meth:`graphs`)."""

    backend: str
    pool: Any
    states: list[GraphedState] | None
    static_input_sets: int

    def __new__(cls, callables: Sequence, *, backend: str, pool: Any,
                states: list[GraphedState] | None, static_input_sets: int,
                captured: Sequence[Graph] = (),
                static_tensors: Sequence[torch.Tensor] = ()) -> "GraphedCallables":
        self = super().__new__(cls, callables)
        self.backend, self.pool, self.states = backend, pool, states
        self.static_input_sets = static_input_sets
        self._captured = list(captured)  # TE's graphs, where its torch.cuda is ours
        self._static_tensors = list(static_tensors)  # TE's static buffers outside its pool
        return self

    def static_tensors(self) -> list[torch.Tensor]:
        """The static buffers the graphs read and write outside their pool: inputs and
        grad outputs."""
        if self.states is None:
            return list(self._static_tensors)
        return [t for state in self.states for t in (*state.static_inputs,
                                                     *state.static_grad_outputs) if t is not None]

    def scratch(self, index: int) -> torch.Tensor | None:
        """Sample ``index``'s forward scratch (Note [forward scratch]), ``None`` without one."""
        return None if self.states is None else self.states[index].scratch

    def graphs(self) -> list[Graph]:
        """Every graph the call captured (forward and backward), in capture order: ours, or
        TE's where its ``torch.cuda`` is served by mhc_cg (off a GPU)."""
        if self.states is None:
            return list(self._captured)
        found = []
        for state in self.states:
            found.extend(g for g in (state.fwd_graph, state.bwd_graph) if g is not None)
        return found


def _distinct_input_sets(sets: Sequence[Sequence[torch.Tensor]]) -> int:
    return len({tuple(id(t) for t in tensors) for tensors in sets})


def count_allocated_static_inputs(graphed: Any) -> int:
    """How many distinct static input buffer sets the graphed callables read from.

    One set is the flattened tensor inputs of one graphed (chunk, microbatch, layer). Without
    buffer reuse that is one per entry of ``sample_args``; with reuse it is what the schedule
    planner's ``count_static_input_buffers(order, num_layers_per_chunk, reuse=True)`` predicts.
    """
    if isinstance(graphed, GraphedCallables):
        return graphed.static_input_sets
    state = getattr(graphed, "state", None) or getattr(getattr(graphed, "forward", None), "state", None)
    if state is None:
        raise TypeError(f"count_allocated_static_inputs: expected the result of "
                        f"mhc_cg.graphs.make_graphed_callables, got {type(graphed).__name__}")
    return 1


# --------------------------------------------------------------------------------------------
# make_graphed_callables

def _check_callables(callables: tuple) -> bool:
    """Validate modules as TE does; returns whether they train (all must agree)."""
    training = [getattr(c, "training", True) for c in callables]
    if any(training) and not all(training):
        raise ValueError("make_graphed_callables: callables must be all in training or all in eval "
                         f"mode, got training flags {training}")
    for i, c in enumerate(callables):
        if not callable(c):
            raise TypeError(f"make_graphed_callables: callables[{i}] is not callable: {type(c).__name__}")
        if isinstance(c, torch.nn.Module):
            for m in c.modules():
                if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
                    raise ValueError(
                        f"make_graphed_callables: callables[{i}] ({type(m).__name__}) has module "
                        f"hooks; hooks run once at capture and never at replay, so none may be "
                        f"registered when capturing (register them on the graphed module after)")
            bad = [n for n, b in c.named_buffers() if b.requires_grad]
            if bad:
                raise ValueError(f"make_graphed_callables: callables[{i}] has buffers requiring grad "
                                 f"({bad}); only parameters may be trainable")
    return all(training)


@dataclass(frozen=True)
class GraphOptions:
    """What mhc_cg's ``make_graphed_callables`` does that TransformerEngine's does not, in one
    argument: ``backend``, the backend object that captures (``None``: CUDA graphs, for inputs on
    a GPU),
    ``lend_grads_to_eager`` (the module docstring), ``scratch``, ``{sample index: elements}``
    of pool memory lent from a forward's replay to the pool's next one (Note [forward scratch]),
    and ``grads_owned``: each callable's forward capture is called with the keyword
    ``grad_owned=True`` (warm-up calls pass none), telling it that its outputs' gradients come
    in the backward graph's own grad-output buffers, which that backward alone reads (each replay
    copies its incoming grads in first): a fused mHC backward may then write the stream's
    gradient over them in place."""

    backend: GraphBackend | None = None
    lend_grads_to_eager: bool = False
    scratch: Mapping[int, int] | None = None
    grads_owned: bool = False


def make_graphed_callables(
    modules: Callable | tuple[Callable, ...],
    sample_args: tuple | list,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: tuple | list | None = None,
    fp8_enabled: Any = None,
    fp8_calibrating: bool | None = None,
    fp8_recipe: Any = None,
    fp8_group: Any = None,
    fp8_weight_caching: bool | None = None,
    enabled: Any = None,
    calibrating: bool | None = None,
    recipe: Any = None,
    amax_reduction_group: Any = None,
    cache_quantized_params: bool | None = None,
    _order: Sequence[int] | None = None,
    _num_layers_per_chunk: int | Sequence[int] | None = None,
    pool: Any = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    clone_param_grads_on_return: bool = True,
    pre_warmup_hook: Callable[[], None] | None = None,
    post_warmup_hook: Callable[[], None] | None = None,
    capture_time_hooks: Sequence[Mapping[str, Mapping[Any, Callable]] | None] | None = None,
    *,
    options: GraphOptions | None = None,
) -> Any:
    """Graph ``modules`` (forward and backward): TransformerEngine 2.20's
    ``make_graphed_callables``, its arguments and semantics, over mhc_cg's backends.

    See the module docstring. As TE's: ``num_warmup_iters`` warm-up iterations of every forward
    and backward in the capture order; ``pre_warmup_hook``/``post_warmup_hook`` once before/after
    them; ``capture_time_hooks``, one dict per callable of ``{"forward_pre_hooks",
    "forward_hooks", "backward_pre_hooks", "backward_hooks": {id: hook(module)}}``, run around
    that callable's forward and backward at every warm-up iteration and at capture, outside the
    capture (a hook that returns a value raises); ``retain_graph_in_backward``;
    ``clone_param_grads_on_return=False`` hands the parameter grads on uncloned (the module
    docstring: kept, or added into ``.grad`` inside the graph). ``_reuse_graph_input_output_buffers``
    applies only with ``_order``. ``pool``: a pool of the backend (``None``: a new one shared by
    all the graphs made here). FP8 is refused. Returns one graphed callable for a single callable,
    else a :class:`GraphedCallables` tuple. What is ours alone: ``options`` (:class:`GraphOptions`).

    Phases: normalise the samples, lay out the order, share static inputs, warm up, capture along
    the order, wrap.
    """
    _refuse_fp8(fp8_enabled, fp8_calibrating, fp8_weight_caching, enabled, calibrating,
                cache_quantized_params)
    options = options or GraphOptions()
    single = not isinstance(modules, tuple)
    if single:
        modules, sample_args = (modules,), (sample_args,)
        sample_kwargs = None if sample_kwargs is None else (sample_kwargs,)
    sample_args, sample_kwargs = _normalise_samples(sample_args, sample_kwargs)
    training = _check_callables(modules)
    hooks = _capture_time_hooks(capture_time_hooks, len(modules))
    layout = _layout(_order, _num_layers_per_chunk, len(modules), len(sample_args))
    reuse = bool(_reuse_graph_input_output_buffers and layout is not None and training)
    backend = options.backend if options.backend is not None else _cuda_backend(
        sample_args, sample_kwargs)
    if reuse:
        share_static_inputs(layout, sample_args, sample_kwargs)
    if pool is None:
        pool = backend.new_pool()
    forwards, passes = _capture_sequence(modules, layout)
    func_of = dict(forwards)
    states = _runners(func_of, layout, sample_args, sample_kwargs,
                      not clone_param_grads_on_return and training, options.lend_grads_to_eager)
    run = _Passes(func_of, states, sample_args, sample_kwargs, training, allow_unused_input,
                  retain_graph_in_backward, hooks)
    # warmup and capture draw nothing the caller should see: the generators are put back after
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        _warm_up(backend, run, passes, num_warmup_iters, pre_warmup_hook, post_warmup_hook)
        _capture(backend, pool, passes, run, options.scratch or {}, options.grads_owned)
    results = _wrap(func_of, states, layout)
    if single:
        return results[0]
    return GraphedCallables(results, backend=backend.name, pool=pool, states=states,
                            static_input_sets=_distinct_input_sets([r.static_inputs for r in states]))


def _layout(order, layers_per_chunk, callables: int, samples: int) -> OrderLayout | None:
    if order is not None:
        return order_layout(order, layers_per_chunk, callables, samples)
    if samples != callables:
        raise ValueError(f"make_graphed_callables: without _order, sample_args needs one entry "
                         f"per callable ({callables}), got {samples}")
    return None


CAPTURE_TIME_HOOKS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")


def _capture_time_hooks(hooks, count: int) -> list[dict[str, list[Callable]]]:
    """TE's ``capture_time_hooks``, checked as TE checks them: one entry per callable."""
    if hooks is None:
        return [{name: [] for name in CAPTURE_TIME_HOOKS} for _ in range(count)]
    if len(hooks) != count:
        raise ValueError(f"make_graphed_callables: capture_time_hooks has {len(hooks)} entries, "
                         f"but there are {count} callables")
    found = []
    for entry in hooks:
        entry = entry or {}
        unexpected = set(entry) - set(CAPTURE_TIME_HOOKS)
        if unexpected:
            raise ValueError(f"make_graphed_callables: unexpected keys in capture_time_hooks "
                             f"{sorted(unexpected)}; allowed: {list(CAPTURE_TIME_HOOKS)}")
        found.append({name: list(entry.get(name, {}).values()) for name in CAPTURE_TIME_HOOKS})
    return found


def _refuse_fp8(*values) -> None:
    if any(v for v in values if not isinstance(v, (tuple, list))) or \
            any(any(v) for v in values if isinstance(v, (tuple, list))):
        raise NotImplementedError("make_graphed_callables: FP8 (enabled, calibrating, "
                                  "cache_quantized_params and their fp8_* forms) needs "
                                  "TransformerEngine's own make_graphed_callables on a GPU; "
                                  "mhc_cg's has none: leave them off")


def _cuda_backend(sample_args: list, sample_kwargs: list) -> GraphBackend:
    """CUDA graphs for inputs on a GPU; CPU tensors are refused (a CUDA graph would record no
    kernel and its replays would return stale outputs): their backend is given."""
    first = next((t for a, k in zip(sample_args, sample_kwargs) for t in flat_tensors(a, k)), None)
    if first is None or first.device.type != "cuda":
        raise ValueError("make_graphed_callables: inputs off a GPU and no backend: give one, "
                         "GraphOptions(backend=...) (the CPU emulation of CUDA graphs: "
                         "mhc_cg.lab.emulation.tape.TapeBackend())")
    return CudaBackend()


def _runners(func_of: dict, layout: OrderLayout | None, sample_args: list, sample_kwargs: list,
             keep_param_grads: bool, lend_to_eager: bool = False) -> list[GraphedState]:
    """One :class:`GraphedState` per sample: its static inputs are the sample's tensors; with
    ``keep_param_grads``, the parameters whose grads it keeps (those no other state holds)."""
    states, lent = [], LentGrads()  # the grad buffers these callables share, lent among them
    for index in range(len(sample_args)):
        func = func_of[index]
        module = isinstance(func, torch.nn.Module)
        params = tuple(func.parameters()) if module else ()
        label = f"#{index}" if layout is None else label_of(layout, index)
        inputs = flat_tensors(sample_args[index], sample_kwargs[index])
        for t in (*inputs, *params, *(func.buffers() if module else ())):
            static_buffer(t)
        states.append(GraphedState(label, list(sample_kwargs[index]), inputs, params,
                                   lend_to_eager=lend_to_eager, lent=lent))
    if keep_param_grads:
        holders = Counter(id(p) for state in states for p in state.params)
        for state in states:
            first = len(state.static_inputs)
            trained = [(first + j, p) for j, p in enumerate(state.params) if p.requires_grad]
            state.grads_into = {i: p for i, p in trained if p.grad is not None}
            state.kept_grads = {i: p for i, p in trained
                                if p.grad is None and holders[id(p)] == 1}
    return states


def _wrap(func_of: dict, states: list[GraphedState], layout: OrderLayout | None) -> list:
    """Modules stay modules without an order (their forward replays); otherwise plain functions."""
    results = []
    for index, state in enumerate(states):
        graphed = graphed_function(state)
        func = func_of[index]
        if layout is None and isinstance(func, torch.nn.Module):
            func.forward = graphed_forward(func, graphed)
            results.append(func)
        else:
            results.append(graphed)
    return results


def _normalise_samples(sample_args, sample_kwargs) -> tuple[list[tuple], list[dict]]:
    """One tuple of args and one dict of kwargs per sample, holding only tensors."""
    sample_args = [tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in sample_args]
    sample_kwargs = [dict(k) for k in sample_kwargs] if sample_kwargs is not None \
        else [{} for _ in sample_args]
    if len(sample_kwargs) != len(sample_args):
        raise ValueError(f"make_graphed_callables: sample_kwargs has {len(sample_kwargs)} entries, "
                         f"sample_args {len(sample_args)}; they must match")
    for i, (args, kwargs) in enumerate(zip(sample_args, sample_kwargs)):
        bad = [type(v).__name__ for v in flat_tensors(args, kwargs) if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"make_graphed_callables: sample_args[{i}]/sample_kwargs[{i}] may hold "
                            f"only tensors (a graph's inputs are static buffers), found {bad}")
    return sample_args, sample_kwargs


def _capture_sequence(callables: tuple, layout: OrderLayout | None
                      ) -> tuple[list[tuple[int, Callable]], list[tuple[str, int, int]]]:
    """``(sample index, callable)`` in forward order, and the capture sequence of passes:
    ``(kind, sample index, callable index)``."""
    if layout is None:
        forwards = [(i, callables[i]) for i in range(len(callables))]
        passes = [("fwd", i, i) for i in range(len(callables))] + \
                 [("bwd", i, i) for i in reversed(range(len(callables)))]
        return forwards, passes
    forwards, passes = [], []
    for is_forward, chunk, mb in layout.passes():
        layers = range(layout.layers_per_chunk[chunk])
        for layer in (layers if is_forward else reversed(layers)):
            index, which = layout.sample_index(chunk, mb, layer), layout.callable_index(chunk, layer)
            if is_forward:
                forwards.append((index, callables[which]))
            passes.append(("fwd" if is_forward else "bwd", index, which))
    return forwards, passes


class _Passes:
    """The forward and backward passes of the samples, as warm-up runs them eagerly and capture
    records them, with the capture-time hooks around each (outside any capture)."""

    def __init__(self, func_of: dict, states: list[GraphedState], sample_args: list,
                 sample_kwargs: list, training: bool, allow_unused: bool, retain_graph: bool,
                 hooks: list[dict[str, list[Callable]]]):
        self.func_of, self.states = func_of, states
        self.sample_args, self.sample_kwargs = sample_args, sample_kwargs
        self.training, self.allow_unused, self.retain_graph = training, allow_unused, retain_graph
        self.hooks = hooks

    def hook(self, which: int, name: str, index: int) -> None:
        for hook in self.hooks[which][name]:
            if hook(self.func_of[index]) is not None:
                raise RuntimeError(f"make_graphed_callables: capture_time_hooks {name} must not "
                                   f"return a value")

    def forward(self, index: int, scratch: torch.Tensor | None = None,
                grads_owned: bool = False) -> Any:
        """Sample ``index``'s forward; with its ``scratch`` (Note [forward scratch]) and, at
        capture, ``grad_owned`` (:class:`GraphOptions`)."""
        kwargs = dict(self.sample_kwargs[index])
        if scratch is not None:
            kwargs["scratch"] = scratch
        if grads_owned:
            kwargs["grad_owned"] = True
        return self.func_of[index](*self.sample_args[index], **kwargs)

    def grads(self, outputs: list, index: int, grad_outputs: list | None) -> list:
        return _grads_of(outputs, self.states[index].surface, grad_outputs, self.allow_unused,
                         self.retain_graph)

    def warm_up(self, passes: list[tuple[str, int, int]]) -> None:
        """One eager iteration of every pass in the capture order (lazy library setup never
        happens inside a capture)."""
        outputs: dict[int, list] = {}
        for kind, index, which in passes:
            if kind == "fwd":
                self.hook(which, "forward_pre_hooks", index)
                out = tree_flatten(self.forward(index))[0]
                self.hook(which, "forward_hooks", index)
                if self.training:
                    outputs[index] = out
                del out
            elif self.training:
                self.hook(which, "backward_pre_hooks", index)
                self.grads(outputs.pop(index), index, None)
                self.hook(which, "backward_hooks", index)


def _warm_up(backend: GraphBackend, run: _Passes, passes, iterations: int,
             before: Callable[[], None] | None, after: Callable[[], None] | None) -> None:
    """``iterations`` eager runs of every pass, between the pre- and post-warm-up hooks."""
    with backend.warmup():
        if before is not None:
            before()
        for _ in range(iterations):
            run.warm_up(passes)
        if after is not None:
            after()
    backend.synchronize()


def _capture(backend: GraphBackend, pool, passes, run: _Passes, scratch: Mapping[int, int],
             grads_owned: bool) -> None:
    """Capture every forward and backward graph in ``passes``' order, all in ``pool``."""
    shared_grad_outputs: dict[tuple, torch.Tensor] = {}
    made_scratch: dict[int, torch.Tensor] = {}
    states, sample_args = run.states, run.sample_args
    for kind, index, which in passes:
        state = states[index]
        if kind == "fwd":
            run.hook(which, "forward_pre_hooks", index)
            state.fwd_graph = backend.new_graph(pool=pool)
            with state.fwd_graph.capture(), region("forward"):
                if index in scratch:  # the pool's first, before the callable allocates
                    made_scratch[index] = _new_scratch(scratch[index], sample_args[index])
                outputs = run.forward(index, made_scratch.get(index), grads_owned)
            run.hook(which, "forward_hooks", index)
            state.layouts = [buffer_layout(t) for t in state.surface]
            flat, state.output_spec = tree_flatten(outputs)
            if not all(isinstance(o, torch.Tensor) for o in flat):
                raise TypeError(f"make_graphed_callables: callable for sample {state.label} "
                                f"returned non-tensor outputs {[type(o).__name__ for o in flat]}")
            state.static_outputs = flat
            state.differentiable = [run.training and o.requires_grad for o in flat]
            saved = saved_storages(flat) if run.training else set()
            state.saved_outputs = [i for i, o in enumerate(flat) if storage_id(o) in saved]
            if index in made_scratch and any(storage_id(flat[i]) == storage_id(made_scratch[index])
                                             for i in state.saved_outputs):
                raise ValueError(f"make_graphed_callables: sample {state.label} wrote an output "
                                 f"its backward reads into its forward scratch, which that "
                                 f"backward's capture takes back")
            continue
        if not run.training:
            continue
        run.hook(which, "backward_pre_hooks", index)
        made = made_scratch.pop(index, None)
        if made is not None:  # Note [forward scratch]: back to the pool before this capture
            state.scratch = state.fwd_graph.free_early(made)
        diff_outputs = [o for o, d in zip(state.static_outputs, state.differentiable) if d]
        wanted = [t for t in state.surface if t.requires_grad]
        state.grad_buffers = _grad_output_buffers(state, shared_grad_outputs)
        state.static_grad_outputs = [None if b is None else b.tensor for b in state.grad_buffers]
        if not diff_outputs or not wanted:
            state.static_grad_inputs = [None] * len(state.surface)
        else:
            _capture_backward(backend, pool, state, run, diff_outputs, index)
        run.hook(which, "backward_hooks", index)
        if made is not None:
            state.static_outputs = [_over(state.scratch, o) if storage_id(o) == storage_id(made)
                                    else o for o in state.static_outputs]
        del made, diff_outputs
    backend.synchronize()


def _capture_backward(backend: GraphBackend, pool, state: GraphedState, run: _Passes,
                      diff_outputs: list, index: int) -> None:
    state.bwd_graph = backend.new_graph(pool=pool)
    with state.bwd_graph.capture(), region("backward"):
        grads = run.grads(diff_outputs, index,
                          [g for g in state.static_grad_outputs if g is not None])
        _accumulate_into_grads(state, grads)
    # replay_backward clones them before any other graph runs: the pool may have them back;
    # kept parameter grads stay this graph's own (they become ``.grad``)
    made = state.bwd_graph.made_storages
    state.kept_grads = {i: p for i, p in state.kept_grads.items()
                        if grads[i] is not None and storage_id(grads[i]) in made}
    released = state.bwd_graph.release_outputs(
        [None if i in state.kept_grads else g for i, g in enumerate(grads)])
    state.static_grad_inputs = [grads[i] if i in state.kept_grads else r
                                for i, r in enumerate(released)]


def _new_scratch(numel: int, sample: tuple) -> torch.Tensor:
    """A forward scratch in the dtype and on the device of the sample's first tensor."""
    first = next(t for t in flat_tensors(sample, {}) if t.is_floating_point())
    return torch.empty(numel, dtype=first.dtype, device=first.device)


def _over(memory: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a view of a scratch) as the same view of ``memory`` (what the scratch became)."""
    return memory.view(view.dtype).as_strided(view.size(), view.stride(), view.storage_offset())


def _accumulate_into_grads(state: GraphedState, grads: list) -> None:
    """Inside a backward capture: add each parameter grad of ``state.grads_into`` into its
    ``.grad`` and drop it, so that its block goes back to the pool.

    Note [grads accumulated inside the graph]: a parameter whose ``.grad`` is a persistent buffer
    when the graphs are captured (the optimizer's flat gradient buffer) gets its gradient added
    there by the backward graph itself, as Megatron's gradient accumulation fusion writes weight
    grads into ``main_grad``: no grad leaves the pool, no eager add follows. The graph writes
    that buffer's address, so it must stay ``.grad`` (zeroed in place, never replaced or set to
    ``None``: :class:`~mhc_cg.modes.lifecycle.CapturedState` refuses a forward otherwise).
    """
    with torch.no_grad():
        for i, param in state.grads_into.items():
            if grads[i] is not None:
                param.grad.add_(grads[i])
                grads[i] = None


def _grads_of(outputs: list, surface: list[torch.Tensor], grad_outputs: list | None,
              allow_unused: bool, retain_graph: bool = False) -> list[torch.Tensor | None]:
    """Grads of ``outputs`` w.r.t. the members of ``surface`` requiring grad, ``None`` elsewhere."""
    diff_outputs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    wanted = [t for t in surface if t.requires_grad]
    if not diff_outputs or not wanted:
        return [None] * len(surface)
    if grad_outputs is None:
        grad_outputs = [torch.zeros_like(o) for o in diff_outputs]
    grads = iter(torch.autograd.grad(diff_outputs, wanted, grad_outputs, only_inputs=True,
                                     allow_unused=allow_unused, retain_graph=retain_graph))
    return [next(grads) if t.requires_grad else None for t in surface]


def _grad_output_buffers(state: GraphedState, shared: dict) -> list[GradBuffer | None]:
    """Static grad-output buffers of ``state``'s differentiable outputs, shared by every backward
    graph: a backward reads its buffers only while it replays, and each replay first copies its
    incoming grads in. The n-th output of a (shape, dtype, stride, device) in one graph gets the
    n-th buffer of that key."""
    buffers, seen = [], Counter()
    for output, differentiable in zip(state.static_outputs, state.differentiable):
        if not differentiable:
            buffers.append(None)
            continue
        key = buffer_key([output])
        slot = (key, seen[key])
        seen[key] += 1
        if slot not in shared:
            shared[slot] = state.lent.add(static_buffer(torch.empty_like(output)))
        buffers.append(shared[slot])
    return buffers
