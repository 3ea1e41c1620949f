"""Training a megatron GPT with megatron-core's own schedule, and measuring what one step holds.

``train_run`` trains one model chunk (pipeline size 1) with ``forward_backward_func``: megatron's
DDP (fp32 grad buffers), the synthetic progression corpus drawn from a seed, and AdamW on fp32
master weights, so every run of a comparison sees the same data and the same update. With a TE
graph ``helper``, the first ``warmup_steps`` run eagerly and the helper captures before the next
(as megatron's training loop does with ``cuda_graph_warmup_steps``).

What the last step measures (:class:`StepProbe`):

* **saved bytes per layer**: the distinct storages the decoder holds from its forward to its
  backward, over its layers: what autograd keeps (parameters left out; a storage the recompute
  freed counts zero), plus what each replayed layer graph's backward reads that its forward left
  in the graphs' pool or static inputs, plus the static runtime's arena and persistent set;
* **graph replays per step**: forward and backward replays of the layer graphs, and replays of
  mhc_cg's recompute graphs;
* **mHC checkpoints per step**: the ``CheckpointWithoutOutput`` objects Megatron-LM main's
  recompute managers register, and the sublayers mhc_cg's runtime recomputes.

Layer graphs expose what their backward reads only on the ``tape`` backend (the CPU emulation);
elsewhere the saved bytes are ``None``.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from mhc_cg.core.progress import log
from mhc_cg.core.storage import storage_id
from mhc_cg.training.data import ProgressionCorpus

from .graph_hook import chunk_decoder

TOOL = "mhc-cg megatron"


@dataclass
class TrainSetup:
    """The shape of a run: data, schedule and update."""

    vocab_size: int
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    steps: int
    lr: float
    seed: int
    warmup_steps: int = 1


def init_single_process(cpu: bool, seed: int) -> None:
    """One process, tensor and pipeline sizes 1: megatron's parallel state (gloo on the CPU) and
    its model-parallel RNG tracker (on the CPU an empty state: no draw reads it, attention
    dropout is 0)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from mhc_cg.training.pipeline.driver import free_port

    torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1,
                                         init_method=f"tcp://127.0.0.1:{free_port()}")
    parallel_state.initialize_model_parallel()
    if cpu:
        mrandom.get_cuda_rng_tracker().states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = \
            torch.empty(0, dtype=torch.uint8)
    else:
        mrandom.model_parallel_cuda_manual_seed(seed)


def use_microbatches(setup: TrainSetup) -> None:
    """megatron's global microbatch calculator for ``setup`` (data-parallel size 1)."""
    from megatron.core import num_microbatches_calculator as calculator

    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(
        0, None, setup.micro_batch_size * setup.num_microbatches, setup.micro_batch_size, 1)


