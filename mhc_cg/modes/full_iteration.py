"""Full-iteration capture: one training iteration, one graph (mode ``graphed_full_static``).

Megatron's ``FullCudaGraphWrapper`` captures ``forward_backward_func``: every microbatch's
forward, loss and backward in one CUDA graph. :class:`FullIterationModel` does the same around
another mode's model: ``graphed_full_static`` around :class:`GraphedStaticModel` with nothing
captured of its own (arena, persistent sets and recompute kernels, replayed whole); the lab's
``graphed_full`` around eager block recompute (:mod:`mhc_cg.lab.references.graphed_full`: the
capture swallows the recompute's frees and re-allocations,
Note [a capture frees and re-allocates its own storages]).

The optimizer stays apart, eager, as Megatron's ``OptimizerCudaGraphWrapper`` is opt-in: its step
is a few dozen fused launches (:mod:`mhc_cg.training.optimizer`), and captured it would keep the
learning rate and fp16's loss scale as they were at capture, where both change on the host.

A step copies each microbatch's inputs, targets and dropout seed into static buffers (Megatron's
``StaticBufferLoader``), replays, and reads the summed loss from the graph's output: the graph
holds no host synchronisation (the capture guard refuses one) and the gradients land in the
parameters' ``.grad`` buffers, as eager accumulation leaves them.

Note [warm-up, then capture]: before capture the iteration runs eagerly ``backend.warmup_iters``
times (library handles, Triton's compiles; a CUDA capture may not allocate them), and the
gradients it accumulated are zeroed; the capture itself leaves them as they were
(Note [a capture runs nothing], in :mod:`~mhc_cg.lab.emulation.tape`), so training starts from
zero gradients.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from mhc_cg.core.regions import region
from mhc_cg.graphs.te import GraphAPI
from mhc_cg.graphs.capture import Graph
from mhc_cg.graphs.static_inputs import check_input, load_input, static_buffer
from mhc_cg.modes.graphed_static import GraphedStaticModel
from mhc_cg.modes.lifecycle import CapturedState, ModeModel
from mhc_cg.modes.plan import CapturePlan

Batch = tuple[Tensor, Tensor, Tensor]  # (input ids [b, s], targets [b, s], dropout seed [])


class FullIterationModel(ModeModel):
    """``inner_type``'s model, its training iteration captured whole (see the module docstring).

    ``run_iteration(batches)`` trains; ``forward`` runs the inner mode eagerly (evaluation, or a
    forward outside the iteration). ``step_loop``: the training step's microbatch loop (the
    session's, :func:`mhc_cg.training.session.microbatch_loop` with its optimizer's backward),
    called as ``step_loop(model, batch, count)``: what the capture records.
    """

    graphed = True
    captures_iteration = True
    inner_type: type[ModeModel]

    def __init__(self, model, plan: CapturePlan, *, micro_batch_size: int,
                 new_api: Callable[[], GraphAPI] | None = None, step_loop: Callable | None = None):
        super().__init__(model, plan, micro_batch_size=micro_batch_size, new_api=new_api)
        self.step_loop = step_loop
        self.inner = self.inner_type(model, plan, micro_batch_size=micro_batch_size,
                                     new_api=new_api)
        self.graph: Graph | None = None
        self.loss_sum: Tensor | None = None
        self.inputs = self.targets = self.seeds = None

    def prepare(self, device: torch.device | str) -> "FullIterationModel":
        self.inner.prepare(device)
        self.runtime = self.inner.runtime
        n, b, s = self.plan.iteration_microbatches, self.micro_batch_size, self.model.cfg.seq_length
        self.inputs = static_buffer(torch.zeros((n, b, s), dtype=torch.int64, device=device))
        self.targets = static_buffer(torch.zeros((n, b, s), dtype=torch.int64, device=device))
        self.seeds = static_buffer(torch.zeros(n, dtype=torch.int64, device=device))
        backend = self.capture_backend()
        with backend.warmup():
            for _ in range(backend.warmup_iters):
                self._iteration()
                self.model.zero_grad(set_to_none=False)
        backend.synchronize()
        graph = backend.new_graph()
        with graph.capture():
            self.loss_sum = self._iteration()
        self.graph = graph
        self.captured = CapturedState.of(self.model)
        return self

    def _iteration(self) -> Tensor:
        """Every microbatch's forward, loss and backward over the static batches: the training
        step's own loop (the one it was made with); returns the summed loss."""
        if self.step_loop is None:
            raise RuntimeError(f"{self.plan.mode}: a full-iteration mode captures the training "
                               f"step's loop; build it with TrainSession.build")
        return self.step_loop(self.inner, lambda i: (self.inputs[i], self.targets[i],
                                                     self.seeds[i]), len(self.seeds))

    def run_iteration(self, batches: Sequence[Batch]) -> Tensor:
        """Copy ``batches`` (one per microbatch) into the static buffers and replay the iteration;
        returns the summed loss, a tensor of the graph's, valid until the next replay."""
        if self.graph is None:
            raise RuntimeError(f"{self.plan.mode}: prepare(device) must run before run_iteration")
        self.captured.check(self.model)
        if len(batches) != len(self.seeds):
            raise ValueError(f"{self.plan.mode}: the iteration was captured for {len(self.seeds)} "
                             f"microbatches, got {len(batches)}")
        with torch.no_grad(), region("forward"), region("copy", "static inputs"):
            for i, (inputs, targets, seed) in enumerate(batches):
                for name, given, static in (("inputs", inputs, self.inputs[i]),
                                            ("targets", targets, self.targets[i])):
                    check_input(f"microbatch {i}'s {name}", given, static)
                    load_input(static, given)
                self.seeds[i].copy_(self.graph_seed(inputs, seed))
        with region("iteration"):
            self.graph.replay()
        return self.loss_sum

    def forward(self, input_ids: Tensor, dropout_seed: Tensor | None = None) -> Tensor:
        return self.inner(input_ids, dropout_seed)

    def release_pending(self) -> int:
        return self.inner.release_pending()

    def named_graphs(self) -> list[tuple[str, str, Graph]]:
        return [] if self.graph is None else [("iteration", "iteration", self.graph)]

    def static_buffer_bytes(self) -> int | None:
        buffers = (self.inputs, self.targets, self.seeds)
        return None if self.graph is None else sum(t.nbytes for t in buffers)

    def describe(self) -> dict:
        return {**self.inner.describe(), "scopes": list(self.plan.scopes),
                "graphs": len(self.graphs())}


class FullStaticModel(FullIterationModel):
    """``graphed_full_static``: the static runtime inside one captured iteration."""

    inner_type = GraphedStaticModel
