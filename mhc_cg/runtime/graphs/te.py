"""TransformerEngine as a graph backend.

The low-level primitive is the same ``torch.cuda.CUDAGraph`` as the ``cuda`` backend (TE has no
graph object of its own); what TE adds is its ``make_graphed_callables`` (FP8 metadata handling,
TE module bookkeeping), which :func:`te_make_graphed_callables` passes the call through to with
TE's private argument names. TE is imported only when this backend is chosen.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Sequence

from mhc_cg.runtime.graphs.cuda import CudaBackend, CudaPool


def import_te() -> ModuleType:
    """``transformer_engine.pytorch``, or a clear error saying why it cannot be used."""
    try:
        import transformer_engine.pytorch as te_pytorch
    except Exception as exc:  # ImportError, or TE's own failure to load its CUDA extension
        raise RuntimeError(
            "graph backend 'te' needs TransformerEngine with its PyTorch extension "
            "(pip install 'transformer-engine[pytorch]' on a CUDA machine); importing "
            f"transformer_engine.pytorch failed: {exc!r}. Use backend='cuda' (plain "
            "torch.cuda.CUDAGraph) or backend='tape' (CPU emulation) instead") from exc
    return te_pytorch


class TEBackend(CudaBackend):
    """CUDA graphs whose pools come from TE's ``graph_pool_handle``."""

    name = "te"
    device = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self.te = import_te()

    def new_pool(self, independent: bool = False) -> CudaPool:
        from transformer_engine.pytorch.graph import graph_pool_handle
        return CudaPool(handle=graph_pool_handle(), independent=independent)


def te_make_graphed_callables(callables: tuple[Callable, ...], sample_args: list, *,
                              sample_kwargs: list | None, order: Sequence[int] | None,
                              num_layers_per_chunk: int | Sequence[int] | None,
                              reuse_input_buffers: bool, pool: Any, num_warmup_iters: int,
                              allow_unused_input: bool) -> Any:
    """TE's ``make_graphed_callables`` with our argument names mapped onto TE's.

    TE reorganises ``sample_args`` in place when it reuses buffers (a later forward's entry
    becomes the earlier forward's tuple), so the caller can count static inputs afterwards.
    """
    te_pytorch = import_te()
    handle = pool.handle if isinstance(pool, CudaPool) else pool
    return te_pytorch.make_graphed_callables(
        callables, sample_args,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        sample_kwargs=sample_kwargs,
        _order=list(order) if order is not None else None,
        _num_layers_per_chunk=(list(num_layers_per_chunk)
                               if isinstance(num_layers_per_chunk, (list, tuple))
                               else num_layers_per_chunk),
        pool=handle,
        _reuse_graph_input_output_buffers=bool(reuse_input_buffers and order is not None),
    )
