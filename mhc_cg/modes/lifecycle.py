"""The model as one training mode runs it (:class:`ModeModel`), and what a capture freezes.

Every tool (train, compare, bench, cost, probe, the pipeline driver) reads a run through
:class:`ModeModel`: ``prepare``, ``forward``, ``release_pending``, its graphs (named), its static
runtime and static buffer bytes, ``describe``. Eager modes have no graphs; the interface is the same.

A capture freezes Python-level choices into the graph: the dropout probability and kind, the
parameters' dtype, device and addresses, the input shapes. :class:`CapturedState` records them
when the graphs are captured and :meth:`CapturedState.check` refuses a training forward once any
of them changed, naming the field (the graph would otherwise keep applying the old value, silently).

A forward with no backward to come (``model.eval()``, ``torch.no_grad()``) never replays a graph:
:func:`runs_graphs` is false and the graphed models run the plain model eagerly, so evaluation
claims no persistent set and leaves every pool's replay order where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable
import torch
from torch import Tensor

from mhc_cg.core.errors import StaleCaptureError
from mhc_cg.core.storage import distinct_storage_bytes, storage_id
from mhc_cg.model import MHCGPT, microbatch_loss
from mhc_cg.graphs import GraphBackend, GraphedCallables
from mhc_cg.graphs.te import GraphAPI
from mhc_cg.graphs.capture import Graph, Pool
from mhc_cg.graphs.static_inputs import input_problem
from mhc_cg.modes.plan import CapturePlan
from mhc_cg.runtime.static import StaticRecompute


def warmups(api: GraphAPI) -> int:
    """Warm-up iterations before capture: the backend's (none on the recording backend); TE's
    function finds which parameters get grads in its first, so it warms up at least once."""
    return max(1, api.backend.warmup_iters) if api.te is not None else api.backend.warmup_iters


def one_microbatch(api: GraphAPI, callables: int) -> dict:
    """TE's arguments for graphs serving one microbatch at a time, as Megatron's helper passes
    them without a pipeline: the order ``[1, -1]`` over one chunk, buffers shared along it (TE
    then keeps one grad-output buffer per shape, not one per callable). mhc_cg's function does
    that without an order."""
    if api.te is None:
        return {}
    return {"_order": [1, -1], "_num_layers_per_chunk": [callables],
            "_reuse_graph_input_output_buffers": True}


class ModeModel:
    """``model`` as the mode of ``plan`` trains it; ``forward(input_ids, seed) -> logits``.

    ``prepare(device)`` does everything that allocates or captures. ``new_api()``: the capture
    API the mode's graphs go through (its run's: :func:`mhc_cg.training.run.prepare` makes it,
    over the cost model's recording backend where that records). Subclasses set
    ``graphed_callables`` (one per ``graph_labels`` entry) and ``runtime`` when they have them.
    """

    graphed = False  # whether the mode replays graphs
    captures_iteration = False  # a training step is run_iteration(batches), not forward + backward

    def __init__(self, model: MHCGPT, plan: CapturePlan, *, micro_batch_size: int,
                 new_api: Callable[[], GraphAPI] | None = None):
        self.model, self.plan, self.micro_batch_size = model, plan, micro_batch_size
        self.new_api = new_api
        self._api: GraphAPI | None = None
        self.graphed_callables: tuple = ()
        self.graph_labels: list[str] = []  # what each graphed callable holds, e.g. "L3.attn"
        self.runtime: StaticRecompute | None = None
        self.captured: CapturedState | None = None

    # -- running --------------------------------------------------------------------------------
    def prepare(self, device: torch.device | str) -> "ModeModel":
        return self

    def forward(self, input_ids: Tensor, dropout_seed: Tensor | None) -> Tensor:
        raise NotImplementedError

    def __call__(self, input_ids: Tensor, dropout_seed: Tensor | None = None) -> Tensor:
        return self.forward(input_ids, dropout_seed)

    def microbatch_loss(self, input_ids: Tensor, targets: Tensor, dropout_seed: Tensor | None,
                        kernels: str, num_microbatches: int) -> Tensor:
        """A training step's microbatch: its share of the loss
        (:func:`~mhc_cg.model.microbatch_loss`) over logits nobody else reads, so a mode may put
        them where it likes."""
        return microbatch_loss(self(input_ids, dropout_seed), targets, kernels, num_microbatches)

    def train(self, mode: bool = True) -> "ModeModel":
        """``train()``/``eval()`` reach the wrapped model, so an eval forward never replays a
        training graph."""
        self.model.train(mode)
        return self

    def eval(self) -> "ModeModel":
        return self.train(False)

    def release_pending(self) -> int:
        """Give back what training forwards whose backward never came still hold (an aborted step);
        returns how many were released (0 or more). Every training step calls it first."""
        released = self.runtime.release_pending() if self.runtime is not None else 0
        return max(released, rewind_replay_order(self.graphed_callables))

    def graph_seed(self, input_ids: Tensor, dropout_seed: Tensor | None) -> Tensor:
        """The dropout seed a training forward's graphs read: the one given, checked like every
        graph input (an int64 scalar on the model's device); with none given, one drawn as the
        plain model draws it (a zero when dropout is off)."""
        seed = self.model.dropout_seed_for(input_ids, dropout_seed)
        device = self.model.embedding.weight.device
        if seed is None:
            return torch.zeros((), dtype=torch.int64, device=device)
        problem = input_problem("dropout_seed", seed, (), torch.int64, device)
        if problem is not None:
            raise ValueError(problem)
        return seed

    def capture_api(self) -> GraphAPI:
        """What captures go through: the plan's ``make_graphed_callables`` (TE's for ``te``,
        else mhc_cg's) and its backend, made once (``new_api``)."""
        if self._api is None:
            if self.new_api is None:
                raise RuntimeError(f"{type(self).__name__}: no capture API: build it from its run "
                                   f"(mhc_cg.training.run.prepare), or give new_api")
            self._api = self.new_api()
        return self._api

    def capture_backend(self) -> GraphBackend:
        """The primitive the graphs are captured on: the runtime's own graphs go through it."""
        return self.capture_api().backend

    # -- what tools read ------------------------------------------------------------------------
    def named_graphs(self) -> list[tuple[str, str, Graph]]:
        """``(name, kind, graph)`` for every captured graph: each graphed callable's forward and
        backward graph, then the recompute graphs; ``kind`` is ``forward``, ``backward`` or
        ``recompute``."""
        found = []
        for label, state in zip(self.graph_labels, self._graphed_states()):
            found += [(f"{label} fwd", "forward", state.fwd_graph),
                      (f"{label} bwd", "backward", state.bwd_graph)]
        found = [entry for entry in found if entry[2] is not None] or self._te_named_graphs()
        if self.runtime is not None:
            found += [(f"recompute block {block} set {pset}", "recompute", graph)
                      for (block, pset), graph in self.runtime.recompute_graphs.items()]
        return found

    def _te_named_graphs(self) -> list[tuple[str, str, Graph]]:
        """TE's graphs, where its ``torch.cuda`` was ours: its forwards in order, then its
        backwards in reverse (its capture order over one microbatch)."""
        callables = self.graphed_callables
        if not isinstance(callables, GraphedCallables) or callables.states is not None:
            return []
        graphs, labels = callables.graphs(), self.graph_labels
        if len(graphs) != 2 * len(labels):
            return [(f"te graph {i}", "forward", g) for i, g in enumerate(graphs)]
        return ([(f"{label} fwd", "forward", g) for label, g in zip(labels, graphs)]
                + [(f"{label} bwd", "backward", g)
                   for label, g in zip(reversed(labels), graphs[len(labels):])])

    def graphs(self) -> list[Graph]:
        """Every captured graph, in :meth:`named_graphs` order."""
        return [graph for _, _, graph in self.named_graphs()]

    def static_buffer_bytes(self) -> int | None:
        """Bytes of the buffers allocated for the graphed callables' static inputs and grad
        outputs, outside the pools, once per distinct storage (an input that aliases the static
        runtime's arena or persistent sets adds nothing); ``None`` without graphed callables."""
        callables = self.graphed_callables
        if not isinstance(callables, GraphedCallables) or not callables:
            return None
        return distinct_storage_bytes(callables.static_tensors(), self._runtime_storages())

    def _runtime_storages(self) -> set[int]:
        """Storages of the static runtime's arena and persistent sets (reported on their own)."""
        if self.runtime is None:
            return set()
        rt = self.runtime
        tensors = [t for pset in rt.sets.all_sets() for t in pset.tensors()]
        if rt.arena.buffer is not None:
            tensors.append(rt.arena.buffer)
        return {storage_id(t) for t in tensors}

    def _graphed_states(self) -> list:
        """The graphed callables' static state (none under TransformerEngine, which keeps its own)."""
        callables = self.graphed_callables
        return (callables.states or []) if isinstance(callables, GraphedCallables) else []

    def describe(self) -> dict:
        """Sizes for reports: scopes, graphs and, with a static runtime, its arena and sets."""
        info = {"scopes": list(self.plan.scopes), "graphs": len(self.graphs())}
        if self.runtime is not None:
            rt = self.runtime
            info.update(block_size=rt.layout.block_size, arena_bytes=rt.arena.nbytes,
                        persistent_bytes_per_microbatch=rt.sets.nbytes_per_set,
                        persistent_sets=rt.sets.capacity,
                        recompute_graphs=len(rt.recompute_graphs))
        return info


def rewind_replay_order(graphed_callables) -> int:
    """Put the replay position of ``graphed_callables``' pool back at its first graph, after
    training forwards whose backward never came; returns 1 if it had moved, else 0."""
    pool = graphed_callables.pool if isinstance(graphed_callables, GraphedCallables) else None
    if not isinstance(pool, Pool) or pool.order.cursor == 0:
        return 0
    pool.order.rewind()
    return 1


def runs_graphs(model: MHCGPT) -> bool:
    """A forward replays the captured (training) graphs only when it trains and records autograd."""
    return model.training and torch.is_grad_enabled()


@dataclass(frozen=True)
class CapturedState:
    """The Python-level values the captured graphs baked in."""

    hidden_dropout: float
    dropout_impl: str
    dtype: torch.dtype
    device: torch.device
    param_ptrs: tuple[int, ...]
    grad_ptrs: tuple[int | None, ...]  # the .grad buffers backward graphs may add into

    @classmethod
    def of(cls, model: MHCGPT) -> "CapturedState":
        params = list(model.parameters())
        return cls(model.cfg.hidden_dropout, model.cfg.dropout_impl, params[0].dtype,
                   params[0].device, tuple(p.data_ptr() for p in params),
                   tuple(None if p.grad is None else p.grad.data_ptr() for p in params))

    def check(self, model: MHCGPT) -> None:
        """Raise :class:`StaleCaptureError` naming the first field that changed since capture."""
        now = CapturedState.of(model)
        rebuild = "or build the model again (the graphs are captured in prepare())"
        for name, field in (("hidden_dropout", "model.hidden_dropout"),
                            ("dropout_impl", "model.dropout_impl"), ("dtype", "train.dtype"),
                            ("device", "train.device")):
            old, new = getattr(self, name), getattr(now, name)
            if old != new:
                raise StaleCaptureError(
                    f"{field}: changed from {old!r} to {new!r} after the graphs were captured; "
                    f"they still apply {old!r}; set it back, {rebuild}")
        if now.param_ptrs != self.param_ptrs:
            raise StaleCaptureError(
                "model parameters: replaced or moved since the graphs were captured (model.to(), "
                "a new nn.Parameter, load_state_dict(assign=True)); the graphs read the old "
                "addresses; copy new values in place (param.data.copy_(...)), " + rebuild)
        if any(then is not None and then != grad for then, grad in zip(self.grad_ptrs,
                                                                        now.grad_ptrs)):
            raise StaleCaptureError(
                "parameter gradients: set to None or replaced since the graphs were captured; "
                "the backward graphs add into the old buffers "
                "(Note [grads accumulated inside the graph]); zero them in place "
                "(optimizer.zero_grad()), " + rebuild)
