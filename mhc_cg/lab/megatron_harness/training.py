"""Training a megatron GPT with megatron-core's own schedule, for comparisons bit for bit.

``train_run`` trains one rank's model chunks with ``forward_backward_func``: megatron's
DDP (fp32 grad buffers), the synthetic progression corpus drawn from a seed, and AdamW on fp32
master weights, so every run of a comparison sees the same data and the same update. With a TE
graph ``helper``, the first ``warmup_steps`` run eagerly and the helper captures before the next
(as megatron's training loop does with ``cuda_graph_warmup_steps``). With ``full_iteration``,
``forward_backward_func`` is wrapped in Megatron-LM dev's own ``FullCudaGraphWrapper``
(``cuda_graph_impl: full_iteration``), as its training loop wraps it: the first ``warmup_steps``
run eagerly, the next is captured (on the CPU on the tape,
:mod:`mhc_cg.lab.megatron_harness.full_iteration_on_tape`) and replayed, every later one only
replayed. It records each step's loss and a hash of every gradient byte, and what the last step
holds and replays (:mod:`mhc_cg.lab.megatron_harness.step_probe`); with ``full_iteration``, what
the decoder holds and recomputes is measured in the captured step (a replay runs no Python to
measure), and the last step, a replay, counts what ran as Python (nothing, if it replayed).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
import torch
from torch import Tensor

from mhc_cg.core.progress import log
from mhc_cg.training.data import ProgressionCorpus

from megatron_integration.capture.te_graph_helper import chunk_decoder
from mhc_cg.lab.megatron_harness.step_probe import measuring

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
    # every microbatch carries its counter-dropout seed (``dropout_seed``), which the forward
    # step hands to the decoder: an input a full-iteration graph reads from its static buffers
    dropout_seeds: bool = False


def init_ranks(cpu: bool, seed: int, *, rank: int = 0, world_size: int = 1, port: int | None = None,
               tp_size: int = 1, pp_size: int = 1, vpp_size: int = 1, ep_size: int = 1) -> None:
    """This process as rank ``rank`` of ``world_size`` (tensor x pipeline x data parallel, the
    data-parallel ranks those the experts split over): megatron's parallel state (gloo on the
    CPU, NCCL on a GPU) and its model-parallel RNG tracker (on the CPU an empty state: no draw
    reads it, attention dropout is 0)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from mhc_cg.lab.pipeline.driver import free_port

    if not cpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group("gloo" if cpu else "nccl", rank=rank,
                                         world_size=world_size,
                                         init_method=f"tcp://127.0.0.1:{port or free_port()}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None,
        expert_model_parallel_size=ep_size)
    if cpu:
        mrandom.get_cuda_rng_tracker().states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = \
            torch.empty(0, dtype=torch.uint8)
    else:
        mrandom.model_parallel_cuda_manual_seed(seed)


def use_microbatches(setup: TrainSetup) -> None:
    """megatron's global microbatch calculator for ``setup``: ``num_microbatches`` per
    data-parallel rank."""
    from megatron.core import num_microbatches_calculator as calculator
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(
        0, None, setup.micro_batch_size * setup.num_microbatches * dp, setup.micro_batch_size, dp)


