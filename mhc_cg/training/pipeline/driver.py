"""Pipeline parallelism across processes: ``pp_size`` ranks, ``vpp_size`` model chunks each.

:func:`train_pipeline` spawns one process per pipeline rank (``torch.multiprocessing``; gloo on
CPU, NCCL on GPU) and every rank runs megatron-core's own schedule
(``megatron.core.pipeline_parallel.schedules.get_forward_backward_func``: interleaved 1F1B with
``vpp_size > 1``, plain 1F1B otherwise) with real point-to-point sends and receives of the
residual stream, ``[seq, micro_batch, n * hidden]`` wide. On CPU the schedule runs inside
:func:`mhc_cg.training.pipeline.cpu_shim.cpu_shim`.

Every rank builds the whole model with ``train.seed``, exactly as the single-process run does,
and keeps its own layers: chunk ``c`` of rank ``r`` is virtual stage ``c * pp_size + r``; the first
stage also embeds, the last one also computes the logits and the loss. A rank's chunks run on the
static-buffer runtime (:mod:`mhc_cg.runtime.recompute.static`) with one arena and one pool of persistent
slot sets shared by its chunks; the pool holds ``max_persistent_slot_sets(order)`` sets, the
planner's figure for the rank's order, and the recompute graphs are captured per (chunk, block,
set). With ``attn`` / ``mlp`` in scope, every (chunk, microbatch, sublayer) also gets its own graphed
callable, captured along the rank's order as TransformerEngine's ``make_graphed_callables`` does
under Megatron (one graph per sublayer could hold only one microbatch in flight). Data and dropout seeds are drawn per microbatch from the same generators, in the same
sequence, as :class:`mhc_cg.training.session.TrainSession` does, on every rank.

What makes the losses and gradient norms equal, bit for bit, to ``pp_size: 1``: each chunk sees
its microbatches first-in first-out in both directions, so every parameter sums its microbatch
gradients in the same order; the loss is megatron's ``(loss * cp_size) / num_microbatches`` with
``cp_size = 1``, the same value and gradient as ``loss / num_microbatches``; the gradient norm is
gathered as per-parameter norms and reduced in the single-process parameter order, as
``clip_grad_norm_`` does; AdamW updates each parameter on its own.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhc_cg.config import RunConfig
from mhc_cg.training.data import ProgressionCorpus
from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.core.errors import ConfigError
from mhc_cg.model import MHCGPT
from mhc_cg.tools.planner import assign_persistent_slot_sets, max_persistent_slot_sets
from mhc_cg.core.schedule import pipeline_order
from mhc_cg.runtime.modes.plan import capture_plan, configured_mode


@dataclass
class PipelineResult:
    """What a pipelined run reports: the last stage's losses and every rank's static buffers.

    ``losses``, ``grad_norms`` and ``step_times`` are per optimizer step, as in
    :class:`mhc_cg.training.session.TrainResult`; ``ranks`` holds one :meth:`RankReport.summary` per rank.
    ``grads`` (only with ``collect_grads``) is, per step, every parameter's gradient by its name
    in the full model, gathered from the ranks that own it.
    """

    mode: str
    pp_size: int
    vpp_size: int
    num_microbatches: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)
    held_bytes_per_microbatch: int | None = None

    @property
    def median_step_ms(self) -> float:
        times = sorted(self.step_times[1:] or self.step_times)
        return 1000.0 * times[len(times) // 2]

    @property
    def info(self) -> dict:
        return {"pp_size": self.pp_size, "vpp_size": self.vpp_size,
                "num_microbatches": self.num_microbatches, "ranks": self.ranks}


# -------------------------------------------------------------------------- checks (parent)
def pipeline_problems(cfg: RunConfig, mode: str) -> list[str]:
    """Why ``cfg`` cannot run as a multi-process pipeline in ``mode``; empty when it can."""
    problems = []
    if mode != "graphed_static":
        problems.append(f"--mode: a pipeline (parallel.pp_size={cfg.parallel.pp_size}) runs the "
                        f"static-buffer runtime on every rank, mode graphed_static, got {mode!r}; "
                        f"add mhc_recompute to graph.cuda_graph_scope or drop --mode")
        return problems
    plan = capture_plan(cfg, mode, "cpu")
    if plan.mlp and cfg.model.recompute_activation:
        problems.append("model.recompute_activation: a graphed 'mlp' sublayer writes fc1's output "
                        "into the one persistent set it was captured with, and a pipeline keeps "
                        "several in flight; drop 'mlp' from graph.cuda_graph_scope or set "
                        "recompute_activation: false")
    if cfg.model.is_moe:
        problems.append("model.num_experts: the pipeline driver runs dense models; set "
                        "num_experts: null or parallel.pp_size: 1")
    return problems


def resolve_pipeline_device(name: str, pp_size: int) -> str:
    """``cpu`` or ``cuda``; ``auto`` is ``cuda`` only with one GPU per rank (NCCL needs that)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if gpus >= pp_size else "cpu"
    if name == "cuda" and gpus < pp_size:
        raise ConfigError(f"train.device: a pipeline of parallel.pp_size={pp_size} ranks on CUDA "
                          f"needs {pp_size} GPUs (one per rank), this machine has {gpus}; "
                          f"use device: cpu")
    return name


