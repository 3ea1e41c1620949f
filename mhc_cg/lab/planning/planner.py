"""Static-buffer planner: what one pipeline rank must allocate to capture its order in CUDA graphs.

Walking a rank's order (``mhc_cg.core.pipeline_order``), it simulates:

* **graphed callables**, as TE's ``make_graphed_callables`` captures them: one per (chunk,
  microbatch, layer), each a forward and a backward CUDA graph;
* **static input buffers** of those callables. Without reuse every callable gets its own. With
  TE's ``_reuse_graph_input_output_buffers``, the backward of chunk c hands the buffers of c's
  oldest in-flight forward to a free queue, and a later forward takes from that queue before
  allocating. TE keys the queue by (shape, dtype, layout); every graphed mHC layer takes the same
  ``[s, b, n*C]`` hidden states, so here the queue has one key;
* **mHC persistent slot sets** (docs/design.md, invariant 3): per in-flight (chunk, microbatch), each
  recompute block's input x_l0 (n*C per token), each sublayer's F output (C per token) and one
  int64 dropout seed. Sets are handed out first-in first-out from a pool holding exactly the peak
  number in flight, as ``mhc_cg.runtime.static.PersistentSetPool`` does, and released at the
  backward of the same (chunk, microbatch). One pool serves every chunk of the rank (chunks have
  equal layer counts, so their sets have one shape);
* **the arena**: one recompute block's transient mHC state, once per rank
  (``mhc_cg.lab.memory.analytical.arena_elements``).

Every buffer user has a window from the position where it is written to the position of its last
read. Positions are ``(order index, sub-step)`` pairs; sub-steps order the recompute blocks inside
one chunk pass. No two users of one buffer may have overlapping windows; ``first_conflict`` finds
the earliest violation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mhc_cg.config.schema import paper_block_size
from mhc_cg.core.dtypes import DTYPE_BYTES
from mhc_cg.core.errors import ConfigError, is_positive_int
from mhc_cg.lab.memory import analytical
from mhc_cg.core.pipeline_order import (Step, assign_persistent_slot_sets, decode_order,
                                  max_persistent_slot_sets, pass_windows, peak_in_flight,
                                  pipeline_order, recomputes_kept)

SEED_BYTES = 8  # one int64 dropout seed per persistent slot set

Position = tuple[int, int]  # (order index, sub-step within that chunk pass)
PASS_END = 1 << 30  # sub-step standing for "the end of this chunk pass"


@dataclass(frozen=True)
class ModelShape:
    """What buffer sizes depend on; the defaults are a 7B-class layer with n = 4 streams in bf16."""

    hidden_size: int = 4096
    seq_length: int = 4096
    micro_batch_size: int = 1
    num_streams: int = 4
    dtype: str = "bf16"
    recompute_layers: int | None = None  # L_r; None: the paper's sqrt(n*L/(n+2)) over a chunk
    # activation recompute keeps fc1's output (ffn per token) in the set for this many layers
    # of the chunk; ffn_hidden_size None means 4 * hidden_size
    activation_recompute_layers: int = 0
    ffn_hidden_size: int | None = None

    def __post_init__(self):
        problems = [f"{name}: must be a positive integer, got {getattr(self, name)!r}"
                    for name in ("hidden_size", "seq_length", "micro_batch_size", "num_streams")
                    if not is_positive_int(getattr(self, name))]
        if self.recompute_layers is not None and not is_positive_int(self.recompute_layers):
            problems.append(f"recompute_layers: must be a positive integer or None, "
                            f"got {self.recompute_layers!r}")
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype: must be one of {list(DTYPE_BYTES)}, got {self.dtype!r}")
        if problems:
            raise ConfigError(problems)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens(self) -> int:
        return self.seq_length * self.micro_batch_size

    def block_size(self, layers_per_chunk: int) -> int:
        """Layers per recompute block; a block never crosses a chunk (a pipeline stage)."""
        wanted = self.recompute_layers or paper_block_size(self.num_streams,
                                                                        layers_per_chunk)
        return min(wanted, layers_per_chunk)

    def static_input_bytes(self) -> int:
        """One graphed layer's static input: the widened hidden states ``[s, b, n*C]``."""
        return self.tokens * self.num_streams * self.hidden_size * self.element_bytes

    def persistent_set_bytes(self, layers_per_chunk: int) -> int:
        """One persistent slot set: x_l0 per block, F's output and the mapping state per sublayer,
        the dropout seed, and fc1's output for each layer that recomputes its activation."""
        size = self.block_size(layers_per_chunk)
        blocks = [min(size, layers_per_chunk - start) for start in range(0, layers_per_chunk, size)]
        elements = sum(analytical.persistent_set_elements(self.num_streams, self.hidden_size, b,
                                                          self.element_bytes) for b in blocks)
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        elements += min(self.activation_recompute_layers, layers_per_chunk) * ffn
        return round(elements * self.tokens * self.element_bytes) + SEED_BYTES

    def arena_bytes(self, layers_per_chunk: int) -> int:
        elements = analytical.arena_elements(self.num_streams, self.hidden_size,
                                               self.block_size(layers_per_chunk))
        return elements * self.tokens * self.element_bytes


