"""One pipeline rank: its model chunks on the static-buffer runtime, driven by megatron-core's schedule.

Every rank builds the whole model with ``train.seed`` exactly as the single-process run does
(:func:`mhc_cg.training.run.build_model`, in the static-recompute mode it was given) and keeps its own
layers: chunk ``c`` of rank ``r`` is virtual stage ``c * pp_size + r``; the first stage also embeds,
the last one also computes the logits and the loss. The rank's chunks share one arena and one pool
of persistent slot sets holding ``max_persistent_slot_sets(order)`` sets, the planner's figure for
the rank's order; the recompute graphs are captured per (chunk, block, set). With ``attn`` / ``mlp``
in scope, every (chunk, microbatch, sublayer) also gets its own graphed callable, captured along the
rank's order as TransformerEngine's ``make_graphed_callables`` does under Megatron (one graph per
sublayer could hold only one microbatch in flight). Data and dropout seeds come from
:class:`~mhc_cg.training.session.Microbatches`, in the single-process sequence.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mhc_cg.config import RunConfig
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.core.progress import ProgressBar
from mhc_cg.core.pipeline_order import (assign_persistent_slot_sets, max_persistent_slot_sets,
                                  pipeline_order)
from mhc_cg.model import MHCGPT, lm_loss
from mhc_cg.graphs.graphed_callables import GraphOptions
from mhc_cg.lab.emulation.backends import graph_api
from mhc_cg.modes.lifecycle import warmups
from mhc_cg.lab.references.graphed_none import sublayer_sample_args
from mhc_cg.training.run import build_model
from mhc_cg.lab.resolve import resolve
from mhc_cg.runtime.arena import Arena
from mhc_cg.runtime.graphable import graphable_sublayers
from mhc_cg.runtime.persistent import PersistentSetPool, new_persistent_set
from mhc_cg.runtime.recompute_captures import capture_recompute_graphs
from mhc_cg.runtime.static import SublayerGraph, build_static_recompute
from mhc_cg.training.optimizer import MainParamAdamW
from mhc_cg.lab.pipeline.schedules_on_cpu import cpu_shim
from mhc_cg.training.session import Microbatches, optimizer_for

class PipelineChunk(nn.Module):
    """One model chunk of one rank, as megatron-core's schedule drives it.

    ``forward(input_ids, seed)`` embeds on the first virtual stage, otherwise reads the tensor the
    schedule received and handed over with ``set_input_tensor``; it runs the chunk's layers on the
    static runtime and, on the last virtual stage, returns the logits. The full model is held
    outside the module tree so that ``parameters()`` are the chunk's own.
    """

    def __init__(self, model: MHCGPT, runtime, first: bool, last: bool, config, layers,
                 sublayer_fns=None, num_microbatches: int = 1):
        super().__init__()
        from megatron.core.enums import ModelType

        self.layers = nn.ModuleList(layers)
        self._model = (model,)  # a tuple: not registered as a submodule
        self.runtime, self.first, self.last = runtime, first, last
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.input_tensor: Tensor | None = None
        # microbatch -> {(layer, k): graphed sublayer}; the schedule runs a chunk's forwards in
        # microbatch order, so the k-th forward of a step is microbatch k
        self.sublayer_fns = sublayer_fns
        self.num_microbatches, self.forwards = num_microbatches, 0

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors

    def forward(self, input_ids: Tensor, seed: Tensor) -> Tensor:
        model = self._model[0]
        x = model.embed(input_ids) if self.first else self.input_tensor
        microbatch = self.forwards % self.num_microbatches
        self.forwards += 1
        fns = None if self.sublayer_fns is None else self.sublayer_fns(microbatch)
        x = self.runtime.forward(x, seed, fns)
        return model.logits(x) if self.last else x


def _p2p_config(cfg: RunConfig, dtype: torch.dtype, device: str):
    """The megatron-core ``TransformerConfig`` the schedule reads (via each chunk's ``config``).

    Only its pipeline fields matter here; ``hidden_size`` is what the p2p layer allocates
    receive buffers with, so it is the n-fold residual stream, ``n * hidden``, and the layers
    themselves are mhc_cg's.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    par = cfg.parallel
    return TransformerConfig(
        num_layers=cfg.model.num_layers, hidden_size=cfg.model.num_streams * cfg.model.hidden_size,
        num_attention_heads=1,
        pipeline_model_parallel_size=par.pp_size,
        virtual_pipeline_model_parallel_size=par.vpp_size if par.vpp_size > 1 else None,
        microbatch_group_size_per_vp_stage=par.microbatch_group_size,
        pipeline_dtype=dtype, params_dtype=dtype,
        batch_p2p_comm=device == "cuda",  # gloo: isend/irecv (the batched path syncs CUDA)
    )


@dataclass
class RankReport:
    rank: int
    order: list[int]
    stages: list[int]
    planned_sets: int  # max_persistent_slot_sets(order)
    persistent_sets: int  # the pool's capacity
    peak_sets_in_use: int
    assignment_matches_planner: bool  # first step: slot set per forward == assign_persistent_slot_sets
    arena_bytes: int
    persistent_bytes_per_set: int
    recompute_graphs: int
    recomputes_replayed: int = 0  # block recomputes that ran as a replayed graph
    recomputes_eager: int = 0  # ... and eagerly (none, once the graphs are captured)
    recomputes_kept: int = 0  # ... and skipped: the arena still held the block's forward
    capture_api: str = ""  # what captured the sublayer graphs: "te" (TE's function) or ours
    sublayer_graphs: int = 0  # forward and backward graphs of the graphed sublayers
    sublayer_graph_replays: int = 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)

    def summary(self) -> dict:
        return {"rank": self.rank, "stages": self.stages, "planned_sets": self.planned_sets,
                "persistent_sets": self.persistent_sets, "peak_sets_in_use": self.peak_sets_in_use,
                "assignment_matches_planner": self.assignment_matches_planner,
                "arena_bytes": self.arena_bytes,
                "persistent_bytes_per_set": self.persistent_bytes_per_set,
                "recompute_graphs": self.recompute_graphs,
                "recomputes_replayed": self.recomputes_replayed,
                "recomputes_eager": self.recomputes_eager,
                "recomputes_kept": self.recomputes_kept,
                "capture_api": self.capture_api, "sublayer_graphs": self.sublayer_graphs,
                "sublayer_graph_replays": self.sublayer_graph_replays, "order": self.order}