# -------------------------------------------------------------------------- one rank
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


def _capture_sublayer_graphs(plan, model: MHCGPT, chunk_layers, runtimes, block: int,
                             order: list[int], num_microbatches: int, micro_batch_size: int,
                             device: torch.device, backend) -> tuple[list, object]:
    """One graphed callable per (chunk, microbatch, graphed sublayer), captured along the rank's
    ``order`` (TE's ``make_graphed_callables`` semantics: one pool, static inputs reused); per
    chunk, a function ``microbatch -> {(layer, k): graphed sublayer}`` for
    ``StaticRecompute.forward``; and the graphed callables (``.graphs()``)."""
    from mhc_cg.runtime.graphs.graphed_callables import make_graphed_callables
    from mhc_cg.runtime.modes.graphed_none import sublayer_sample_args
    from mhc_cg.runtime.modes.graphed_static import SlotSublayer

    modules, keys = [], []
    for c, layers in enumerate(chunk_layers):
        for index, layer in enumerate(layers):
            for k, sub, on in ((0, layer.attention, plan.attn), (1, layer.mlp, plan.mlp)):
                if on:
                    modules.append(SlotSublayer(runtimes[c], sub, index % block, k))
                    keys.append((layer.layer_number, k))
    per_chunk = len(modules) // len(chunk_layers)
    # TE's layout: the callables are the chunks' sublayers; graph i is sample i, chunk-major,
    # then microbatch, then the chunk's sublayers
    samples = sublayer_sample_args(model, micro_batch_size,
                                   len(chunk_layers) * num_microbatches * per_chunk, device)
    graphed = make_graphed_callables(tuple(modules), samples, order=order,
                                     num_layers_per_chunk=per_chunk, backend=backend)

    def for_chunk(c):
        def fns(microbatch):
            first = (c * num_microbatches + microbatch) * per_chunk
            return {keys[c * per_chunk + j]: graphed[first + j] for j in range(per_chunk)}
        return fns

    return [for_chunk(c) for c in range(len(chunk_layers))], graphed


def _param_norms(grads: list[Tensor]) -> list[Tensor]:
    """Per-tensor 2-norms, computed the way ``torch.nn.utils.clip_grad_norm_`` computes them."""
    from torch.utils._foreach_utils import _has_foreach_support

    if grads and _has_foreach_support(grads, grads[0].device):
        return list(torch._foreach_norm(grads, 2.0))
    return [torch.linalg.vector_norm(g, 2.0) for g in grads]


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
                "sublayer_graphs": self.sublayer_graphs,
                "sublayer_graph_replays": self.sublayer_graph_replays, "order": self.order}


