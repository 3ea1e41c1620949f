"""One sublayer on the static buffers: the strategy's pre, F, the strategy's post, and what the
persistent set keeps of it (F's output and, for a fused sublayer, its mapping state).

Two halves around F (:meth:`SublayerPath.run` and :meth:`SublayerPath.finish`), because a graph
may end between them (MoE partial capture) and the eager remainder must find its buffers without
the Python state of the captured part. Each call takes the sublayer's record, its input and the
microbatch's frame, and what is truly per call: where the chunk's output may go (``scratch``,
Note [forward scratch]) and whether a graph's own buffer brings the output's gradient
(``grad_owned``).
"""

from __future__ import annotations

from torch import Tensor

from mhc_cg.core.regions import region
from mhc_cg.core.storage import storage_id
from mhc_cg.runtime.activation import ActivationSlots
from mhc_cg.runtime.chunk import SublayerRecord
from mhc_cg.runtime.frame import Frame
from mhc_cg.runtime.sublayers import required_set


class SublayerPath:
    """A sublayer's forward on the static runtime with the strategy ``sublayers``
    (:mod:`mhc_cg.runtime.sublayers`) and the MLPs' ``activations``."""

    def __init__(self, sublayers, activations: ActivationSlots):
        self.sublayers, self.activations = sublayers, activations

    def run(self, record: SublayerRecord, x: Tensor, frame: Frame, scratch: Tensor | None = None,
            grad_owned: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """``MHCSublayer.forward`` on the static buffers, writing ``frame``'s set; returns
        ``(output, F output, mapping state or None for hooked sublayers)``."""
        fn_input, carry = self.sublayers.pre(record, x, frame)
        out = self.sublayers.fn_output_buffer(record, frame.pset)
        fn = record.sub.fn
        if record.recompute_activation:
            y = self.activations.mlp(record, fn, fn_input, required_set(
                frame.pset, "an MLP with activation recompute: fc1's output"), out)
        elif out is not None:
            y = fn(fn_input, out)
        else:
            y = fn(fn_input)
        return self.finish(record, y, carry, frame, scratch, grad_owned)

    def finish(self, record: SublayerRecord, y: Tensor, carry: tuple, frame: Frame,
               scratch: Tensor | None = None,
               grad_owned: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """The mHC ops after F (``carry`` what the strategy's pre returned): ``(output, F output
        as the persistent set keeps it, mapping state or None)``."""
        out = self.sublayers.post(record, y, carry, frame, scratch, grad_owned)
        return (out, self.sublayers.kept_fn_output(record, y, frame.pset),
                self.sublayers.state(carry))

    def keep(self, record: SublayerRecord, frame: Frame, y: Tensor, state: Tensor | None) -> None:
        """What the recompute reads: F's output (and a fused sublayer's state) into the set,
        unless the sublayer wrote it there."""
        pset = frame.pset
        for dst, t in ((pset.fn_outputs[record.key], y), (pset.states.get(record.key), state)):
            if dst is None or t is None:
                continue
            if storage_id(dst) != storage_id(t) or dst.storage_offset() != t.storage_offset():
                with region("copy", "persistent set"):
                    dst.copy_(t.detach())
