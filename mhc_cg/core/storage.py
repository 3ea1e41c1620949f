"""Storage identity, the one way this project tells tensors' memory apart.

Note [one concept, one home] (docs/design.md, item 10): storage identity is :func:`storage_id`,
never ``data_ptr``; each other concept has one module too (the design lists them).
"""

from __future__ import annotations

from torch import Tensor


def storage_id(t: Tensor) -> int:
    """Identity of ``t``'s storage (the storage object's address), shared by all its views.

    Not ``data_ptr()``: that is 0 on ``meta`` tensors and for empty storages, changes when a
    storage is resized, and a freed storage's address may be handed to the next allocation.
    Valid while the storage lives.
    """
    return t.untyped_storage()._cdata


def own_version_alias(t: Tensor, offset: int | None = None, shape=None, stride=None) -> Tensor:
    """A tensor over ``t``'s storage with a version counter of its own (``t``'s geometry unless
    ``offset``/``shape``/``stride`` say otherwise).

    Views share their base's version counter, so writing through a view invalidates whatever
    autograd saved of any other view of the same base; a tensor made with ``set_`` on the storage
    is no view: writes through it bump only its own counter. That is how a static buffer is written
    while views of it saved for backward stay valid, and how one buffer becomes a graph's static
    input (a leaf of its own) without grafting autograd nodes onto the buffer itself.
    """
    alias = t.new_empty(0)
    return alias.set_(t.untyped_storage(), t.storage_offset() if offset is None else offset,
                      t.shape if shape is None else shape, t.stride() if stride is None else stride)


def is_buffer(static: Tensor, given: Tensor) -> bool:
    """``given`` is ``static``: the same storage, offset, shape and strides."""
    return (storage_id(static) == storage_id(given)
            and static.storage_offset() == given.storage_offset()
            and static.shape == given.shape and static.stride() == given.stride())


def alias(t: Tensor) -> Tensor:
    """A new tensor over ``t``'s memory with ``t``'s geometry (a view: it shares ``t``'s version
    counter). An autograd Function that writes into a buffer returns this, so that its output is
    the Function's own and not the buffer handed back."""
    return t.as_strided(t.size(), t.stride(), t.storage_offset())


def distinct_storage_bytes(tensors, exclude=frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors``, each counted once, those whose
    :func:`storage_id` is in ``exclude`` (parameters, say) left out. A storage freed by a recompute
    (resized to 0) counts 0."""
    return sum(storage_bytes(tensors, exclude).values())


def storage_bytes(tensors, exclude=frozenset()) -> dict[int, int]:
    """``{storage_id: bytes}`` of the distinct storages behind ``tensors``, less ``exclude``."""
    found: dict[int, int] = {}
    for t in tensors:
        key = storage_id(t)
        if key not in exclude and key not in found:
            found[key] = t.untyped_storage().nbytes()
    return found