def _rank_main(rank: int, cfg: RunConfig, steps: int, device: str, port: int, out_dir: str,
               collect_grads: bool, progress: bool, threads: int) -> None:
    import warnings

    import torch.distributed as dist

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
        report = _run_rank(rank, cfg, steps, torch.device(device), collect_grads, progress)
        torch.save(report, Path(out_dir) / f"rank{rank}.pt")
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _run_rank(rank: int, cfg: RunConfig, steps: int, dev: torch.device, collect_grads: bool,
              progress: bool) -> RankReport:
    import contextlib

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from mhc_cg.runtime.graphs import get_backend
    from mhc_cg.training.pipeline.cpu_shim import cpu_shim
    from mhc_cg.runtime.recompute.arena import Arena
    from mhc_cg.runtime.recompute.persistent import PersistentSetPool, new_persistent_set
    from mhc_cg.runtime.recompute.static import build_static_recompute
    from mhc_cg.training.session import ProgressBar

    par, train = cfg.parallel, cfg.train
    pp, vpp, m = par.pp_size, par.vpp_size, train.num_microbatches
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    dtype = TORCH_DTYPES[train.dtype]
    plan = capture_plan(cfg, "graphed_static", str(dev.type))

    # the single-process model (mhc_cg.runtime.modes.registry.build_for_plan, graphed_static), then our layers
    model_cfg = dataclasses.replace(cfg.model, recompute="none")
    torch.manual_seed(train.seed)
    model = MHCGPT(model_cfg).to(device=dev, dtype=dtype).train()
    per_chunk = cfg.model.num_layers // (pp * vpp)
    block = min(cfg.model.resolved_recompute_layers, per_chunk)
    stages = [c * pp + rank for c in range(vpp)]
    chunk_layers = [list(model.layers)[s * per_chunk:(s + 1) * per_chunk] for s in stages]

    order = pipeline_order(pp, rank, m, vpp, par.microbatch_group_size)
    planned = max_persistent_slot_sets(order)
    arena = Arena(dev)
    # chunk 0 holds the rank's lowest layers: with recompute_activation_layers it recomputes the
    # activation wherever a later chunk does, so its sets have every fc1 slot the others need
    sets = PersistentSetPool(planned, lambda i: new_persistent_set(
        i, chunk_layers[0], block, cfg.model.seq_length, train.micro_batch_size, dev, dtype))
    runtimes = [build_static_recompute(layers, block, seq_length=cfg.model.seq_length,
                                       micro_batch_size=train.micro_batch_size, capacity=planned,
                                       device=dev, arena=arena, sets=sets, dtype=dtype)
                for layers in chunk_layers]
    graph_backend = get_backend(plan.backend)
    for runtime in runtimes:
        runtime.capture_recompute_graphs(graph_backend)
    sublayer_fns, graphed = [None] * vpp, None
    if plan.graphed_sublayers:
        sublayer_fns, graphed = _capture_sublayer_graphs(plan, model, chunk_layers, runtimes, block, order,
                                                m, train.micro_batch_size, dev, graph_backend)

    acquired: list[int] = []
    peak = [0]
    acquire = sets.acquire

    def counting_acquire():
        pset = acquire()
        acquired.append(pset.index)
        peak[0] = max(peak[0], sets.in_use)
        return pset

    sets.acquire = counting_acquire

    p2p_config = _p2p_config(cfg, dtype, dev.type)
    chunks = [PipelineChunk(model, runtimes[c], first=stages[c] == 0,
                            last=stages[c] == pp * vpp - 1, config=p2p_config,
                            layers=chunk_layers[c], sublayer_fns=sublayer_fns[c],
                            num_microbatches=m) for c in range(vpp)]
    owned = {id(p) for chunk in chunks for p in chunk.layers.parameters()}
    if 0 in stages:
        owned |= {id(p) for p in (*model.embedding.parameters(), *model.position.parameters())}
    if pp * vpp - 1 in stages:
        owned |= {id(p) for p in (*model.final_norm.parameters(), *model.head.parameters())}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in owned]
    all_names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW([p for _, p in named], lr=train.lr,
                                  weight_decay=train.weight_decay)
    corpus = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length, seed=train.seed)
    seeds = torch.Generator().manual_seed(train.seed + 1)
    is_last_rank = rank == pp - 1
    forward_backward = get_forward_backward_func(pp, vpp if vpp > 1 else None)
    shim = cpu_shim if dev.type == "cpu" else contextlib.nullcontext

    def loss_func(targets: Tensor, logits: Tensor):
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        # the value TrainSession reports: loss / num_microbatches, before megatron scales in place
        return loss, {"loss": (loss.detach() / m).item()}

    def forward_step(data_iterator, chunk: PipelineChunk):
        inputs, targets, seed = next(data_iterator)
        return chunk(inputs, seed), partial(loss_func, targets)

    report = RankReport(rank=rank, order=order, stages=stages, planned_sets=planned,
                        persistent_sets=sets.capacity, peak_sets_in_use=0,
                        assignment_matches_planner=False, arena_bytes=arena.nbytes,
                        persistent_bytes_per_set=sets.nbytes_per_set,
                        recompute_graphs=sum(len(rt.recompute_graphs) for rt in runtimes))
    bar = ProgressBar(steps, f"train[pp{pp} vpp{vpp}]", progress and is_last_rank)
    for step in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        batches = []
        for _ in range(m):  # TrainSession.step's draws, in its order
            inputs, targets = (t.to(dev) for t in corpus.batch(train.micro_batch_size))
            seed = torch.randint(0, 2 ** 31 - 1, (), generator=seeds).to(dev)
            batches.append((inputs, targets, seed))
        with shim():
            store = forward_backward(
                forward_step_func=forward_step, data_iterator=[iter(batches) for _ in range(vpp)],
                model=chunks, num_microbatches=m, seq_length=cfg.model.seq_length,
                micro_batch_size=train.micro_batch_size, forward_only=False)
        if step == 0:
            report.assignment_matches_planner = acquired == assign_persistent_slot_sets(order)
        grads = [(n, p.grad) for n, p in named if p.grad is not None]
        norms = dict(zip((n for n, _ in grads), _param_norms([g for _, g in grads])))
        gathered: list[dict] = [None] * pp
        dist.all_gather_object(gathered, {n: v.cpu() for n, v in norms.items()})
        every = {n: v for part in gathered for n, v in part.items()}
        total = torch.linalg.vector_norm(
            torch.stack([every[n].to(dev) for n in all_names if n in every]), 2.0)
        if collect_grads:
            report.grads.append({n: g.detach().cpu().clone() for n, g in grads})
        optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        report.step_times.append(time.perf_counter() - start)
        report.grad_norms.append(float(total))
        if is_last_rank:
            loss = 0.0
            for item in store:
                loss += item["loss"]
            report.losses.append(loss)
            bar.update(step + 1, f"loss {loss:.4f}")
    report.peak_sets_in_use = peak[0]
    trace = [line for runtime in runtimes for line in runtime.trace]
    report.recomputes_replayed = sum(line.endswith("(graph)") for line in trace)
    report.recomputes_eager = sum(line.endswith("(eager)") for line in trace)
    if graphed is not None:
        graphs = list(graphed.graphs())
        report.sublayer_graphs = len(graphs)
        report.sublayer_graph_replays = sum(g.replays for g in graphs)
    return report


