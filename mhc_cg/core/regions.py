"""Regions of work, each named once: the name nsys and torch's profiler show, and the label the
cost model attributes a step's bytes by.

::

    with region("forward"):                   # a phase of the training step
        ...
    with region("fwd", 0, None, "3.attn"):     # one graph or eager segment: "fwd/0/-/3.attn"
        ...
    with region("copy", "static inputs"):      # a copy the runtime adds over eager
        static.copy_(given)
    with region("mhc"):                        # the mHC steps' own work (not F's)
        ...

A region's name is its parts joined by ``/`` (:func:`mhc_cg.core.nvtx.range_name`: trailing
``None`` parts dropped, inner ones ``-``); its first part is its kind. The kinds the cost model
reads: a phase (:data:`PHASES`; ``fwd`` and ``bwd``, a graph's forward and backward, are the
forward's and the backward's; ``eager``, ``step``, ``iteration`` and ``eval`` name no phase),
``copy`` (the second part says what for) and ``mhc``. The innermost region of a kind wins.

Open regions are a process-wide stack (the autograd engine may run backward on another thread, so
not a context variable); nothing reads it unless the cost model records (:mod:`mhc_cg.lab.cost`),
which reads it when it records an op: at dispatch for eager work, at capture for a graph's work.
The profiler half is :func:`mhc_cg.core.nvtx.nvtx_range` (off: nothing but the stack).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from mhc_cg.core.nvtx import nvtx_range, range_name

PHASES = ("forward", "recompute", "backward", "optimizer")
_PHASE_OF = {"forward": "forward", "fwd": "forward", "recompute": "recompute",
             "backward": "backward", "bwd": "backward", "optimizer": "optimizer"}

_open: list[str] = []


@contextlib.contextmanager
def region(kind: str, *parts) -> Iterator[None]:
    """The work inside is the region ``kind/parts...`` (see the module docstring)."""
    name = range_name(kind, *parts)
    _open.append(name)
    try:
        with nvtx_range(kind, *parts):
            yield
    finally:
        _open.pop()


def current_phase() -> str | None:
    """The innermost open region's phase (:data:`PHASES`), or ``None``."""
    for name in reversed(_open):
        phase = _PHASE_OF.get(name.partition("/")[0])
        if phase is not None:
            return phase
    return None


def current_copy() -> str | None:
    """What the innermost open ``copy`` region copies for, or ``None``."""
    for name in reversed(_open):
        kind, _, what = name.partition("/")
        if kind == "copy":
            return what
    return None


def in_mhc() -> bool:
    """Whether an ``mhc`` region is open: the work is the mHC steps', not F's."""
    return "mhc" in _open
