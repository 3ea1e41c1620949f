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
(:mod:`mhc_cg.cost`), which reads them when it records an op: at dispatch for eager work,
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
def _pushed(stack: list, value) -> Iterator[None]:
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def phase(name: str) -> contextlib.AbstractContextManager:
    """Work inside is ``name``'s (one of :data:`PHASES`)."""
    return _pushed(_phases, name)


def runtime_copy(what: str) -> contextlib.AbstractContextManager:
    """The ops inside copy data the runtime moves for ``what`` (no eager run would)."""
    return _pushed(_copies, what)


def mhc() -> contextlib.AbstractContextManager:
    """The ops inside are the mHC steps' (mappings, aggregate, H_res, H_post, the stream expand
    and contract), not F's: they seed what the cost model counts as mHC traffic."""
    return _pushed(_mhc, True)


def in_mhc() -> bool:
    return bool(_mhc)


def current_phase() -> str | None:
    return _phases[-1] if _phases else None


def current_copy() -> str | None:
    return _copies[-1] if _copies else None
