"""What a graph's static input accepts at replay, checked the same way everywhere.

A replayed graph reads its inputs from static buffers with the geometry they had at capture. A
given tensor is first checked against its buffer (:func:`check_input`: shape, dtype, device; one
message format for every graphed callable, the static runtime's chunk input and every graphed
mode's dropout seed), then loaded into it (:func:`load_input`):

* the buffer itself (same storage, offset, shape and strides) is used as it is, as TE does;
* a tensor that shares the buffer's memory with another geometry (``buffer.t()``, a shifted view)
  is copied through a temporary: ``copy_`` between overlapping tensors reads what it already
  overwrote;
* anything else is copied in.

A buffer itself must keep the layout it had at capture (:func:`layout_problem`): a graph's kernels
hold its address, sizes and strides from the capture, so re-laying it out in place (``t_``,
``as_strided_``, ``resize_`` within its bytes) or moving it to another storage (``set_``) would go
unseen by the replay, which reads the old layout as if nothing happened.

The cost is O(inputs) per replay and never synchronises the device.

Every static buffer (a graph's inputs, an arena, persistent sets) is registered where it is made
(:func:`static_buffer`): a GPU run allocates it on the device, and the tape, whose one device is
the host, must not take a 0-dim one for a CPU scalar (:mod:`~mhc_cg.lab.emulation.tape`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from mhc_cg.core.storage import is_buffer, storage_id


# weak (a buffer is forgotten with its tensor) and by identity (a WeakSet would compare tensors
# with ==, elementwise)
_STATIC_BUFFERS = WeakIdKeyDictionary()


def static_buffer(t: Tensor) -> Tensor:
    """Register ``t`` as a static buffer (device memory every replay reads where it lies); returns
    it. The register is by storage: views of ``t`` count too."""
    _STATIC_BUFFERS[t] = True
    return t


def static_storages() -> set[int]:
    """Storage ids of every live static buffer."""
    return {storage_id(t) for t in list(_STATIC_BUFFERS.keys())}


def describe(t) -> str:
    if not isinstance(t, Tensor):
        return "None" if t is None else f"{type(t).__name__} {t!r}"
    return f"{list(t.shape)} {t.dtype} on {t.device}"


def input_problem(what: str, given, shape, dtype: torch.dtype, device: torch.device) -> str | None:
    """One line naming ``what`` and the fix, or ``None`` when ``given`` fits the buffer."""
    if isinstance(given, Tensor) and tuple(given.shape) == tuple(shape) and given.dtype == dtype \
            and given.device == device:
        return None
    return (f"{what} is {describe(given)}, but the graph was captured with {list(shape)} {dtype} "
            f"on {device}; pass a tensor of that shape, dtype and device (a graph replays fixed "
            f"shapes)")


def check_input(what: str, given, static: Tensor) -> None:
    """Raise ``ValueError`` (:func:`input_problem`) unless ``given`` fits ``static``."""
    problem = input_problem(what, given, static.shape, static.dtype, static.device)
    if problem is not None:
        raise ValueError(problem)


def load_input(static: Tensor, given: Tensor) -> None:
    """Make ``static`` hold ``given``'s values (see the module docstring)."""
    if is_buffer(static, given):
        return
    if storage_id(static) == storage_id(given):
        given = given.clone()  # overlapping memory in another layout
    static.copy_(given)


BufferLayout = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def buffer_layout(t: Tensor) -> BufferLayout:
    """What a kernel's arguments freeze of ``t``: its storage, offset, sizes and strides."""
    return storage_id(t), t.storage_offset(), tuple(t.shape), t.stride()


def layout_problem(what: str, t: Tensor, captured: BufferLayout) -> str | None:
    """One line naming ``what`` when ``t``'s layout is no longer ``captured``, else ``None``."""
    now = buffer_layout(t)
    if now == captured:
        return None
    if now[0] != captured[0]:
        return (f"{what} was moved to another storage since capture (set_, .data =); the graph "
                f"keeps reading and writing the old one: keep the buffer where it was, or capture "
                f"again")
    return (f"{what} was re-laid-out in place since capture (t_, as_strided_, resize_): sizes "
            f"{list(now[2])} strides {now[3]} offset {now[1]} now, captured with sizes "
            f"{list(captured[2])} strides {captured[3]} offset {captured[1]}; the graph keeps "
            f"reading the captured layout at the same address: undo the change, or capture again")
