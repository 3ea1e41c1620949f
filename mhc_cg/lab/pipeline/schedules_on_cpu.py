"""Run megatron-core's pipeline schedules on CPU (gloo): the two places they hard-code CUDA.

megatron-core 0.16.1's schedules and p2p layer assume a GPU in exactly two ways on the path the
distributed driver (:mod:`mhc_cg.lab.pipeline.driver`) uses:

* ``P2PCommunicator._communicate`` allocates every receive buffer with
  ``device=torch.cuda.current_device()``; a CPU build of torch raises there;
* the schedules count tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``.

:func:`cpu_shim` redirects both to the CPU for the duration of a ``with`` block, and nothing else:
``torch.cuda.current_device`` answers ``"cpu"``, and a :class:`~torch.overrides.TorchFunctionMode`
rewrites ``device="cuda"`` to ``"cpu"`` in the few tensor factories. The schedule's logic, its order
and its p2p calls are megatron-core's, unchanged. The driver also sets ``batch_p2p_comm=False``
(plain ``isend``/``irecv``, which gloo supports), because the batched path ends in
``torch.cuda.synchronize()``. On a GPU the shim is not entered and NCCL runs the same code.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange}


def names_cuda(device) -> bool:
    """Whether ``device`` (a ``torch.device``, a string or an index) names a CUDA device."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, (str, int)) and not isinstance(device, bool) and (
        isinstance(device, int) or device.split(":")[0] == "cuda")


class _FactoriesOnCPU(TorchFunctionMode):
    """``torch.zeros(..., device="cuda")`` and friends allocate on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Inside: megatron-core's CUDA-only allocations in the pipeline schedules land on the CPU."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with _FactoriesOnCPU():
            yield
    finally:
        torch.cuda.current_device = original
