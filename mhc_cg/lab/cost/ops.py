"""Which aten ops launch device work, and how many bytes each one reads and writes.

The one definition the cost model (and any kernel count elsewhere) uses:

* **free** (no kernel): views (the schema says the output aliases an input, or every output shares
  an input's storage: ``view``, ``transpose``, ``expand``, ``detach``, ``_unsafe_view``...),
  metadata mutations (``transpose_``, ``set_``, ``resize_``: tagged ``inplace_view`` or listed
  below), uninitialised allocations (``empty``, ``empty_like``...) and shape queries;
* **a kernel**: every other op, custom ops (``torch.ops.<ns>.*``) included. Its bytes are its
  tensor inputs (read) plus its tensor outputs (written); an ``out=`` tensor is written, not read,
  and an in-place op's ``self`` is both.

A fused mHC op (``mhc_cg::*``) says itself how many kernels it launches, which arguments its
kernels read twice and what they pass each other through memory (``LAUNCHES``, ``read_twice`` and
``scratch_bytes`` in :mod:`mhc_cg.lab.cost.fused`).

What this cannot see: a library call that launches several kernels (cuBLAS split-K, attention's
forward and its reduction) counts once; ops the GPU would fuse count separately.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from mhc_cg.core.storage import storage_id
from mhc_cg.lab.cost.fused import LAUNCHES, read_twice, scratch_bytes

aten = torch.ops.aten

# Allocate without writing, or change only metadata / the storage's size: no kernel.
NO_DEVICE_WORK = frozenset({
    aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
    aten.set_, aten.resize_, aten.resize_as_, aten.lift_fresh, aten._unsafe_view,
    aten._reshape_alias, aten.sym_size, aten.sym_stride, aten.sym_numel,
    aten.sym_storage_offset, aten.is_same_size, aten._has_compatible_shallow_copy_type,
    aten.record_stream,
})


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def is_view_schema(func: torch._ops.OpOverload) -> bool:
    """The schema says every output aliases an input and nothing is written (a view op)."""
    returns = func._schema.returns
    if not returns or any(r.alias_info is None or r.alias_info.is_write for r in returns):
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write
                   for a in func._schema.arguments)


def launches_kernel(func: torch._ops.OpOverload, args: tuple = (), kwargs: dict | None = None,
                    out: Any = None) -> bool:
    """Whether ``func`` launches device work. With ``out`` given, an op that wrote nothing and
    returned only tensors sharing an input's storage is a view too (``_unsafe_view`` and kin)."""
    if getattr(func, "namespace", "aten") == "prim":
        return False
    if torch.Tag.inplace_view in func.tags or func.overloadpacket in NO_DEVICE_WORK:
        return False
    if is_view_schema(func):
        return False
    if out is not None and not written_args(func, args, kwargs or {}):
        outputs = _tensors(out)
        inputs = {storage_id(t) for t in _tensors((args, kwargs))}
        if outputs and all(storage_id(o) in inputs for o in outputs):
            return False
    return True


def kernel_launches(func: torch._ops.OpOverload, args: tuple = (),
                    kwargs: dict | None = None) -> int:
    """Kernels one call of a kernel-launching ``func`` makes: a fused mHC op says how many; a
    multi-tensor op (``_foreach_*``, fused optimizers, the AMP inf check) launches as CUDA's
    ``multi_tensor_apply`` chunks its lists (:func:`multi_tensor_launches`); else one."""
    name = func._schema.name
    if name in LAUNCHES:
        return LAUNCHES[name]
    lists = [value for arg, value in _arguments(func, args, kwargs or {})
             if str(arg.type) == "List[Tensor]" and value and arg.name not in _NOT_CHUNKED]
    if not lists:
        return 1
    # an out-of-place op writes a list of its own (a norm writes one scalar per tensor)
    writes_list = any(str(r.type) == "List[Tensor]" for r in func._schema.returns)
    depth = len(lists) + (1 if writes_list and name not in _WITH_CLEANUP else 0)
    launches = multi_tensor_launches([t.numel() for t in lists[0]], depth)
    return launches + (1 if name in _WITH_CLEANUP else 0)


# multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): a block takes a chunk of 65536
# elements; a launch takes at most 320 blocks and, by list depth, 110/64/48/36/30 tensors
CHUNK_ELEMENTS = 65536
MAX_BLOCKS = 320
MAX_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
# lists a fused optimizer reads one scalar from per tensor, not chunked (the step counts)
_NOT_CHUNKED = {"state_steps", "max_exp_avg_sqs"}
# a norm over lists reduces each tensor's partial sums in a second kernel
_WITH_CLEANUP = {"aten::_foreach_norm"}