# -------------------------------------------------------------------------- the parent
def free_port() -> int:
    """A free TCP port on the loopback interface, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_pipeline(cfg: RunConfig, *, steps: int | None = None, device: str | None = None,
                   progress: bool = True, mode: str | None = None,
                   collect_grads: bool = False) -> PipelineResult:
    """Train ``cfg`` on ``parallel.pp_size`` processes; returns the last stage's losses.

    ``cfg`` must have passed :func:`mhc_cg.config.rules.check`. Raises ``ConfigError`` for what the
    driver does not run (see :func:`pipeline_problems`).
    """
    import torch.multiprocessing as mp

    mode = mode or configured_mode(cfg)
    problems = pipeline_problems(cfg, mode)
    if problems:
        raise ConfigError(problems)
    steps = cfg.train.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps: must be a positive integer, got {steps}")
    pp = cfg.parallel.pp_size
    dev = resolve_pipeline_device(device or cfg.train.device, pp)
    threads = max(1, torch.get_num_threads() // pp)
    if dev == "cpu":
        # forked ranks inherit this process's imports (megatron-core's take seconds per process);
        # CUDA cannot be forked, so GPU ranks are spawned
        import warnings

        with warnings.catch_warnings():  # megatron-core's import-time notes about TE/Apex
            warnings.simplefilter("ignore")
            import megatron.core.parallel_state  # noqa: F401
            import megatron.core.pipeline_parallel.schedules  # noqa: F401
    with tempfile.TemporaryDirectory(prefix="mhc_cg_pp_") as out_dir:
        mp.start_processes(_rank_main, args=(cfg, steps, dev, free_port(), out_dir,
                                             collect_grads, progress, threads),
                           nprocs=pp, join=True, start_method="fork" if dev == "cpu" else "spawn")
        reports = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                   for r in range(pp)]
    last = reports[-1]
    result = PipelineResult(mode=mode, pp_size=pp, vpp_size=cfg.parallel.vpp_size,
                            num_microbatches=cfg.train.num_microbatches, losses=last.losses,
                            grad_norms=last.grad_norms, step_times=last.step_times,
                            ranks=[r.summary() for r in reports])
    if collect_grads:
        result.grads = [{n: g for r in reports for n, g in r.grads[step].items()}
                        for step in range(steps)]
    return result
