"""Count the kernel-launching ops of a training step with a ``TorchDispatchMode``.

Every aten op (and every ``mhc_cg`` custom op, which the mode sees as one op) that reaches the
dispatcher is counted when it launches device work, as the cost model decides it
(:func:`mhc_cg.lab.cost.ops.launches_kernel`: views, metadata changes and uninitialised allocations
are free). The per-layer figure is the difference between a model of two recompute blocks and
one of one block, divided by the layers that differ, so embedding, head and loss cancel out.
"""

from __future__ import annotations

from collections import Counter

import dataclasses

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mhc_cg.model import MHCGPT
from mhc_cg.lab.references.eager import EagerModel
from mhc_cg.recompute.block_recompute import recompute_activation_eagerly
from mhc_cg.lab.cost.ops import kernel_launches, launches_kernel

class KernelCounter(TorchDispatchMode):
    """``counts[op name]``: kernel-launching ops dispatched while the mode is active."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func, args, kwargs, out):
            name = str(func.overloadpacket).replace("torch.ops.", "")
            self.counts[name] += kernel_launches(func, args, kwargs)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_step(model: EagerModel, input_ids: torch.Tensor, targets: torch.Tensor,
               seed: torch.Tensor | None) -> KernelCounter:
    """Forward, loss and backward of one microbatch (the recompute runs inside the backward)."""
    model.model.zero_grad(set_to_none=True)
    with KernelCounter() as counter:
        logits = model(input_ids, seed)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
    return counter


def kernels_per_layer(cfg, micro_batch_size: int = 2, device: str = "cpu") -> tuple[float, Counter]:
    """Kernel-launching ops per layer per training step for ``cfg`` (an ``MHCGPTConfig``).

    Models of ``2 * L_r`` and ``L_r`` layers (two blocks and one, ``L_r = resolved_recompute_layers``)
    run the same step; returns the per-layer difference and the per-op difference.
    """
    block = cfg.resolved_recompute_layers if cfg.recompute == "block" else 1
    counts = []
    for layers in (block, 2 * block):
        layer_cfg = dataclasses.replace(cfg, num_layers=layers, recompute_layers=block
                                        if cfg.recompute == "block" else cfg.recompute_layers)
        torch.manual_seed(0)
        model = MHCGPT(layer_cfg, recompute_activation_eagerly).to(device).train()
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_length), generator=gen)
        seed = torch.tensor(12345, dtype=torch.int64)
        counts.append(count_step(EagerModel(model), ids.to(device), ids.roll(-1, 1).to(device), seed.to(device)).counts)
    diff = Counter(counts[1])
    diff.subtract(counts[0])
    return sum(diff.values()) / block, +diff
