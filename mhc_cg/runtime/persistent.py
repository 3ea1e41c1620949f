"""Persistent slot sets: what each in-flight microbatch keeps for its block recompute, and the
first-in first-out pool that hands them out along a rank's order.

Note [persistent state per microbatch] (docs/design.md, item 3). A set holds only what the
recompute needs: each block's input x_l0, each
sublayer's F output, the dropout seed, for fused sublayers each one's mapping state
(``[proj | xnorm | rstd]``, n^2 + 2n + 2 values per token) and, for MLPs with activation recompute, fc1's
output. Its
buffers have static addresses: recompute graphs captured on a set read them in place, so a set is
never reused before the microbatch that holds it has run its backward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.model import MHCTransformerLayer
from mhc_cg.ops.kernels.reference import state_dtype, state_width
from mhc_cg.core.storage import own_version_alias
from mhc_cg.graphs.static_inputs import static_buffer
from mhc_cg.runtime.chunk import ChunkLayout


@dataclass
class PersistentSlotSet:
    """What one in-flight microbatch keeps for the recompute of its blocks.

    ``block_inputs[b]`` is x_l0 of recompute block ``b`` ([s, b, n*C]); ``fn_outputs[(i, k)]`` is
    the F output of sublayer ``k`` (0 attention, 1 MLP) of the chunk's ``i``-th layer ([s, b, C]).
    Keys are positions in the chunk, so chunks of equal depth can share one pool of sets; ``seed`` is the
    microbatch's dropout seed. ``fc1_outputs[i]`` is the MLP's pre-activation ([s, b, ffn]) of
    the chunk's ``i``-th layer, only for layers with activation recompute: the gelu saves a view of
    it, and the block recompute re-derives the gelu output from it into the arena. Static
    addresses: graphs read them in place.
    """

    index: int
    block_inputs: list[Tensor]
    fn_outputs: dict[tuple[int, int], Tensor]
    seed: Tensor
    fc1_outputs: dict[int, Tensor] = field(default_factory=dict)
    # fused sublayers: per block, F's outputs and the mapping states stacked [S, s, b, ...] (the
    # block recompute reads them as one tensor each); ``fn_outputs`` / ``states`` view them
    block_fn_outputs: list[Tensor] = field(default_factory=list)
    block_states: list[Tensor] = field(default_factory=list)
    states: dict[tuple[int, int], Tensor] = field(default_factory=dict)

    def tensors(self) -> list[Tensor]:
        fn_outputs = self.block_fn_outputs or list(self.fn_outputs.values())
        return [*self.block_inputs, *fn_outputs, *self.block_states, *self.fc1_outputs.values(),
                self.seed]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors()]


class PersistentSetPool:
    """Persistent slot sets, handed out first-in first-out along a rank's order; whenever none is
    in use (between steps) the free list is back in index order.

    ``capacity`` is how many microbatches may be in flight (the schedule planner's figure); asking
    for more is an error, since a graph captured on a set must never see its set reused early.
    ``peak_in_use``: the most sets in use at once so far; ``last_round``: the set indices taken,
    in order, from one time every set was free to the next (a training step's, on a pipeline
    rank), to check against the planner's assignment.
    """

    def __init__(self, capacity: int, make_set: Callable[[int], PersistentSlotSet]):
        if capacity < 1:
            raise StaticRecomputeError(f"persistent set capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._sets = [make_set(i) for i in range(capacity)]
        self._free: deque[PersistentSlotSet] = deque(self._sets)
        self._in_use: list[PersistentSlotSet] = []
        self._round: list[int] = []
        self.last_round: list[int] = []
        self.peak_in_use = 0

    def acquire(self) -> PersistentSlotSet:
        if not self._free:
            raise StaticRecomputeError(
                f"more than {self.capacity} microbatches in flight: the persistent slot sets were "
                f"sized for {self.capacity}: raise the capacity to the schedule's peak in flight; "
                f"or, if a forward's backward never came (a skipped step, a forward run for its "
                f"value with gradients on), call release_pending() on the model first")
        pset = self._free.popleft()
        self._in_use.append(pset)
        self._round.append(pset.index)
        self.peak_in_use = max(self.peak_in_use, len(self._in_use))
        return pset

    def next_set(self) -> PersistentSlotSet | None:
        """The set the next :meth:`acquire` returns, or ``None`` if every set is in use."""
        return self._free[0] if self._free else None

    def fixed_set(self) -> PersistentSlotSet | None:
        """The set every forward takes, when the pool holds just one; else ``None``. Work outside
        a forward (a graph captured once and replayed for every microbatch, layout discovery)
        may write that set; with more, only a capture for its microbatch's set may write one."""
        return self._sets[0] if len(self._sets) == 1 else None

    def release(self, pset: PersistentSlotSet) -> None:
        if pset not in self._in_use:
            raise StaticRecomputeError(f"persistent set {pset.index} released twice")
        self._in_use.remove(pset)
        self._free.append(pset)
        if not self._in_use:
            # every step starts from index order, as assign_persistent_slot_sets assumes: a graph
            # captured for microbatch k of a step writes the set that k takes in every step
            self._free = deque(self._sets)
            self.last_round, self._round = self._round, []

    def all_sets(self) -> list[PersistentSlotSet]:
        return list(self._sets)

    @property
    def template(self) -> PersistentSlotSet:
        """A set to read the sets' shapes, dtypes and device from: they are all alike."""
        return self._sets[0]

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    @property
    def nbytes_per_set(self) -> int:
        return self._sets[0].nbytes


def new_persistent_set(index: int, layers: list[MHCTransformerLayer], block_size: int,
                       seq_length: int, micro_batch_size: int, device: torch.device | str,
                       dtype: torch.dtype = torch.float32) -> PersistentSlotSet:
    """Zeroed static buffers for one in-flight microbatch of ``layers`` (one model chunk) in
    blocks of ``block_size`` layers: an entry per sublayer record (:class:`ChunkLayout`)."""
    layout = ChunkLayout(layers, block_size)
    cfg = layout.cfg
    width = cfg.num_streams * cfg.hidden_size
    lead = (seq_length, micro_batch_size)
    pset = PersistentSlotSet(
        index=index,
        block_inputs=[torch.zeros(*lead, width, dtype=dtype, device=device)
                      for _ in range(layout.num_blocks)],
        fn_outputs={},
        seed=static_buffer(torch.zeros((), dtype=torch.int64, device=device)),  # 0-dim, on device
        fc1_outputs={r.index: torch.zeros(*lead, r.sub.fn.fc1.out_features, dtype=dtype,
                                          device=device)
                     for r in layout.records if r.recompute_activation},
    )
    if not layout.records[0].sub.fused:
        pset.fn_outputs = {r.key: torch.zeros(*lead, cfg.hidden_size, dtype=dtype, device=device)
                           for r in layout.records}
        return pset
    width = state_width(cfg.num_streams * (cfg.num_streams + 2))
    for records in layout.blocks:
        ys = torch.zeros(len(records), *lead, cfg.hidden_size, dtype=dtype, device=device)
        states = torch.zeros(len(records), *lead, width, dtype=state_dtype(dtype), device=device)
        pset.block_fn_outputs.append(ys)
        pset.block_states.append(states)
        for r in records:
            pset.fn_outputs[r.key], pset.states[r.key] = _entry(ys, r.slot), _entry(states, r.slot)
    return pset


def _entry(stacked: Tensor, j: int) -> Tensor:
    """Entry ``j`` of ``stacked`` as a tensor of its own: the same memory, but its own version
    counter, so writing one sublayer's entry does not invalidate what autograd saved of
    another's (views of one base would share the base's counter)."""
    return own_version_alias(stacked, stacked.storage_offset() + j * stacked.stride(0),
                             stacked.shape[1:], stacked.stride()[1:])
