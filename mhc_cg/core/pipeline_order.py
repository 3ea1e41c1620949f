"""The per-rank order of Megatron's (interleaved) 1F1B pipeline schedule, in TE's ``_order`` encoding.

An order is a list of non-zero ints, one per chunk pass on this rank: ``+c`` is the forward of
local model chunk ``c`` (1-based), ``-c`` its backward. TransformerEngine's
``make_graphed_callables(_order=...)`` captures graphs in exactly this order, and Megatron
replays them in it, so everything static (input buffers, mHC slot sets) is planned along it.

How the order is built (the interleaved schedule of Narayanan et al. 2021, as Megatron runs it):

* the *forward table* lists (microbatch, chunk) pairs in the order forwards run. Microbatches go
  in groups of ``microbatch_group_size``; within a group every chunk runs the whole group before
  the next chunk starts. Every rank uses the same table;
* backwards run through the same table, with chunk ``k`` replaced by ``vpp - 1 - k``: gradients
  flow through the virtual stages in reverse, so the last chunk goes first;
* rank ``r`` first runs ``warmup`` forwards, then alternates one forward and one backward, then
  drains the remaining backwards. With VPP, ``warmup = 2 (pp - r - 1) + (vpp - 1) group``; without
  it, ``warmup = pp - r - 1``; both are capped at the number of passes ``M vpp``.

Two properties the planner relies on follow from that construction: the k-th ``+c`` in an order
is microbatch k of chunk c, and so is the k-th ``-c`` (each chunk sees its microbatches first-in
first-out in both directions).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mhc_cg.core.errors import ConfigError, is_positive_int


@dataclass(frozen=True)
class Step:
    """One entry of an order, decoded: which chunk (1-based), which microbatch (0-based), which way."""

    chunk: int
    microbatch: int
    forward: bool


def schedule_problems(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                      microbatch_group_size: int | None = None) -> list[str]:
    """Every rule the arguments break, one line each naming the argument; empty when valid.

    Rules: sizes are positive integers; ``0 <= pp_rank < pp_size``; more than one chunk per rank
    needs pipeline parallelism (Megatron runs ``pp_size == 1`` without a pipeline schedule); with
    ``vpp_size > 1``, ``pp_size <= microbatch_group_size <= num_microbatches`` and the last group,
    ``num_microbatches % microbatch_group_size``, is empty or holds at least ``pp_size``
    microbatches (otherwise Megatron refuses the schedule: the pipeline would stall on it).
    Without VPP the group size does not shape the order and is only checked for positivity.
    """
    problems = []
    sizes = {"pp_size": pp_size, "vpp_size": vpp_size, "num_microbatches": num_microbatches}
    if microbatch_group_size is not None:
        sizes["microbatch_group_size"] = microbatch_group_size
    for name, value in sizes.items():
        if not is_positive_int(value):
            problems.append(f"{name}: must be a positive integer, got {value!r}")
    if not isinstance(pp_rank, int) or isinstance(pp_rank, bool):
        problems.append(f"pp_rank: must be an integer, got {pp_rank!r}")
    elif is_positive_int(pp_size) and not 0 <= pp_rank < pp_size:
        problems.append(f"pp_rank: must be in [0, pp_size={pp_size}), got {pp_rank}")
    if problems or vpp_size == 1:
        return problems
    if pp_size == 1:
        return [f"vpp_size: {vpp_size} chunks per rank need pp_size > 1 (without pipeline "
                f"parallelism Megatron runs one chunk and no pipeline schedule)"]
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    if not pp_size <= group <= num_microbatches:
        return [f"microbatch_group_size: must be in [pp_size={pp_size}, "
                f"num_microbatches={num_microbatches}] with vpp_size > 1, got {group}"
                + (" (the default is pp_size)" if microbatch_group_size is None else "")]
    remainder = num_microbatches % group
    if 0 < remainder < pp_size:
        return [f"num_microbatches: {num_microbatches} % microbatch_group_size={group} = "
                f"{remainder}; the last group must be empty or hold >= pp_size={pp_size} "
                f"microbatches"]
    return []


def check_schedule(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                   microbatch_group_size: int | None = None) -> None:
    """Raise ``ConfigError`` listing every broken rule (see ``schedule_problems``)."""
    problems = schedule_problems(pp_size, pp_rank, num_microbatches, vpp_size,
                                 microbatch_group_size)
    if problems:
        raise ConfigError(problems)


def forward_table(num_microbatches: int, vpp_size: int,
                  microbatch_group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) pairs, 0-based, in the order forwards run.

    Groups of ``microbatch_group_size`` consecutive microbatches; each chunk runs a whole group
    before the next chunk starts on it. The last group may be shorter.
    """
    table = []
    for start in range(0, num_microbatches, microbatch_group_size):
        group = range(start, min(start + microbatch_group_size, num_microbatches))
        table.extend((mb, chunk) for chunk in range(vpp_size) for mb in group)
    return table


