"""An MHCGPT trained with static-buffer mHC recompute, its sublayers and recompute in graphs.

The capture plan (:mod:`mhc_cg.modes.plan`, resolved from ``cuda_graph_scope``) decides what is captured:

* ``attn`` / ``mlp``: the whole attention / dense MLP sublayer, mHC ops included, as one graphed
  callable (forward graph + backward graph) whose mHC ops save into arena slots;
* ``moe_router`` [+ ``moe_preprocess``]: the MoE MLP sublayer's mHC ops before F and the router
  [and the dispatcher's preprocess] are captured; capture ends with megatron-core's
  ``MoECudaGraphPartialCaptureSignal`` and the rest (dispatch, experts, mHC ops after F) runs eagerly
  from a ``MoECudaGraphTensorStore`` and writes its own arena segment;
* ``mhc_recompute``: the block recompute, one graph per (recompute block, persistent slot set).
  They run one at a time and leave nothing allocated. With every sublayer graphed (one fixed
  replay order per step) they are captured into the sublayer graphs' pool, each where it replays;
  otherwise they get one pool of independent graphs of their own.

What is not captured runs eagerly through the same runtime and writes the same slots, so every
combination of scopes computes the same numbers, bit for bit, as eager without recompute.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.model import MHCGPT, microbatch_loss
from mhc_cg.config.choices import RECOMPUTE_SCOPE
from mhc_cg.graphs.graphed_callables import GraphOptions
from mhc_cg.graphs.te import GraphAPI
from mhc_cg.graphs.replay_state import grad_output_buffer
from mhc_cg.modes.lifecycle import (CapturedState, ModeModel, one_microbatch,
                                            runs_graphs, warmups)
from mhc_cg.modes.plan import CapturePlan
from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.runtime.graphable import (SlotSublayer, graphable_sublayers, moe_tail,
                                                sublayer_label)
from mhc_cg.runtime.recompute_captures import (RecomputeCaptures,
                                                         capture_recompute_graphs,
                                                         warm_up_recompute)
from mhc_cg.runtime.static import (StaticRecompute, SublayerGraph,
                                             build_static_recompute)
from mhc_cg.core.storage import own_version_alias


def embed_buffers(model: MHCGPT, runtime: StaticRecompute,
                  input_ids: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Where the embedding's stream expand writes the chunk input (the persistent set the first
    graph reads), and its backward the embeddings' gradient: the arena, idle once block 0's
    backward is done (:meth:`Arena.borrow`)."""
    lead, c = tuple(input_ids.shape[::-1]), model.cfg.hidden_size
    return (runtime.next_input_buffer((*lead, model.cfg.num_streams * c)),
            runtime.arena.borrow((*lead, c), model.embedding.weight.dtype))