def wrap_for_training(model: torch.nn.Module, config) -> torch.nn.Module:
    """megatron's mixed-precision wrapper (bf16/fp16) and DDP with fp32 grad buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    return DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                   model)


def token_batches(setup: TrainSetup, device, data_rank: int = 0) -> list[dict]:
    """Every microbatch of the run on data-parallel rank ``data_rank``, from ``setup.seed``: the
    synthetic progression corpus (learnable in a few steps), positions and a causal mask
    ``[mbs, 1, s, s]`` (megatron's boolean "masked out"), the shape megatron's graph helper
    gives the layers' static mask. With ``setup.dropout_seeds``, each microbatch's
    counter-dropout seed too (a 0-dim int64, from a generator of its own: the same on every
    pipeline stage, and in every run of a comparison)."""
    corpus = ProgressionCorpus(setup.vocab_size, setup.seq_length, seed=setup.seed + data_rank)
    seeds = torch.Generator().manual_seed(setup.seed * 7919 + data_rank)
    s, b = setup.seq_length, setup.micro_batch_size
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(diagonal=1).to(device)
    positions = torch.arange(s).expand(b, s).to(device)
    batches = []
    for _ in range(setup.steps * setup.num_microbatches):
        tokens, labels = (t.to(device) for t in corpus.batch(b))
        batches.append({"tokens": tokens, "labels": labels, "position_ids": positions,
                        "attention_mask": mask})
        if setup.dropout_seeds:
            batches[-1]["dropout_seed"] = torch.randint(
                0, 2 ** 31 - 1, (), dtype=torch.int64, generator=seeds).to(device)
    return batches


class MasterAdamW:
    """AdamW on fp32 master copies of the parameters, their grads megatron's fp32 grad buffers;
    the masters are copied back into the (bf16) parameters after each step."""

    def __init__(self, chunks: list[torch.nn.Module], lr: float):
        self.params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=0.0)

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.masters):
            master.grad = p.main_grad
        self.optimizer.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)


def grad_digest(chunks: list[torch.nn.Module], replicated_only: bool = False) -> str:
    """A hash of every parameter's gradient buffer, chunk by chunk in name order: equal iff
    every byte is. ``replicated_only``: the parameters every tensor-parallel rank holds whole (not
    marked ``tensor_model_parallel``), whose gradients every tensor-parallel rank of a stage
    must hold alike once megatron has summed the sequence-parallel ones."""
    digest = hashlib.sha256()
    for index, chunk in enumerate(chunks):
        for name, p in sorted(chunk.named_parameters()):
            if replicated_only and getattr(p, "tensor_model_parallel", False):
                continue
            digest.update(f"{index}.{name}".encode())
            digest.update(p.main_grad.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train_run(name: str, chunks: list[torch.nn.Module], setup: TrainSetup, *, helper=None,
              cpu: bool = True, log_steps: bool = True, full_iteration: bool = False) -> dict:
    """Train this rank's model ``chunks`` (DDP-wrapped; several under virtual pipeline
    parallelism) ``setup.steps`` steps with megatron-core's schedule; the losses (on the last
    pipeline stage, else empty), per-step gradient hashes and the last step's measurements (see
    the module docstring). ``full_iteration``: under dev's ``FullCudaGraphWrapper``."""
    if not full_iteration:
        return _train(name, chunks, setup, helper=helper, cpu=cpu, log_steps=log_steps)
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mhc_cg.lab.megatron_harness.full_iteration_on_tape import reset_wrapper_state

    if setup.steps < setup.warmup_steps + 2:
        raise ValueError(f"train.steps: {setup.steps}: a full-iteration run needs a step replayed "
                         f"after the captured one; set train.steps to {setup.warmup_steps + 2} "
                         f"or more")
    wrapper = FullCudaGraphWrapper(
        get_forward_backward_func(), cuda_graph_warmup_steps=setup.warmup_steps,
        use_single_mempool=getattr(chunks[0].config, "cuda_graph_use_single_mempool", False))
    try:
        return _train(name, chunks, setup, cpu=cpu, log_steps=log_steps, wrapper=wrapper)
    finally:
        reset_wrapper_state(wrapper)


# what a full-iteration run measures in its captured step (what the decoder holds and recomputes,
# run as Python there) rather than in its last, replayed, step
_CAPTURE_STEP_FIGURES = ("saved_bytes_per_layer", "mhc_checkpoints_per_step",
                         "recomputed_sublayers_per_step", "kept_sublayers_per_step",
                         "recompute_blocks_kept_per_step")