def wrap_for_training(model: torch.nn.Module, config) -> torch.nn.Module:
    """megatron's mixed-precision wrapper (bf16/fp16) and DDP with fp32 grad buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    return DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                   model)


def token_batches(setup: TrainSetup, device) -> list[dict]:
    """Every microbatch of the run, from ``setup.seed``: the synthetic progression corpus
    (learnable in a few steps), positions and a causal mask ``[mbs, 1, s, s]`` (megatron's
    boolean "masked out"), the shape megatron's graph helper gives the layers' static mask."""
    corpus = ProgressionCorpus(setup.vocab_size, setup.seq_length, seed=setup.seed)
    s, b = setup.seq_length, setup.micro_batch_size
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(diagonal=1).to(device)
    positions = torch.arange(s).expand(b, s).to(device)
    batches = []
    for _ in range(setup.steps * setup.num_microbatches):
        tokens, labels = (t.to(device) for t in corpus.batch(b))
        batches.append({"tokens": tokens, "labels": labels, "position_ids": positions,
                        "attention_mask": mask})
    return batches


class MasterAdamW:
    """AdamW on fp32 master copies of the parameters, their grads megatron's fp32 grad buffers;
    the masters are copied back into the (bf16) parameters after each step."""

    def __init__(self, chunk: torch.nn.Module, lr: float):
        self.params = [p for p in chunk.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.0)

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            master.grad = p.main_grad
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)


def grad_digest(chunk: torch.nn.Module) -> str:
    """A hash of every parameter's gradient buffer, in name order: equal iff every byte is."""
    digest = hashlib.sha256()
    for name, p in sorted(chunk.named_parameters()):
        digest.update(name.encode())
        digest.update(p.main_grad.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _count_checkpoints() -> tuple[Callable[[], int], Callable[[], None]]:
    """Count ``CheckpointWithoutOutputManager.add_checkpoint`` calls (megatron's mHC recompute
    managers); returns ``(count, undo)``. A megatron without the manager counts 0."""
    from megatron.core.tensor_parallel import random as mrandom

    manager = getattr(mrandom, "CheckpointWithoutOutputManager", None)
    if manager is None:
        return (lambda: 0), (lambda: None)
    calls = [0]
    original = manager.add_checkpoint

    def counted(self, ckpt):
        calls[0] += 1
        return original(self, ckpt)

    manager.add_checkpoint = counted

    def undo() -> None:
        manager.add_checkpoint = original

    return (lambda: calls[0]), undo


class StepProbe:
    """Measures the decoder's next forward (its first microbatch): :func:`held_bytes` of what
    autograd saved in it, taken when the forward ends."""

    def __init__(self, decoder: torch.nn.Module):
        self.decoder = decoder
        self.saved: list[Tensor] = []
        self.held_bytes: int | None = None
        self._context = contextlib.ExitStack()
        self._handles = [decoder.register_forward_pre_hook(self._enter),
                         decoder.register_forward_hook(self._leave)]

    def _enter(self, module, args) -> None:
        self._context.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))

    def _pack(self, t: Tensor) -> Tensor:
        self.saved.append(t)
        return t

    def _leave(self, module, args, output) -> None:
        self._context.close()
        for handle in self._handles:
            handle.remove()
        self.held_bytes = held_bytes(self.decoder, self.saved)
        self.saved = []  # hold nothing past the measurement


def _unpack(t: Tensor) -> Tensor:
    return t


def held_bytes(decoder: torch.nn.Module, saved: list[Tensor]) -> int | None:
    """Bytes of the distinct storages ``decoder`` holds for its backward; see the module docstring.

    The static runtime's arena is not among them: every block's recompute rewrites its slots
    before the block's backward, so it holds nothing from a forward to its backward; it is the
    recompute's workspace, once per rank (:func:`arena_bytes`), as the block of outputs that
    megatron's eager recompute re-allocates in the backward is its.
    """
    params = {storage_id(p) for p in decoder.parameters()}
    storages = {storage_id(t): t.untyped_storage().nbytes() for t in saved}
    for layer in decoder.layers:
        graphs = getattr(layer, "cuda_graphs", None)
        if graphs:
            read = backward_reads(graphs[getattr(layer, "current_microbatch", 0) % len(graphs)])
            if read is None:
                return None
            storages.update(read)
    static = getattr(decoder, "mhc_static", None)
    if static is not None:
        runtime = static.runtime
        storages.update((storage_id(t), t.untyped_storage().nbytes())
                        for t in _set_tensors(runtime.sets.all_sets()[0]))
        params.add(storage_id(runtime.arena.buffer))
    return sum(nbytes for key, nbytes in storages.items() if key not in params)


def arena_bytes(decoder: torch.nn.Module) -> int:
    """The static runtime's arena (one recompute block's mHC state, once per rank); 0 without."""
    static = getattr(decoder, "mhc_static", None)
    return static.runtime.arena.nbytes if static is not None else 0


def _set_tensors(pset) -> list[Tensor]:
    return [*pset.block_inputs, *pset.fn_outputs.values(), *pset.fc1_outputs.values(), pset.seed]


def backward_reads(graphed: Callable) -> dict[int, int] | None:
    """``{storage: bytes}`` the backward graph of a tape-graphed callable reads that its own
    capture did not allocate and that are not its grad-output buffers (what the forward left for
    it); ``None`` when the graphs are not on the tape."""
    runner = getattr(graphed, "runner", None)
    graph = getattr(runner, "bwd_graph", None)
    if graph is None or not hasattr(graph, "ops"):
        return None
    skip = set(graph.made_storages) | {storage_id(g) for g in runner.static_grad_outputs
                                       if g is not None}
    read = {}
    for op in graph.ops:
        for t in op.flat_args:
            if isinstance(t, Tensor) and storage_id(t) not in skip:
                read[storage_id(t)] = t.untyped_storage().nbytes()
    return read


