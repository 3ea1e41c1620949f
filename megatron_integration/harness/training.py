"""Training a megatron GPT with megatron-core's own schedule, for comparisons bit for bit.

``train_run`` trains one rank's model chunks with ``forward_backward_func``: megatron's
DDP (fp32 grad buffers), the synthetic progression corpus drawn from a seed, and AdamW on fp32
master weights, so every run of a comparison sees the same data and the same update. With a TE
graph ``helper``, the first ``warmup_steps`` run eagerly and the helper captures before the next
(as megatron's training loop does with ``cuda_graph_warmup_steps``). It records each step's loss
and a hash of every gradient byte, and what the last step holds and replays
(:mod:`megatron_integration.harness.step_probe`).
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
from megatron_integration.harness.step_probe import measuring

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


def init_ranks(cpu: bool, seed: int, *, rank: int = 0, world_size: int = 1, port: int | None = None,
               tp_size: int = 1, pp_size: int = 1, vpp_size: int = 1, ep_size: int = 1) -> None:
    """This process as rank ``rank`` of ``world_size`` (tensor x pipeline x data parallel, the
    data-parallel ranks those the experts split over): megatron's parallel state (gloo on the
    CPU, NCCL on a GPU) and its model-parallel RNG tracker (on the CPU an empty state: no draw
    reads it, attention dropout is 0)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from mhc_cg.training.pipeline.driver import free_port

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
    gives the layers' static mask."""
    corpus = ProgressionCorpus(setup.vocab_size, setup.seq_length, seed=setup.seed + data_rank)
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
              cpu: bool = True, log_steps: bool = True) -> dict:
    """Train this rank's model ``chunks`` (DDP-wrapped; several under virtual pipeline
    parallelism) ``setup.steps`` steps with megatron-core's schedule; the losses (on the last
    pipeline stage, else empty), per-step gradient hashes and the last step's measurements (see
    the module docstring)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mhc_cg.training.pipeline.schedules_on_cpu import cpu_shim

    from megatron.core import parallel_state

    batches = token_batches(setup, next(chunks[0].parameters()).device,
                            parallel_state.get_data_parallel_rank())
    iterators = [iter(batches) for _ in chunks]  # each chunk reads every microbatch once
    decoders = [chunk_decoder(chunk) for chunk in chunks]
    optimizer = MasterAdamW(chunks, setup.lr)
    forward_backward = get_forward_backward_func()
    result = {"losses": [], "grad_digests": [], "replicated_grad_digests": []}
    for step in range(setup.steps):
        if helper is not None and step == setup.warmup_steps:
            helper.create_cudagraphs()
        last = step == setup.steps - 1
        for chunk in chunks:
            chunk.zero_grad_buffer()
        with (measuring(decoders, result) if last else contextlib.nullcontext()), \
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
    return result


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
    """megatron's ``forward_step_func``: the model's per-token loss, averaged over the microbatch."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(output_tensor: Tensor):
        loss = output_tensor.float().mean()
        # a copy: megatron scales the returned loss in place by 1 / num_microbatches
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func