def multi_tensor_launches(numels: list[int], depth: int) -> int:
    """Kernel launches of one ``multi_tensor_apply`` over tensors of ``numels`` elements with
    ``depth`` lists: a launch when its blocks or its tensors are full, and one for the rest."""
    max_tensors = MAX_TENSORS[min(max(depth, 1), 5)]
    launches = tensors = blocks = 0
    for numel in numels:
        if numel == 0:
            continue
        tensors += 1
        chunks = -(-numel // CHUNK_ELEMENTS)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if blocks == MAX_BLOCKS or (tensors == max_tensors and last):
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (1 if blocks else 0)


def _arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """``(schema argument, value given)`` for each argument of the call."""
    for i, arg in enumerate(func._schema.arguments):
        yield arg, kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]


def _is_written(arg) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


# Arguments the schema marks written that the kernel writes only when another is given: fused
# Adam stores the unscaled gradients back only with a grad_scale (torch's fused_adam_utils.cuh)
WRITTEN_ONLY_WITH = {"aten::_fused_adam_": ("grads", "grad_scale"),
                     "aten::_fused_adamw_": ("grads", "grad_scale")}


def written_args(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments the schema marks as written (``Tensor(a!)``) and the kernel writes."""
    given = dict((arg.name, value) for arg, value in _arguments(func, args, kwargs))
    arg, condition = WRITTEN_ONLY_WITH.get(func._schema.name, (None, None))
    unwritten = arg if arg is not None and given.get(condition) is None else None
    return [t for arg, value in _arguments(func, args, kwargs)
            if _is_written(arg) and arg.name != unwritten for t in _tensors(value)]


# In-place ops that overwrite ``self`` without reading it (a copy writes its destination only).
OVERWRITE_SELF = frozenset({aten.copy_, aten.zero_, aten.fill_})


def _out_args(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Arguments written and not read: ``out=`` (keyword-only), ``self`` of an op that overwrites
    it (``copy_``, ``zero_``, ``fill_``) and, for ops that write into buffers they are given
    (``mhc_cg::post_into``), written arguments named ``out`` or ``*_out``."""
    found = [args[0]] if func.overloadpacket in OVERWRITE_SELF and args else []
    for arg, value in _arguments(func, args, kwargs):
        if _is_written(arg) and (arg.kwarg_only or arg.name == "out"
                                 or arg.name.endswith("_out")):
            found.extend(_tensors(value))
    return found


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, or the span its strides reach when that is
    smaller (an expanded tensor is read once)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return min(t.numel(), span) * t.element_size()


def op_bytes(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """``(read, written)`` bytes of one call: tensor inputs (less written-only arguments, plus the
    arguments a fused op reads twice), and the outputs and written arguments (each tensor once)."""
    written_only = {id(t): t for t in _out_args(func, args, kwargs)}
    read = sum(tensor_bytes(t) for t in _tensors((args, kwargs)) if id(t) not in written_only)
    twice = read_twice(func._schema.name, {arg.name: value for arg, value
                                           in _arguments(func, args, kwargs)})
    read += sum(tensor_bytes(t) for arg, value in _arguments(func, args, kwargs)
                if arg.name in twice for t in _tensors(value))
    written = {id(t): t for t in _tensors(out)}
    written.update((id(t), t) for t in written_args(func, args, kwargs))
    scratch = scratch_bytes(func._schema.name, {arg.name: value for arg, value
                                                in _arguments(func, args, kwargs)}) // 2
    return read + scratch, sum(tensor_bytes(t) for t in written.values()) + scratch


# Matrix products and attention, the ops whose FLOPs can outweigh their bytes.
_GEMMS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}
_ATTENTION_FORWARD = {"aten._scaled_dot_product_flash_attention",
                      "aten._scaled_dot_product_efficient_attention",
                      "aten._scaled_dot_product_flash_attention_for_cpu"}
_ATTENTION_BACKWARD = {name + "_backward" for name in _ATTENTION_FORWARD}


def is_gemm(func: torch._ops.OpOverload) -> bool:
    return str(func.overloadpacket) in _GEMMS


def op_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> int:
    """Floating-point operations of one kernel: ``2 M N K`` for a matrix product; for causal
    attention ``2 b h s^2 d`` forward (two products, half the scores masked) and 2.5 times that
    backward (five products, the scores recomputed); 0 for everything else."""
    name = str(func.overloadpacket)
    if name in _GEMMS:
        a = [t for t in args if isinstance(t, torch.Tensor)]
        mat1, mat2 = a[-2], a[-1]  # addmm / baddbmm: (bias, mat1, mat2)
        batch = mat1.shape[0] if mat1.dim() == 3 else 1
        return 2 * batch * mat1.shape[-2] * mat1.shape[-1] * mat2.shape[-1]
    if name in _ATTENTION_FORWARD or name in _ATTENTION_BACKWARD:
        query = next(t for t in args if isinstance(t, torch.Tensor))  # [b, h, s, d]
        b, h, s, d = query.shape
        forward = 2 * b * h * s * s * d
        return int(2.5 * forward) if name in _ATTENTION_BACKWARD else forward
    return 0