def graph_replays(decoder: torch.nn.Module) -> tuple[int, int]:
    """``(layer graph replays, recompute graph replays)`` so far (forward and backward graphs)."""
    layer = 0
    for module in decoder.layers:
        for graphed in getattr(module, "cuda_graphs", None) or ():
            runner = getattr(graphed, "runner", None)
            layer += sum(g.replays for g in (getattr(runner, "fwd_graph", None),
                                              getattr(runner, "bwd_graph", None)) if g is not None)
    static = getattr(decoder, "mhc_static", None)
    recompute = sum(g.replays for g in static.runtime.recompute_graphs.values()) if static else 0
    return layer, recompute


def recomputed_sublayers(decoder: torch.nn.Module, since: int) -> int:
    """Sublayers the static runtime recomputed since its trace had ``since`` entries."""
    static = getattr(decoder, "mhc_static", None)
    if static is None:
        return 0
    runtime = static.runtime
    blocks = [int(line.split()[2]) for line in runtime.trace[since:]]  # "recompute block B set S"
    return sum(2 * len(runtime.blocks[b]) for b in blocks)


def _trace_len(decoder) -> int:
    static = getattr(decoder, "mhc_static", None)
    return len(static.runtime.trace) if static is not None else 0


@contextlib.contextmanager
def measuring(decoder: torch.nn.Module, into: dict) -> Iterator[None]:
    """Measure the step run inside (see the module docstring); the figures go into ``into``."""
    probe, before, trace = StepProbe(decoder), graph_replays(decoder), _trace_len(decoder)
    checkpoints, undo = _count_checkpoints()
    try:
        yield
    finally:
        undo()
    after = graph_replays(decoder)
    into.update(
        saved_bytes_per_layer=(None if probe.held_bytes is None
                               else round(probe.held_bytes / len(decoder.layers))),
        layer_graph_replays_per_step=after[0] - before[0],
        recompute_graph_replays_per_step=after[1] - before[1],
        mhc_checkpoints_per_step=checkpoints(),
        recomputed_sublayers_per_step=recomputed_sublayers(decoder, trace),
        arena_bytes=arena_bytes(decoder))


def train_run(name: str, chunk: torch.nn.Module, setup: TrainSetup, *, helper=None,
              cpu: bool = True) -> dict:
    """Train ``chunk`` (DDP-wrapped) ``setup.steps`` steps; losses, per-step gradient hashes and
    the last step's measurements (see the module docstring)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mhc_cg.training.pipeline.cpu_shim import cpu_shim

    data = iter(token_batches(setup, next(chunk.parameters()).device))
    decoder = chunk_decoder(chunk)
    optimizer = MasterAdamW(chunk, setup.lr)
    forward_backward = get_forward_backward_func()
    result = {"losses": [], "grad_digests": []}
    for step in range(setup.steps):
        if helper is not None and step == setup.warmup_steps:
            helper.create_cudagraphs()
        last = step == setup.steps - 1
        chunk.zero_grad_buffer()
        with (measuring(decoder, result) if last else contextlib.nullcontext()), \
                (cpu_shim() if cpu else contextlib.nullcontext()):
            reduced = forward_backward(forward_step_func=_forward_step, data_iterator=data,
                                       model=[chunk], num_microbatches=setup.num_microbatches,
                                       seq_length=setup.seq_length,
                                       micro_batch_size=setup.micro_batch_size, forward_only=False)
        result["losses"].append(sum(float(r["lm loss"]) for r in reduced) / len(reduced))
        result["grad_digests"].append(grad_digest(chunk))
        optimizer.step()
        log(TOOL, f"{name}: step {step + 1}/{setup.steps} loss {result['losses'][-1]:.6f}")
    return result


def _forward_step(data_iterator, model):
    """megatron's ``forward_step_func``: the model's per-token loss, averaged over the microbatch."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor: Tensor):
        loss = output_tensor.float().mean()
        # a copy: megatron scales the returned loss in place by 1 / num_microbatches
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func
