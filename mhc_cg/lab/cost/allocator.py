"""The CUDA caching allocator during graph capture, emulated over a recorded op sequence.

Every allocation made while a graph is captured comes from the graph's pool, and a block freed
during a capture can be handed to a later allocation of the same pool, in the same capture or a
later one (that is why graphs sharing a pool must replay in capture order). A pool's memory is never
returned while its graphs live: what it reserves is its high-water mark.

The emulation counts bytes, block by block:

* a storage resized to nothing during a capture (an eager recompute discarding an output) is
  freed there, and one allocated again is a new block: the pool reuses its memory in between;

* a storage allocated by an op of the capture is live from that op on, and its block returns to
  the pool after its **last use** in the recorded program, unless it *escapes*: it is still
  alive when the capture ends (a graph output, a tensor autograd saved, a tensor Python still
  holds). An escaped block stays in the pool, live, until Python drops it; a later capture of the
  same pool starts with it live and frees it after its last use there (a backward graph consuming
  what its forward saved), or keeps it to the end if it is alive after that capture too;
* sizes are rounded up to the allocator's 512-byte block granularity.

Besides the last-use figure (what the program needs) the emulation reports the **held** figure:
a block returns when Python really dropped its storage (observed through weak references before
and after every op), which is what the caching allocator sees. The difference is memory that
Python keeps alive past its last use.

Every op of a capture runs on its one stream here, so no free waits on another stream (the
caching allocator defers those to the capture's end).

What it cannot see: fragmentation (a free block too small or in the wrong segment for the next
request), the 2 MiB / 20 MiB segment rounding of small and large pools, and allocations made by
libraries outside PyTorch's allocator (cuBLAS workspaces).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

BLOCK_BYTES = 512


def rounded(nbytes: int) -> int:
    """Bytes of the allocator block that holds ``nbytes`` (its 512-byte granularity)."""
    return (nbytes + BLOCK_BYTES - 1) // BLOCK_BYTES * BLOCK_BYTES


@dataclass
class Block:
    """One storage of a pool: its size, and where in a capture it was born, last used, freed.

    Indices count the ops of the capture being recorded; ``born == -1`` for a block the pool
    already held when the capture began.
    """

    ref: StorageWeakRef
    nbytes: int
    born: int
    last_use: int
    freed_at: int | None = None  # op index before which Python had dropped it (held model)
    released: bool = False  # its storage was resized to nothing (and may be allocated again)
    what: tuple | None = None  # what made it (op_counters.owner): what is live at the peak
    graph: str = ""  # the capture that made it

    def alive(self) -> bool:
        if self.released or self.ref.expired():
            return False
        if torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata).nbytes() == 0:
            self.released = True  # freed in place, as an eager recompute discards an output
            return False
        return True


@dataclass
class CapturePeak:
    """What one capture did to its pool."""

    resident_before: int = 0        # bytes the pool held live when the capture began
    peak_bytes: int = 0             # live bytes of the pool at its fullest (last-use model)
    held_peak_bytes: int = 0        # the same with blocks freed when Python dropped them
    allocated_bytes: int = 0        # bytes this capture allocated
    escaped_bytes: int = 0          # of those, still alive after the capture
    escaped_blocks: int = 0
    # the blocks live at the peak (last-use model): (graph that made it, what, bytes)
    live_at_peak: list[tuple[str, tuple | None, int]] = field(default_factory=list)


def _peak(events: list[tuple[float, int]], start: int) -> int:
    return _peak_at(events, start)[0]


def _peak_at(events: list[tuple[float, int]], start: int) -> tuple[int, float]:
    """The most bytes live and the event index where it is first reached (-1: at the start)."""
    live = peak = start
    at = -1.0
    for index, delta in sorted(events, key=lambda e: e[0]):  # frees sit at half indices: no ties
        live += delta
        if live > peak:
            peak, at = live, index
    return peak, at


@dataclass
class PoolState:
    """The blocks of one pool that outlived the captures that made them, and its high-water mark."""

    resident: list[Block] = field(default_factory=list)
    high_water: int = 0
    # what was live when the high-water mark was set (CapturePeak.live_at_peak of that capture)
    high_water_live: list[tuple[str, tuple | None, int]] = field(default_factory=list)
    high_water_graph: str = ""  # the capture that set it

    def live_resident(self) -> list[Block]:
        self.resident = [b for b in self.resident if b.alive()]
        return self.resident

    def settle(self, blocks: list[Block], ops: int, graph: str = "") -> CapturePeak:
        """Close a capture of ``ops`` ops over ``blocks`` (resident ones first, born -1).

        Frees come before allocations at the same index: a block whose last use is op ``i`` is
        free for op ``i + 1``'s outputs, and one Python dropped before op ``i`` is free for op
        ``i``'s outputs.
        """
        report = CapturePeak()
        last_use, held = [], []
        survivors = []
        for b in blocks:
            alive = b.alive()
            if b.born < 0:
                report.resident_before += b.nbytes
            else:
                report.allocated_bytes += b.nbytes
                last_use.append((b.born, b.nbytes))
                held.append((b.born, b.nbytes))
            if alive:
                survivors.append(b)
                if b.born >= 0:
                    report.escaped_bytes += b.nbytes
                    report.escaped_blocks += 1
                continue
            last_use.append((b.last_use + 0.5, -b.nbytes))
            freed = b.freed_at if b.freed_at is not None else ops
            held.append((freed - 0.5, -b.nbytes))
        report.peak_bytes, at = _peak_at(last_use, report.resident_before)
        report.held_peak_bytes = _peak(held, report.resident_before)
        report.live_at_peak = [(b.graph, b.what, b.nbytes) for b in blocks
                               if b.born <= at and (b.alive() or b.last_use + 0.5 > at)]
        for b in survivors:
            b.born = b.last_use = -1
            b.freed_at = None
        self.resident = survivors
        if report.peak_bytes > self.high_water:
            self.high_water_live, self.high_water_graph = report.live_at_peak, graph
        self.high_water = max(self.high_water, report.held_peak_bytes, report.peak_bytes)
        return report
