"""One microbatch in flight on the static runtime: :class:`Frame`, passed down its forward.

Note [one frame per microbatch]: what a chunk's forward of one microbatch carries from sublayer
to sublayer and leaves for its backward is one object, made where the microbatch starts (the
runtime's forward, or a mode's captures, which record one microbatch) and handed to every call:
the persistent set it writes, its dropout seed, what one fused post hands the next pre (a
:class:`~mhc_cg.ops.kernels.Handoff`: its link, and its state where no set holds it), and what
its backward hooks must know (released by ``release_pending``, which blocks were recomputed).
Nothing of it is looked up by a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from mhc_cg.ops.kernels import Handoff
from mhc_cg.runtime.persistent import PersistentSlotSet


@dataclass(eq=False)
class Frame:
    """One microbatch's forward through a chunk (Note [one frame per microbatch]).

    ``pset``: the persistent set it writes (``None`` in a capture that serves several
    microbatches, whose forward copies in after it); ``seed``: the dropout seed the ops read
    (``None``: no dropout). ``handoff``: what the last fused post handed the pre after it, the
    sublayer of ``handed_to`` (the state lies in the set where there is one; the link, always);
    a graph between them takes nothing, so a pre takes only what is its own. ``released``:
    ``release_pending`` gave its set back (a backward must then refuse); ``recomputed``: the
    blocks whose backward hook ran.
    """

    pset: PersistentSlotSet | None
    seed: Tensor | None
    handoff: Handoff | None = None
    handed_to: int | None = None
    released: bool = False
    recomputed: set[int] = field(default_factory=set)

    def hand(self, order: int, handoff: Handoff | None) -> None:
        """What a post hands the pre of the sublayer at ``order`` (its record's)."""
        self.handoff, self.handed_to = handoff, order

    def take(self, order: int) -> Handoff | None:
        """What the post before handed the pre of the sublayer at ``order``, if it was handed to
        it; once."""
        handoff, mine = self.handoff, self.handed_to == order
        self.handoff = self.handed_to = None
        return handoff if mine else None
