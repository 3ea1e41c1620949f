"""Labels on regions of work, so a step's bytes can be attributed: the phase the work belongs to
and, for the copies the runtime adds, what each copy is for.

::

    with phase("recompute"):              # forward | recompute | backward | optimizer
        ...
    with runtime_copy("static inputs"):   # a copy a graphed mode adds over eager
        static.copy_(given)
    with mhc():                           # the mHC steps' own work (not F's)
        ...

A label is a push on a process-wide stack (the autograd engine may run backward on another thread,
so not a context variable); nothing reads the labels unless the cost model records
(:mod:`mhc_cg.tools.cost`), which reads them when it records an op: at dispatch for eager work,
at capture for a graph's work. The innermost label wins.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

PHASES = ("forward", "recompute", "backward", "optimizer")

_phases: list[str] = []
_copies: list[str] = []
_mhc: list[bool] = []


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Work inside is ``name``'s (one of :data:`PHASES`)."""
    _phases.append(name)
    try:
        yield
    finally:
        _phases.pop()


@contextlib.contextmanager
def runtime_copy(what: str) -> Iterator[None]:
    """The ops inside copy data the runtime moves for ``what`` (no eager run would)."""
    _copies.append(what)
    try:
        yield
    finally:
        _copies.pop()


@contextlib.contextmanager
def mhc() -> Iterator[None]:
    """The ops inside are the mHC steps' (mappings, aggregate, H_res, H_post, the stream expand
    and contract), not F's: they seed what the cost model counts as mHC traffic."""
    _mhc.append(True)
    try:
        yield
    finally:
        _mhc.pop()


def in_mhc() -> bool:
    return bool(_mhc)


def current_phase() -> str | None:
    return _phases[-1] if _phases else None


def current_copy() -> str | None:
    return _copies[-1] if _copies else None
