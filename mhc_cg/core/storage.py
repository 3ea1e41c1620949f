"""Storage identity, the one way this project tells tensors' memory apart."""

from __future__ import annotations

from torch import Tensor


def storage_id(t: Tensor) -> int:
    """Identity of ``t``'s storage (the storage object's address), shared by all its views.

    Not ``data_ptr()``: that is 0 on ``meta`` tensors and for empty storages, changes when a
    storage is resized, and a freed storage's address may be handed to the next allocation.
    Valid while the storage lives.
    """
    return t.untyped_storage()._cdata