def _train(name: str, chunks: list[torch.nn.Module], setup: TrainSetup, *, helper=None,
           cpu: bool = True, log_steps: bool = True, wrapper=None) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mhc_cg.lab.pipeline.schedules_on_cpu import cpu_shim

    from megatron.core import parallel_state

    batches = token_batches(setup, next(chunks[0].parameters()).device,
                            parallel_state.get_data_parallel_rank())
    iterators = [iter(batches) for _ in chunks]  # each chunk reads every microbatch once
    decoders = [chunk_decoder(chunk) for chunk in chunks]
    optimizer = MasterAdamW(chunks, setup.lr)
    forward_backward = get_forward_backward_func() if wrapper is None else wrapper
    result = {"losses": [], "grad_digests": [], "replicated_grad_digests": []}
    captured: dict = {}
    replays_before = 0
    for step in range(setup.steps):
        if helper is not None and step == setup.warmup_steps:
            helper.create_cudagraphs()
        last = step == setup.steps - 1
        capture_step = wrapper is not None and step == setup.warmup_steps
        into = result if last else captured if capture_step else None
        if last and wrapper is not None:
            replays_before = _iteration_graph_replays(wrapper)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        with (measuring(decoders, into) if into is not None else contextlib.nullcontext()), \
                (cpu_shim() if cpu else contextlib.nullcontext()):
            reduced = forward_backward(
                forward_step_func=_forward_step,
                data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=setup.num_microbatches, seq_length=setup.seq_length,
                micro_batch_size=setup.micro_batch_size, forward_only=False)
        if reduced:  # the last pipeline stage: the loss over its data-parallel ranks
            result["losses"].append(_data_parallel_mean(
                sum(float(r["lm loss"]) for r in reduced) / len(reduced)))
        result["grad_digests"].append(grad_digest(chunks))
        result["replicated_grad_digests"].append(grad_digest(chunks, replicated_only=True))
        optimizer.step()
        if log_steps:
            loss = f" loss {result['losses'][-1]:.6f}" if reduced else ""
            log(TOOL, f"{name}: step {step + 1}/{setup.steps}{loss}")
    if wrapper is not None:
        result.update({k: captured[k] for k in _CAPTURE_STEP_FIGURES})
        result.update(_iteration_graph_figures(wrapper))
        replays = result["iteration_graph_replays"]
        result["iteration_graph_replays_per_step"] = (
            None if replays is None or replays_before is None else replays - replays_before)
    return result


def _iteration_graph(wrapper):
    """The graph dev's wrapper captured for training (``None`` before the capture)."""
    return type(wrapper).cuda_graph["training"]


def _iteration_graph_replays(wrapper) -> int | None:
    graph = _iteration_graph(wrapper)
    if graph is None:
        return 0
    return getattr(graph, "replays", None)  # a real torch.cuda.CUDAGraph does not count them


def _iteration_graph_figures(wrapper) -> dict:
    """The captured iteration graph's replays so far, the bytes its capture allocated and the
    collectives it holds (on the tape; ``None`` on a GPU, whose graphs report none of them)."""
    graph = _iteration_graph(wrapper)
    allocated = getattr(graph, "allocated_bytes", None)
    collectives = getattr(graph, "collectives", None)
    return {"iteration_graph_replays": _iteration_graph_replays(wrapper),
            "iteration_graph_bytes": allocated() if allocated is not None else None,
            "iteration_graph_collectives": collectives() if collectives is not None else None}


def _data_parallel_mean(loss: float) -> float:
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    ranks = torch.distributed.get_world_size(group)
    if ranks == 1:
        return loss
    total = torch.tensor(loss, dtype=torch.float64)
    torch.distributed.all_reduce(total, group=group)
    return float(total) / ranks


def _forward_step(data_iterator, model):
    """megatron's ``forward_step_func``: the model's per-token loss, averaged over the microbatch.
    A microbatch's counter-dropout seed, where it carries one, goes to the decoder (its forward
    pre-hook takes it in place of a draw:
    :func:`megatron_integration.layers.counter_dropout.use_counter_dropout`)."""
    batch = next(data_iterator)
    if "dropout_seed" in batch:
        chunk_decoder(model).mhc_dropout_seed_feed = batch["dropout_seed"]
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor: Tensor):
        loss = output_tensor.float().mean()
        # a copy: megatron scales the returned loss in place by 1 / num_microbatches
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func
