"""What the comparison watches in a training step, through the step's hooks: every gradient's
bytes (hashed on the host) and what the first forward holds until its backward.

Training asks for neither: ``mhc-cg train`` without ``--compare`` hashes nothing and copies no
gradient to the host. The comparison hands :meth:`StepWatch.after_backward` and
:meth:`StepWatch.first_microbatch` to :func:`mhc_cg.training.session.train`, so its step times
include the hashing (its table says so).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from mhc_cg.core.nvtx import profiler_recording


def grad_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter gradient's bytes, in parameter order (``-`` for no gradient):
    two runs have bit-identical gradients exactly when their digests agree."""
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        if p.grad is None:
            h.update(b"-")
        else:
            h.update(p.grad.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def held_bytes(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int | None]:
    """Run ``fn``; return its result and the bytes it allocated that are still live afterwards.

    On CUDA this is the allocator's counter; on CPU, the profiler's allocation events (CPU torch
    keeps no counter), or ``None`` while an outer torch profiler records. Static buffers allocated
    before ``fn`` (arena, slot sets, graph pools) are not counted: this is what each further
    microbatch in flight would add.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.memory_allocated(device) - before
    if profiler_recording():  # an inner profiler would end the outer one's session: no CPU probe
        return fn(), None
    from torch.autograd.profiler import profile

    prof = profile(profile_memory=True)
    with native_stderr_silenced():  # Kineto logs its start and stop there, whatever the level
        prof.__enter__()
    try:
        out = fn()
    finally:
        with native_stderr_silenced():
            prof.__exit__(None, None, None)
    return out, int(sum(e.self_cpu_memory_usage for e in prof.function_events))


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Within: what native code writes to file descriptor 2 goes nowhere (Python's own stderr
    is flushed first and back after)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class StepWatch:
    """The comparison's hooks into one run's steps: ``grad_digests`` (one per step) and
    ``held_bytes_per_microbatch`` (what the first step's first forward holds until its
    backward: the first step, which the median step time leaves out)."""

    device: torch.device
    grad_digests: list[str] = field(default_factory=list)
    held_bytes_per_microbatch: int | None = None

    def after_backward(self, step: int, model: torch.nn.Module) -> None:
        self.grad_digests.append(grad_digest(model))

    def first_microbatch(self, step: int, loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        if step != 0:
            return loss()
        out, self.held_bytes_per_microbatch = held_bytes(loss, self.device)
        return out