def num_warmup_passes(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                      microbatch_group_size: int | None = None) -> int:
    """Forwards rank ``pp_rank`` runs before its first backward (arguments are assumed valid)."""
    if vpp_size == 1:
        warmup = pp_size - pp_rank - 1
    else:
        group = pp_size if microbatch_group_size is None else microbatch_group_size
        warmup = 2 * (pp_size - pp_rank - 1) + (vpp_size - 1) * group
    return min(warmup, num_microbatches * vpp_size)


def pipeline_order(pp_size: int, pp_rank: int, num_microbatches: int, vpp_size: int = 1,
                   microbatch_group_size: int | None = None) -> list[int]:
    """The order rank ``pp_rank`` runs its chunk passes in: ``+c`` forward, ``-c`` backward of chunk c.

    ``microbatch_group_size`` defaults to ``pp_size`` (Megatron's default). Invalid arguments raise
    ``ConfigError`` naming each broken rule. The result holds ``num_microbatches`` forwards and as
    many backwards of every chunk ``1..vpp_size``.
    """
    check_schedule(pp_size, pp_rank, num_microbatches, vpp_size, microbatch_group_size)
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    table = forward_table(num_microbatches, vpp_size, group)  # one chunk: plain microbatch order
    forwards = [chunk + 1 for _, chunk in table]
    backwards = [-(vpp_size - chunk) for _, chunk in table]
    warmup = num_warmup_passes(pp_size, pp_rank, num_microbatches, vpp_size, group)
    order = forwards[:warmup]
    for i in range(warmup, len(forwards)):  # steady state: one forward, then one backward
        order += [forwards[i], backwards[i - warmup]]
    order += backwards[len(forwards) - warmup:]  # cooldown
    return order


def decode_order(order: list[int]) -> list[Step]:
    """Attach microbatch ids: the k-th ``+c`` (or ``-c``) of an order is microbatch k of chunk c."""
    seen: dict[int, int] = {}
    steps = []
    for code in order:
        if not isinstance(code, int) or isinstance(code, bool) or code == 0:
            raise ConfigError(f"order: entries must be non-zero integers (+c forward, -c backward), "
                              f"got {code!r}")
        microbatch = seen.get(code, 0)
        seen[code] = microbatch + 1
        steps.append(Step(abs(code), microbatch, code > 0))
    return steps


def pass_windows(steps: list[Step]) -> dict[tuple[int, int], tuple[int, int]]:
    """(chunk, microbatch) -> (forward index, backward index) along ``steps``.

    The one check of an order's sequence: a backward before its forward, or a forward without a
    backward, is a ``ConfigError`` naming the entry.
    """
    forward_at: dict[tuple[int, int], int] = {}
    windows = {}
    for index, step in enumerate(steps):
        key = (step.chunk, step.microbatch)
        if step.forward:
            forward_at[key] = index
        elif key not in forward_at:
            raise ConfigError(f"order: entry {index} is the backward of chunk {step.chunk} "
                              f"microbatch {step.microbatch} before its forward")
        else:
            windows[key] = (forward_at[key], index)
    missing = sorted(set(forward_at) - set(windows))
    if missing:
        raise ConfigError(f"order: chunk {missing[0][0]} microbatch {missing[0][1]} has a forward "
                          f"but no backward")
    return windows


# --------------------------------------------------------------------------------------------
# Persistent slot sets along an order: how many, and which forward takes which.

def peak_in_flight(order: list[int]) -> int:
    """The most (chunk, microbatch) passes whose forward has run and whose backward has not."""
    pass_windows(decode_order(order))  # the count means nothing for an order out of sequence
    live = peak = 0
    for code in order:
        live += 1 if code > 0 else -1
        peak = max(peak, live)
    return peak


def max_persistent_slot_sets(order: list[int]) -> int:
    """Persistent slot sets the rank needs: one per (chunk, microbatch) in flight at the peak."""
    return peak_in_flight(order)


def assign_persistent_slot_sets(order: list[int]) -> list[int]:
    """The slot-set index each forward of ``order`` uses, in the order's forward sequence.

    A pool of ``max_persistent_slot_sets(order)`` sets, all free at the start in index order; a
    forward takes the front of the free list, the backward of the same (chunk, microbatch) puts
    its set at the back. This is ``PersistentSetPool``'s policy, so graphs captured on these
    indices find the same sets at run time.
    """
    steps = decode_order(order)
    pass_windows(steps)  # rejects orders with a backward before its forward
    free = deque(range(max_persistent_slot_sets(order)))
    held: dict[tuple[int, int], int] = {}
    assigned = []
    for step in steps:
        key = (step.chunk, step.microbatch)
        if step.forward:
            held[key] = free.popleft()
            assigned.append(held[key])
        else:
            free.append(held.pop(key))
    return assigned


def recomputes_kept(order: list[int]) -> int:
    """Backwards in ``order`` that directly follow their own forward (same chunk and
    microbatch): nothing writes the rank's arena in between, so the chunk's last recompute block
    still holds what its forward wrote, and the static runtime skips that block's recompute."""
    steps = decode_order(order)
    return sum(1 for before, step in zip(steps, steps[1:])
               if before.forward and not step.forward
               and (before.chunk, before.microbatch) == (step.chunk, step.microbatch))
