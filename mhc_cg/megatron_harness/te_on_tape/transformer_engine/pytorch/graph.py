"""TE's ``make_graphed_callables`` on mhc_cg's graphs (the tape on a CPU, ``torch.cuda.CUDAGraph``
on a GPU: the inputs' device decides), and the names megatron imports beside it."""

from __future__ import annotations

from mhc_cg.runtime.graphs import make_graphed_callables as mhc_cg_make_graphed_callables


def set_capture_start() -> None:
    """TE tells its own modules that a capture runs; the stand-in has no TE modules to tell."""


def set_capture_end() -> None:
    """See :func:`set_capture_start`."""


def _fp8_requested(fp8_enabled) -> bool:
    return any(fp8_enabled) if isinstance(fp8_enabled, (tuple, list)) else bool(fp8_enabled)


def make_graphed_callables(modules, sample_args, num_warmup_iters=3, allow_unused_input=False,
                           sample_kwargs=None, fp8_enabled=False, fp8_calibrating=False,
                           fp8_recipe=None, fp8_group=None, fp8_weight_caching=False,
                           _order=None, _num_layers_per_chunk=None, pool=None,
                           retain_graph_in_backward=False,
                           _reuse_graph_input_output_buffers=False, **others):
    """TE's signature; the work is ``mhc_cg.runtime.graphs.make_graphed_callables(...,
    backend="auto")``. What the stand-in cannot stand in for is refused, naming the argument."""
    if _fp8_requested(fp8_enabled) or fp8_calibrating or fp8_weight_caching:
        raise NotImplementedError(
            "the TransformerEngine stand-in has no FP8: fp8_enabled/fp8_calibrating/"
            "fp8_weight_caching need TransformerEngine on a GPU; set fp8 off to run on the CPU")
    if retain_graph_in_backward:
        raise NotImplementedError("the TransformerEngine stand-in captures backward graphs without "
                                  "retain_graph; set cuda_graph_retain_backward_graph=False")
    if pool is not None:
        raise NotImplementedError("the TransformerEngine stand-in makes its own pool; pass pool=None")
    if others:
        raise NotImplementedError(f"the TransformerEngine stand-in does not take "
                                  f"{sorted(others)}; run with real TransformerEngine on a GPU")
    return mhc_cg_make_graphed_callables(
        modules, sample_args, sample_kwargs=sample_kwargs, order=_order,
        num_layers_per_chunk=_num_layers_per_chunk,
        reuse_input_buffers=_reuse_graph_input_output_buffers,
        num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input, backend="auto")


def _no_fp8(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"transformer_engine.pytorch.graph.{name}: the stand-in has no "
                                  f"FP8 state; FP8 needs TransformerEngine on a GPU")
    refuse.__name__ = name
    return refuse


save_fp8_tensors = _no_fp8("save_fp8_tensors")
restore_fp8_tensors = _no_fp8("restore_fp8_tensors")