@dataclass(frozen=True)
class BufferUse:
    """One user of one static buffer: written at ``start``, last read at ``end`` (inclusive)."""

    kind: str  # "static_input" | "persistent_set" | "arena"
    buffer: int
    chunk: int
    microbatch: int
    start: Position
    end: Position
    layer: int | None = None  # static inputs: the layer within the chunk; arena: the block

    def describe(self) -> str:
        what = f"chunk {self.chunk} microbatch {self.microbatch}"
        if self.layer is not None:
            what += f" {'block' if self.kind == 'arena' else 'layer'} {self.layer}"
        return f"{what} [order {self.start[0]} .. {self.end[0]}]"


@dataclass(frozen=True)
class BufferConflict:
    """Two users of one buffer whose windows overlap: the second would overwrite the first."""

    first: BufferUse
    second: BufferUse

    def __str__(self) -> str:
        return (f"{self.first.kind} buffer {self.first.buffer}: {self.second.describe()} writes "
                f"it while {self.first.describe()} still needs it")


def first_conflict(uses: Sequence[BufferUse]) -> BufferConflict | None:
    """The overlap whose second user starts earliest, or None if every buffer's users are disjoint."""
    by_buffer: dict[tuple[str, int], list[BufferUse]] = {}
    for use in uses:
        by_buffer.setdefault((use.kind, use.buffer), []).append(use)
    found: BufferConflict | None = None
    for users in by_buffer.values():
        users.sort(key=lambda u: u.start)
        latest = users[0]  # the user whose window reaches furthest so far
        for use in users[1:]:
            if use.start <= latest.end and (found is None or use.start < found.second.start):
                found = BufferConflict(latest, use)
            if use.end > latest.end:
                latest = use
    return found


def _layers_per_chunk(order_steps: list[Step], num_layers_per_chunk: int | Sequence[int]) -> list[int]:
    num_chunks = max((s.chunk for s in order_steps), default=0)
    if isinstance(num_layers_per_chunk, int):
        layers = [num_layers_per_chunk] * num_chunks
    else:
        layers = list(num_layers_per_chunk)
    if len(layers) < num_chunks or not all(is_positive_int(n) for n in layers):
        raise ConfigError(f"num_layers_per_chunk: need a positive layer count for each of "
                          f"{num_chunks} chunks, got {num_layers_per_chunk!r}")
    return layers


