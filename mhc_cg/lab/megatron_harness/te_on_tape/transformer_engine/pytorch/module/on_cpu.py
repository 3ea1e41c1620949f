"""TE's module classes Megatron's TE extension subclasses, in plain torch on a CPU.

Megatron-LM's ``extensions/transformer_engine.py`` derives its ``TELinear``, ``TENorm``,
``TELayerNormColumnParallelLinear`` and ``TEGroupedLinear`` from these at import, and dev's
DeepSeek-V4 specs build only from those. TE's own modules call its C extension (GEMMs,
normalisations, quantizers), which no CPU has, so the classes here take TE's constructor
keywords and return what TE's ``forward`` returns, computed with torch's ``linear`` and
``rms_norm``/``layer_norm`` (norms in fp32, as TE's kernels). They are not TE's numerics: they
serve runs that compare mhc_cg against Megatron alone on the same stand-in, never TE's figures.

What they refuse, by name, rather than compute something else: tensor parallelism over one rank
(no communication here), FP8 (the recipes are TE's own, from the wheel, and FP8 is off),
userbuffer overlap and delayed weight-gradient compute.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

# what Megatron passes that changes nothing on one CPU rank at full precision
_INERT = {"sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "rng_tracker_name",
          "ub_name", "ub_split_ag", "ub_split_rs", "ub_atomic_gemm_ag", "ub_atomic_gemm_rs",
          "symmetric_ar_type", "save_original_input", "name", "ub_bulk_wgrad", "ub_bulk_dgrad"}
_OFF = {"ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_overlap_ag_fprop",
        "ub_overlap_rs_fprop", "delay_wgrad_compute"}  # accepted only when False


def _check(cls: str, kwargs: dict, tp_size: int) -> None:
    unknown = sorted(set(kwargs) - _INERT - _OFF)
    if unknown:
        raise TypeError(f"{cls} (TE stand-in on the CPU): keywords {unknown} are not served")
    on = sorted(k for k in _OFF if kwargs.get(k))
    if on:
        raise NotImplementedError(f"{cls} (TE stand-in on the CPU): {on} need TE's C extension; "
                                  f"turn them off")
    if tp_size != 1:
        raise NotImplementedError(f"{cls} (TE stand-in on the CPU): tensor parallel size "
                                  f"{tp_size}; the stand-in serves one rank (tp 1)")


def _params_dtype(params_dtype) -> torch.dtype:
    return params_dtype if params_dtype is not None else torch.get_default_dtype()


def _init(weight: nn.Parameter, init_method, tracker) -> None:
    if init_method is None:
        return
    with tracker().fork() if tracker is not None else contextlib.nullcontext():
        init_method(weight)


class _FP8Off(nn.Module):
    """What Megatron reads of TE's module base (``TransformerEngineBaseModule``) around a
    checkpoint, FP8 off: ``fp8_meta``, the FP8 flags, and ``_extra_state``, the empty tensor TE
    saves without FP8 state (a checkpoint with FP8 state is refused)."""

    fp8 = fp8_calibration = False

    def __init__(self):
        super().__init__()
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        pass

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            raise ValueError(f"{type(self).__name__} (TE stand-in on the CPU): the checkpoint "
                             f"holds FP8 state; the stand-in trains with FP8 off")


class Linear(_FP8Off):
    """``te.pytorch.Linear``: ``weight [out, in]``, ``bias [out]``; ``forward`` returns ``out`` or,
    with ``return_bias``, ``(out, bias)`` with the bias left to the caller."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 return_bias: bool = False, init_method=None, get_rng_state_tracker=None,
                 params_dtype=None, parallel_mode=None, device="cuda", tp_size: int = 1,
                 **kwargs):
        super().__init__()
        _check(type(self).__name__, kwargs, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias, self.parallel_mode = bias, return_bias, parallel_mode
        dtype = _params_dtype(params_dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=_device(device)))
        _init(self.weight, init_method, get_rng_state_tracker)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=_device(device)))
                     if bias else None)

    def _linear(self, x: torch.Tensor):
        if self.return_bias:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias)

    def forward(self, inp: torch.Tensor, is_first_microbatch=None, fp8_output: bool = False,
                fp8_grad: bool = False):
        return self._linear(inp)


