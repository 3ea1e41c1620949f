"""CUDA graphs with plain PyTorch: ``torch.cuda.CUDAGraph`` on shared memory pools.

The capture runs under :class:`~mhc_cg.graphs.guard.CaptureGuardMode` too, so an illegal op is
rejected with the op's name and the user's line before CUDA reports a bare "operation not
permitted when stream is capturing", and storage resizes are caught like on the tape. The guard
only checks; the driver records the kernels.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from mhc_cg.graphs.capture import Graph, GraphBackend, Pool
from mhc_cg.graphs.guard import CaptureGuardMode


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device (torch.cuda.is_available() is False); "
                           f"use backend='tape' to emulate graphs on the CPU")


_LIBRARIES_WARM: set[int] = set()


def warm_up_libraries() -> None:
    """Create cuBLAS/cuBLASLt handles and workspaces before any capture, once per device.

    Their lazy creation (the first matmul of a process, per dtype path) allocates and
    synchronises, which a capture refuses; a graph captured first would fail or record it.
    """
    device = torch.cuda.current_device()
    if device in _LIBRARIES_WARM:
        return
    torch.cuda.current_blas_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # captures run on a side stream too
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            a = torch.ones(16, 16, device="cuda", dtype=dtype)
            (a @ a).sum()
            torch.nn.functional.linear(a, a, a[0])
    torch.cuda.synchronize()
    _LIBRARIES_WARM.add(device)


class CudaPool(Pool):
    """A ``torch.cuda.graph_pool_handle()`` and the replay order of the graphs that share it."""

    kind = "cuda"

    def __init__(self, number: int, private: bool = False, independent: bool = False):
        _require_cuda("a CUDA graph pool")
        super().__init__(number, private, independent)
        # A private pool: let torch.cuda.graph make one for the graph (pool=None).
        self.handle = None if private else torch.cuda.graph_pool_handle()


class CudaGraph(Graph):
    """A ``torch.cuda.CUDAGraph`` captured on a side stream (``torch.cuda.graph`` does that)."""

    def __init__(self, pool: CudaPool):
        super().__init__(pool)
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def _record(self) -> Iterator[None]:
        guard = CaptureGuardMode(self.name)
        with torch.cuda.graph(self.graph, pool=self.pool.handle):
            with guard:
                yield
        self.stats = guard.finish()
        self.made_storages = guard.made_storages()

    def _replay(self) -> None:
        self.graph.replay()

    def _release(self, t: torch.Tensor) -> torch.Tensor:
        return unowned_alias(t)

    def _free_early(self, t: torch.Tensor) -> torch.Tensor:
        alias = unowned_alias(t)
        t.untyped_storage().resize_(0)  # the block goes back to this graph's pool
        return alias


class _DeviceBytes:
    """The bytes behind a tensor, as a ``__cuda_array_interface__`` that owns nothing."""

    def __init__(self, data_ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (data_ptr, False), "version": 3}


def unowned_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated (``t``'s block returns to its
    pool when ``t`` dies; the alias then reads whatever the pool's next user wrote there)."""
    if t.numel() == 0:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    raw = torch.as_tensor(_DeviceBytes(t.data_ptr(), span * t.element_size()), device=t.device)
    return raw.view(t.dtype).as_strided(t.size(), t.stride())


class CudaBackend(GraphBackend):
    """``torch.cuda.CUDAGraph`` graphs; warmup runs on a side stream."""

    name = "cuda"
    device = "cuda"
    pool_type = CudaPool
    graph_type = CudaGraph

    def __init__(self) -> None:
        _require_cuda("the 'cuda' graph backend")
        super().__init__()
        warm_up_libraries()

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def synchronize(self) -> None:
        torch.cuda.synchronize()