def static_input_uses(order: list[int], num_layers_per_chunk: int | Sequence[int],
                      reuse: bool = True) -> list[BufferUse]:
    """The static input buffer of every graphed (chunk, microbatch, layer), as TE would allocate it."""
    steps = decode_order(order)
    layers = _layers_per_chunk(steps, num_layers_per_chunk)
    windows = pass_windows(steps)
    free: deque[int] = deque()  # released buffer ids, oldest first (TE pops the front)
    in_flight: dict[int, deque[list[int]]] = {}  # chunk -> buffer ids of each forward, oldest first
    allocated = 0
    uses = []
    for index, step in enumerate(steps):
        if step.forward:
            ids = []
            for layer in range(layers[step.chunk - 1]):
                if reuse and free:
                    ids.append(free.popleft())
                else:
                    ids.append(allocated)
                    allocated += 1
                backward = windows[(step.chunk, step.microbatch)][1]
                uses.append(BufferUse("static_input", ids[-1], step.chunk, step.microbatch,
                                      (index, 0), (backward, PASS_END), layer))
            in_flight.setdefault(step.chunk, deque()).append(ids)
        else:
            free.extend(in_flight[step.chunk].popleft())
    return uses


def count_static_input_buffers(order: list[int], num_layers_per_chunk: int | Sequence[int],
                               reuse: bool = True) -> int:
    """How many static input buffers TE's make_graphed_callables allocates for ``order``.

    Without reuse: one per (chunk, microbatch, layer). With reuse: the peak number of layer inputs
    whose forward has run and whose chunk's backward has not.
    """
    uses = static_input_uses(order, num_layers_per_chunk, reuse)
    return len({use.buffer for use in uses})


def persistent_slot_set_uses(order: list[int]) -> list[BufferUse]:
    steps = decode_order(order)
    windows = pass_windows(steps)
    forwards = [s for s in steps if s.forward]
    uses = []
    for step, slot_set in zip(forwards, assign_persistent_slot_sets(order)):
        f, b = windows[(step.chunk, step.microbatch)]
        uses.append(BufferUse("persistent_set", slot_set, step.chunk, step.microbatch,
                              (f, 0), (b, PASS_END)))
    return uses


def arena_uses(order: list[int], blocks_per_chunk: int) -> list[BufferUse]:
    """The rank's one arena, block by block.

    A block's forward writes its transient state and nothing reads it later (the backward reads
    the recomputed copy), so its window is that block alone. A backward walks the blocks last to
    first; each block's window runs from its recompute to its backward.
    """
    uses = []
    for index, step in enumerate(decode_order(order)):
        for k in range(blocks_per_chunk):
            block = k if step.forward else blocks_per_chunk - 1 - k
            uses.append(BufferUse("arena", 0, step.chunk, step.microbatch,
                                  (index, 2 * k), (index, 2 * k + 1), block))
    return uses


@dataclass
class RankPlan:
    """Everything static one pipeline rank allocates for its graphed, recomputed order."""

    rank: int
    order: list[int]
    steps: list[Step]
    layers_per_chunk: int
    recompute_block_size: int
    blocks_per_chunk: int
    num_graphs: int  # graphed callables: one per (chunk, microbatch, layer), each fwd + bwd graph
    recompute_graphs: int  # one per (chunk, recompute block, slot set that chunk uses)
    recomputes_kept: int  # block recomputes per step skipped: backwards right after their forward
    static_input_buffers: int  # with TE's reuse
    static_input_buffers_no_reuse: int
    persistent_slot_sets: int
    persistent_slot_sets_per_chunk_pools: int  # if each chunk had its own pool instead
    peak_in_flight: int
    static_input_bytes: int
    static_input_bytes_no_reuse: int
    persistent_bytes: int
    arena_bytes: int
    slot_set_of_forward: list[int]  # per forward of the order, in order
    uses: list[BufferUse] = field(repr=False)
    conflict: BufferConflict | None = None

    def summary(self) -> dict:
        """The JSON-ready figures (``mhc-cg schedule --json``)."""
        return {
            "rank": self.rank, "order": self.order, "num_graphs": self.num_graphs,
            "recompute_graphs": self.recompute_graphs,
            "recomputes_kept_per_step": self.recomputes_kept,
            "static_input_buffers": self.static_input_buffers,
            "static_input_buffers_no_reuse": self.static_input_buffers_no_reuse,
            "persistent_slot_sets": self.persistent_slot_sets,
            "persistent_slot_sets_per_chunk_pools": self.persistent_slot_sets_per_chunk_pools,
            "peak_in_flight": self.peak_in_flight,
            "recompute_block_size": self.recompute_block_size,
            "static_input_bytes": self.static_input_bytes,
            "static_input_bytes_no_reuse": self.static_input_bytes_no_reuse,
            "persistent_bytes": self.persistent_bytes, "arena_bytes": self.arena_bytes,
            "conflict": None if self.conflict is None else str(self.conflict),
        }