class _Norm(nn.Module):
    """TE's norms: computed in fp32, cast to the input's dtype; ``zero_centered_gamma`` learns
    ``weight - 1``."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, sequence_parallel=False,
                 params_dtype=None, zero_centered_gamma: bool = False, device="cuda", **kwargs):
        super().__init__()
        _check(type(self).__name__, kwargs, 1)
        dtype, device = _params_dtype(params_dtype), _device(device)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter((torch.zeros if zero_centered_gamma else torch.ones)(
            normalized_shape, dtype=dtype, device=device))

    def gamma(self) -> torch.Tensor:
        return self.weight.float() + 1 if self.zero_centered_gamma else self.weight.float()


class RMSNorm(_Norm):
    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return rms_norm(inp, self.gamma(), self.eps)


class LayerNorm(_Norm):
    def __init__(self, normalized_shape: int, eps: float = 1e-5, **kwargs):
        super().__init__(normalized_shape, eps, **kwargs)
        self.bias = nn.Parameter(torch.zeros_like(self.weight))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return layer_norm(inp, self.gamma(), self.bias, self.eps)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), gamma, eps).to(x.dtype)


def layer_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float):
    return F.layer_norm(x.float(), (x.shape[-1],), gamma, beta.float(), eps).to(x.dtype)


class LayerNormLinear(Linear):
    """``te.pytorch.LayerNormLinear``: the norm (``layer_norm_weight``, and ``layer_norm_bias``
    for LayerNorm) then the linear; ``return_layernorm_output`` appends the norm's output."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = 1e-5,
                 normalization: str = "LayerNorm", zero_centered_gamma: bool = False,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered=False,
                 **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"LayerNormLinear: normalization {normalization!r}")
        self.eps, self.normalization = eps, normalization
        self.zero_centered_gamma, self.return_layernorm_output = (zero_centered_gamma,
                                                                  return_layernorm_output)
        like = self.weight.new_zeros(in_features)
        self.layer_norm_weight = nn.Parameter(like.clone() if zero_centered_gamma else like + 1)
        self.layer_norm_bias = (nn.Parameter(like.clone()) if normalization == "LayerNorm"
                                else None)

    def forward(self, inp: torch.Tensor, is_first_microbatch=None, fp8_output: bool = False,
                fp8_grad: bool = False):
        gamma = self.layer_norm_weight.float() + (1 if self.zero_centered_gamma else 0)
        normed = (rms_norm(inp, gamma, self.eps) if self.normalization == "RMSNorm"
                  else layer_norm(inp, gamma, self.layer_norm_bias, self.eps))
        out = self._linear(normed)
        if not self.return_layernorm_output:
            return out
        return (*out, normed) if self.return_bias else (out, normed)


class GroupedLinear(_FP8Off):
    """``te.pytorch.GroupedLinear``: ``num_gemms`` linears ``weight{i}``/``bias{i}`` over the
    row blocks ``m_splits`` of the input; with ``return_bias``, ``(out, [bias_i])``."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *,
                 bias: bool = True, return_bias: bool = False, init_method=None,
                 get_rng_state_tracker=None, params_dtype=None, parallel_mode=None,
                 device="cuda", tp_size: int = 1, **kwargs):
        super().__init__()
        _check(type(self).__name__, kwargs, tp_size)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias, self.parallel_mode = bias, return_bias, parallel_mode
        dtype, device = _params_dtype(params_dtype), _device(device)
        for i in range(num_gemms):
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                              device=device))
            _init(weight, init_method, get_rng_state_tracker)
            self.register_parameter(f"weight{i}", weight)
            self.register_parameter(f"bias{i}", nn.Parameter(
                torch.zeros(out_features, dtype=dtype, device=device)) if bias else None)

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch=None):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        parts = torch.split(inp, list(m_splits))
        out = torch.cat([F.linear(x, w, None if self.return_bias else b)
                         for x, w, b in zip(parts, weights, biases)])
        return (out, biases) if self.return_bias else out


class DotProductAttention(nn.Module):
    """``te.pytorch.DotProductAttention``: an ``issubclass`` target only. DeepSeek-V4's
    attention is Megatron's own module; a model that builds TE's attention is refused here."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("TEDotProductAttention is not served by the CPU stand-in of "
                                  "TransformerEngine; use --transformer-impl local for standard "
                                  "attention on a CPU")


def _device(device) -> str:
    return "cpu" if device is None or str(device).startswith("cuda") or isinstance(device, int) \
        else device