class GraphedStaticModel(ModeModel):
    """``model`` with static-buffer recompute; what ``plan`` names runs as graphs.

    ``prepare()`` does everything that allocates: arena layout, persistent sets, capture. After
    it, a training step allocates nothing static and moves no slot. ``capacity`` is how many
    microbatches may be in flight between a forward and its backward (1 without pipelining).
    """

    graphed = True

    def __init__(self, model: MHCGPT, plan: CapturePlan, *, micro_batch_size: int,
                 capacity: int = 1, block_size: int | None = None,
                 new_api: Callable[[], GraphAPI] | None = None):
        if capacity > 1 and plan.graphed_sublayers:
            # one graph per sublayer serves every microbatch: a second forward replay before the
            # first one's backward would overwrite the activations that backward reads
            raise StaticRecomputeError(
                f"capacity={capacity} microbatches in flight with graphed sublayers "
                f"{[s for s in plan.scopes if s != RECOMPUTE_SCOPE]}: each sublayer has one graph "
                f"here, valid for one microbatch at a time; for pipelined schedules capture one "
                f"graph per (chunk, microbatch, layer) with make_graphed_callables(..., "
                f"_order=pipeline_order(...)), or graph only mhc_recompute")
        super().__init__(model, plan, micro_batch_size=micro_batch_size, new_api=new_api)
        self.capacity = capacity
        self.block_size = block_size or model.cfg.resolved_recompute_layers
        self.sublayer_fns: dict[int, SublayerGraph] = {}  # by the record's order
        self.logits_memory: Tensor | None = None  # Note [logits in the chunk output's scratch]

    def prepare(self, device: torch.device | str) -> "GraphedStaticModel":
        cfg = self.model.cfg
        layers = list(self.model.layers)
        dtype = self.model.embedding.weight.dtype  # activations follow the parameters
        self.runtime = build_static_recompute(
            layers, self.block_size, seq_length=cfg.seq_length,
            micro_batch_size=self.micro_batch_size, capacity=self.capacity, device=device,
            dtype=dtype)
        api = self.capture_api()
        backend = api.backend
        runtime = self.runtime
        modules, records = graphable_sublayers(runtime, attn=self.plan.attn, mlp=self.plan.mlp,
                                               moe_step=self.plan.moe_step)
        recompute_in_sublayer_pool = False
        if modules:
            pool = api.new_pool()
            sample_args = self._static_inputs(records)
            hooks = armed = captures = None
            if self._graphs_every_sublayer(modules, records) and self.plan.recompute_graph:
                warm_up_recompute(runtime, backend)
                captures = RecomputeCaptures(runtime, backend, pool, runtime.sets.fixed_set())
                hooks, armed = captures.hooks(_recompute_points(records), len(modules)), captures.arm
                recompute_in_sublayer_pool = True
            scratch = self._head_scratch(modules, records, api)
            # a partially captured MoE sublayer leaves its experts' parameters to the eager tail
            graphed = api.make_graphed_callables(
                tuple(modules), sample_args, num_warmup_iters=warmups(api),
                allow_unused_input=self.plan.moe_step is not None,
                clone_param_grads_on_return=False, pool=pool, post_warmup_hook=armed,
                capture_time_hooks=hooks,
                **one_microbatch(api, len(modules)),
                options=GraphOptions(lend_grads_to_eager=True, scratch=scratch,
                                     grads_owned=True))
            if captures is not None:
                runtime.recompute_graphs.update(captures.graphs)
            self.graphed_callables = graphed
            self.logits_memory = graphed.scratch(len(modules) - 1) if scratch else None
            self.graph_labels = [sublayer_label(r, m) for r, m in zip(records, modules)]
            tail = partial(moe_tail, runtime, self.plan.moe_step)
            writes_set = runtime.sets.fixed_set() is not None  # what the captures wrote
            for record, module, fn in zip(records, modules, graphed):
                step = getattr(module, "step", None)
                self.sublayer_fns[record.order] = SublayerGraph(
                    fn, step, tail=tail if step is not None else None, writes_set=writes_set)
        if self.plan.recompute_graph and not recompute_in_sublayer_pool:
            runtime.recompute_graphs.update(capture_recompute_graphs(runtime, backend))
        self.captured = CapturedState.of(self.model)
        return self

    def _head_scratch(self, modules: list, records: list, api) -> dict[int, int]:
        """Note [logits in the chunk output's scratch]: with one microbatch in flight and the
        chunk's last sublayer a graph of mhc_cg's make_graphed_callables, that graph's forward
        scratch (Note [forward scratch]) takes the chunk output, then the training step's logits: the
        head reads the output once (the streams' mean) before its Linear writes the logits over
        it, and the loss's backward is done before the last sublayer's backward graph, the
        pool's next replay, takes the memory back for its temporaries. The logits then cost the
        pool only what exceeds the chunk output, instead of an eager allocation beside the
        pool's high-water mark. A forward whose logits its caller keeps (``forward``) computes
        them eagerly. TransformerEngine's function has no forward scratch: under it the logits
        are an eager allocation (docs/design.md says what that costs)."""
        cfg = self.model.cfg
        if self.capacity != 1 or api.te is not None or not records \
                or not records[-1].last_in_chunk or type(modules[-1]) is not SlotSublayer:
            return {}
        tokens = self.micro_batch_size * cfg.seq_length
        return {len(modules) - 1: tokens * max(cfg.num_streams * cfg.hidden_size, cfg.vocab_size)}

    def _graphs_every_sublayer(self, modules: list, records: list) -> bool:
        """Every sublayer is one graph, replayed in one fixed order per step."""
        return (len(records) == len(self.runtime.layout.records)
                and all(type(m) is SlotSublayer for m in modules))

    def _static_inputs(self, records: list) -> tuple:
        """Each graph reads its stream input where the sublayer before it wrote it (the block's
        input in the persistent set, or an arena slot) and the seed from the set: aliases of those
        buffers are its static inputs, so a replay copies nothing in."""
        pset = self.runtime.sets.template
        seed = own_version_alias(pset.seed)
        samples = []
        for record in records:
            stream = pset.block_inputs[record.block] if record.first_in_block else \
                self.runtime.sublayers.slots.stream(record).reader
            samples.append((own_version_alias(stream).requires_grad_(), seed))
        return tuple(samples)

    def forward(self, input_ids: Tensor, dropout_seed: Tensor) -> Tensor:
        """A training forward runs the static runtime and its graphs; evaluation (``eval()`` or
        ``no_grad``) runs the plain model eagerly: no persistent set is claimed, no graph replayed."""
        if self.runtime is None:
            raise StaticRecomputeError("GraphedStaticModel.prepare(device) must run before forward")
        if not runs_graphs(self.model):
            return self.model(input_ids, dropout_seed)
        return self.model.logits(*self._streams(input_ids, dropout_seed))

    def microbatch_loss(self, input_ids: Tensor, targets: Tensor, dropout_seed: Tensor | None,
                        kernels: str, num_microbatches: int) -> Tensor:
        """The loss over logits in the chunk output's scratch, where there is one
        (Note [logits in the chunk output's scratch])."""
        if self.logits_memory is None or not runs_graphs(self.model):
            return super().microbatch_loss(input_ids, targets, dropout_seed, kernels,
                                           num_microbatches)
        x, grad_into = self._streams(input_ids, dropout_seed)
        s, b = x.shape[0], x.shape[1]
        shape = (s, b, self.model.cfg.vocab_size)
        memory = self.logits_memory[:s * b * shape[2]].view(shape)
        logits = self.model.logits(x, grad_into, memory)
        return microbatch_loss(logits, targets, kernels, num_microbatches)

    def _streams(self, input_ids: Tensor, dropout_seed: Tensor) -> tuple[Tensor, Tensor | None]:
        """The chunk output of a training forward through the graphs, and the buffer its
        gradient goes to."""
        self.captured.check(self.model)
        dropout_seed = self.graph_seed(input_ids, dropout_seed)
        x = self.model.embed(input_ids, *embed_buffers(self.model, self.runtime, input_ids))
        x = self.runtime.forward(x, dropout_seed, self.sublayer_fns)
        return x, grad_output_buffer(x)


def _recompute_points(records: list) -> dict[int, int]:
    """``{sublayer graph: block}``: each block's recompute graph goes into the sublayer graphs'
    pool just before the backward of the block's last sublayer is captured
    (Note [recompute graphs in the sublayer pool]).

    The chunk's last block has none: each forward is followed by its backward (one microbatch
    in flight), so the arena still holds what its forward wrote and the runtime skips its
    recompute (Note [recompute graphs]).
    """
    return {i: record.block for i, record in enumerate(records)
            if record.last_in_block and not record.last_block}