def layers_per_chunk(num_layers: int, pp_size: int, vpp_size: int) -> int:
    if not is_positive_int(num_layers) or num_layers % (pp_size * vpp_size):
        raise ConfigError(f"num_layers: must be a positive multiple of pp_size * vpp_size = "
                          f"{pp_size * vpp_size}, got {num_layers!r}")
    return num_layers // (pp_size * vpp_size)


def plan_order(rank: int, order: list[int], layers_per_chunk: int,
               shape: ModelShape = ModelShape()) -> RankPlan:
    """Plan one rank from its order (any valid order, not only Megatron's)."""
    steps = decode_order(order)
    block_size = shape.block_size(layers_per_chunk)
    blocks = math.ceil(layers_per_chunk / block_size)
    inputs = static_input_uses(order, layers_per_chunk, reuse=True)
    sets = persistent_slot_set_uses(order)
    uses = [*inputs, *sets, *arena_uses(order, blocks)]
    num_inputs = len({u.buffer for u in inputs})
    num_inputs_no_reuse = count_static_input_buffers(order, layers_per_chunk, reuse=False)
    num_sets = max_persistent_slot_sets(order)
    sets_per_chunk = sum(max_persistent_slot_sets([c for c in order if abs(c) == chunk])
                         for chunk in {abs(c) for c in order})
    return RankPlan(
        rank=rank, order=list(order), steps=steps, layers_per_chunk=layers_per_chunk,
        recompute_block_size=block_size, blocks_per_chunk=blocks,
        num_graphs=sum(1 for s in steps if s.forward) * layers_per_chunk,
        recompute_graphs=blocks * len({(u.chunk, u.buffer) for u in sets}),
        recomputes_kept=recomputes_kept(order),
        static_input_buffers=num_inputs, static_input_buffers_no_reuse=num_inputs_no_reuse,
        persistent_slot_sets=num_sets, persistent_slot_sets_per_chunk_pools=sets_per_chunk,
        peak_in_flight=peak_in_flight(order),
        static_input_bytes=num_inputs * shape.static_input_bytes(),
        static_input_bytes_no_reuse=num_inputs_no_reuse * shape.static_input_bytes(),
        persistent_bytes=num_sets * shape.persistent_set_bytes(layers_per_chunk),
        arena_bytes=shape.arena_bytes(layers_per_chunk),
        slot_set_of_forward=[u.buffer for u in sets], uses=uses, conflict=first_conflict(uses),
    )


def plan_rank(pp_size: int, pp_rank: int, num_microbatches: int, num_layers: int,
              vpp_size: int = 1, microbatch_group_size: int | None = None,
              shape: ModelShape = ModelShape()) -> RankPlan:
    """Plan rank ``pp_rank`` of Megatron's schedule for a model of ``num_layers`` graphed layers."""
    order = pipeline_order(pp_size, pp_rank, num_microbatches, vpp_size, microbatch_group_size)
    return plan_order(pp_rank, order, layers_per_chunk(num_layers, pp_size, vpp_size), shape)


def plan(pp_size: int, vpp_size: int, num_microbatches: int, num_layers: int,
         microbatch_group_size: int | None = None,
         shape: ModelShape = ModelShape()) -> list[RankPlan]:
    """``plan_rank`` for every pipeline rank, rank 0 first."""
    return [plan_rank(pp_size, rank, num_microbatches, num_layers, vpp_size,
                      microbatch_group_size, shape) for rank in range(pp_size)]
