"""What an autograd graph holds: the storages its nodes saved for backward."""

from __future__ import annotations

from typing import Sequence

import torch

from mhc_cg.core.storage import storage_id


def saved_storages(outputs: Sequence[torch.Tensor]) -> set[int]:
    """Storage ids of every tensor the autograd graph behind ``outputs`` saved for backward
    (C++ nodes' ``_saved_*`` attributes, Python functions' ``saved_tensors``), down to the leaves."""
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen, found = set(), set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if not (name.startswith("_saved_") or name == "saved_tensors"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed, or not a tensor attribute
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    found.add(storage_id(t))
        stack.extend(child for child, _ in node.next_functions)
    return found