class PipelineRank:
    """One rank, built and captured: ``train(steps)`` runs the schedule and returns its report."""

    def __init__(self, rank: int, cfg: RunConfig, mode: str, dev: torch.device):
        from megatron.core import parallel_state

        self.run = resolve(cfg, mode, dev)  # this rank's entry: resolved once
        cfg = self.run.cfg
        par, train = cfg.parallel, cfg.train
        self.rank, self.cfg, self.dev = rank, cfg, dev
        self.pp, self.vpp, self.m = par.pp_size, par.vpp_size, train.num_microbatches
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None)
        self.model = build_model(self.run)
        per_chunk = cfg.model.num_layers // (self.pp * self.vpp)
        self.block = min(cfg.model.resolved_recompute_layers, per_chunk)
        self.stages = [c * self.pp + rank for c in range(self.vpp)]
        self.chunk_layers = [list(self.model.layers)[s * per_chunk:(s + 1) * per_chunk]
                             for s in self.stages]
        self.order = pipeline_order(self.pp, rank, self.m, self.vpp, par.microbatch_group_size)
        self._build_runtimes()
        self.optimizer = self._build_optimizer()  # lays the parameters out: before any capture
        self._capture()
        self._build_chunks()
        self.optimizer.reserve_staging(self.arena.borrow())
        self.data = Microbatches(cfg)

    def _build_optimizer(self) -> MainParamAdamW:
        """The optimizer over the parameters this rank owns: its chunks' layers, the embeddings
        on the first stage, the final norm and head on the last; the norm summed over ranks."""
        pp, vpp, model = self.pp, self.vpp, self.model
        owned = {id(p) for layers in self.chunk_layers for layer in layers
                 for p in layer.parameters()}
        if 0 in self.stages:
            owned |= {id(p) for p in (*model.embedding.parameters(), *model.position.parameters())}
        if pp * vpp - 1 in self.stages:
            owned |= {id(p) for p in (*model.final_norm.parameters(), *model.head.parameters())}
        self.named = [(n, p) for n, p in model.named_parameters() if id(p) in owned]
        # the norm's square summed over every rank: the global norm
        return optimizer_for(self.cfg, [p for _, p in self.named], reduce_norm=dist.all_reduce)

    def _build_runtimes(self) -> None:
        """One arena and one pool of slot sets for the rank, a static runtime per chunk."""
        cfg, train, dev = self.cfg, self.cfg.train, self.dev
        dtype = TORCH_DTYPES[train.dtype]
        self.planned = max_persistent_slot_sets(self.order)
        self.arena = Arena(dev)
        # chunk 0 holds the rank's lowest layers: with recompute_activation_layers it recomputes the
        # activation wherever a later chunk does, so its sets have every fc1 slot the others need
        self.sets = PersistentSetPool(self.planned, lambda i: new_persistent_set(
            i, self.chunk_layers[0], self.block, cfg.model.seq_length, train.micro_batch_size,
            dev, dtype))
        self.runtimes = [build_static_recompute(
            layers, self.block, seq_length=cfg.model.seq_length,
            micro_batch_size=train.micro_batch_size, capacity=self.planned, device=dev,
            arena=self.arena, sets=self.sets, dtype=dtype) for layers in self.chunk_layers]

    def _capture(self) -> None:
        """The recompute graphs per (chunk, block, set); with graphed sublayers, one graphed
        callable per (chunk, microbatch, sublayer) along the rank's order (TE's
        ``make_graphed_callables`` semantics: one pool, static inputs reused)."""
        plan = self.run.plan
        api = graph_api(plan.api)
        self.capture_api = api.name
        for runtime in self.runtimes:
            runtime.recompute_graphs.update(capture_recompute_graphs(runtime, api.backend))
        self.sublayer_fns, self.graphed = [None] * self.vpp, None
        if not plan.graphed_sublayers:
            return
        modules, records = [], []
        for runtime in self.runtimes:
            chunk_modules, chunk_records = graphable_sublayers(
                runtime, attn=plan.attn, mlp=plan.mlp, moe_step=plan.moe_step)
            modules += chunk_modules
            records += chunk_records
        per_chunk = len(modules) // self.vpp
        # TE's layout: the callables are the chunks' sublayers; graph i is sample i, chunk-major,
        # then microbatch, then the chunk's sublayers
        samples = sublayer_sample_args(self.model, self.cfg.train.micro_batch_size,
                                       self.vpp * self.m * per_chunk, self.dev)
        self.graphed = api.make_graphed_callables(
            tuple(modules), list(samples), num_warmup_iters=warmups(api),
            _order=self.order, _num_layers_per_chunk=[per_chunk] * self.vpp,
            _reuse_graph_input_output_buffers=True, clone_param_grads_on_return=False,
            options=GraphOptions(grads_owned=True))

        def for_chunk(c):
            def fns(microbatch):
                first = (c * self.m + microbatch) * per_chunk
                return {records[c * per_chunk + j].order:
                        SublayerGraph(self.graphed[first + j], named=False)
                        for j in range(per_chunk)}
            return fns

        self.sublayer_fns = [for_chunk(c) for c in range(self.vpp)]

    def _build_chunks(self) -> None:
        """The schedule's model chunks, and the optimizer over the parameters this rank owns."""
        pp, vpp, model, train = self.pp, self.vpp, self.model, self.cfg.train
        p2p_config = _p2p_config(self.cfg, TORCH_DTYPES[train.dtype], self.dev.type)
        self.chunks = [PipelineChunk(model, self.runtimes[c], first=self.stages[c] == 0,
                                     last=self.stages[c] == pp * vpp - 1, config=p2p_config,
                                     layers=self.chunk_layers[c], sublayer_fns=self.sublayer_fns[c],
                                     num_microbatches=self.m) for c in range(vpp)]

    def step(self, collect_grads: bool = False) -> tuple[float | None, float, dict[str, Tensor]]:
        """One optimizer step: ``(loss on the last rank else None, global grad norm, grads: a
        copy of this rank's, with ``collect_grads``)``."""
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        m, dev = self.m, self.dev
        batches = [self.data.next(dev) for _ in range(m)]  # TrainSession.step's draws, in order

        def loss_func(targets: Tensor, logits: Tensor):
            loss = lm_loss(logits, targets, self.cfg.model.kernels, grad_over_logits=True)
            # the value TrainSession reports: loss / num_microbatches, before megatron scales it
            return loss, {"loss": loss.detach() / m}

        def forward_step(data_iterator, chunk: PipelineChunk):
            inputs, targets, seed = next(data_iterator)
            return chunk(inputs, seed), partial(loss_func, targets)

        forward_backward = get_forward_backward_func(self.pp, self.vpp if self.vpp > 1 else None)
        with cpu_shim() if dev.type == "cpu" else contextlib.nullcontext():
            store = forward_backward(
                forward_step_func=forward_step, data_iterator=[iter(batches) for _ in range(self.vpp)],
                model=self.chunks, num_microbatches=m, seq_length=self.cfg.model.seq_length,
                micro_batch_size=self.cfg.train.micro_batch_size, forward_only=False)
        grads = {n: p.grad.detach().clone() for n, p in self.named} if collect_grads else {}
        result = self.optimizer.step(self.arena.borrow())  # the gradients are zero afterwards
        total = []
        if self.rank == self.pp - 1:  # summed in fp32 in microbatch order, as TrainSession sums
            total = [store[0]["loss"]]
            for item in store[1:]:
                total[0] = total[0] + item["loss"]
        norm, _, losses = self.optimizer.finish(result, *total)  # one read back per step
        return (losses[0] if losses else None), norm, grads

    def train(self, steps: int, collect_grads: bool, progress: bool) -> RankReport:
        report = RankReport(rank=self.rank, order=self.order, stages=self.stages,
                            planned_sets=self.planned, persistent_sets=self.sets.capacity,
                            peak_sets_in_use=0, assignment_matches_planner=False,
                            arena_bytes=self.arena.nbytes,
                            persistent_bytes_per_set=self.sets.nbytes_per_set,
                            recompute_graphs=sum(len(rt.recompute_graphs) for rt in self.runtimes),
                            capture_api=self.capture_api)
        is_last_rank = self.rank == self.pp - 1
        bar = ProgressBar(steps, f"train[pp{self.pp} vpp{self.vpp}]", progress and is_last_rank)
        for step in range(steps):
            start = time.perf_counter()
            loss, norm, grads = self.step(collect_grads)
            if step == 0:
                report.assignment_matches_planner = \
                    self.sets.last_round == assign_persistent_slot_sets(self.order)
            if collect_grads:
                report.grads.append({n: g.cpu() for n, g in grads.items()})
            report.step_times.append(time.perf_counter() - start)
            report.grad_norms.append(norm)
            if is_last_rank:
                report.losses.append(loss)
                bar.update(step + 1, f"loss {loss:.4f}")
        report.peak_sets_in_use = self.sets.peak_in_use
        runs = sum((runtime.recomputes for runtime in self.runtimes), Counter())
        report.recomputes_replayed = sum(n for (_, how), n in runs.items() if how == "graph")
        report.recomputes_eager = sum(n for (_, how), n in runs.items() if how == "eager")
        report.recomputes_kept = sum(n for (_, how), n in runs.items() if how == "kept")
        if self.graphed is not None:
            graphs = list(self.graphed.graphs())
            report.sublayer_graphs = len(graphs)
            report.sublayer_graph_replays = sum(g.replays for g in graphs)
        return report


def rank_main(rank: int, cfg: RunConfig, mode: str, steps: int, device: str, port: int,
              out_dir: str, collect_grads: bool, progress: bool, threads: int) -> None:
    """A spawned rank's entry: join the process group, train, write the report to ``out_dir``."""
    # megatron-core warns at import about TE/Apex being absent, once per rank: noise here
    for category in (UserWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\..*")
    torch.set_num_threads(threads)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.parallel.pp_size, timeout=datetime.timedelta(seconds=300))
    try:
        report = PipelineRank(rank, cfg, mode, torch.device(device)).train(steps, collect_grads, progress)
        torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


