"""The (chunk, microbatch, layer) layout of TransformerEngine's ``_order``, and the static input
buffers forwards share along it (``make_graphed_callables(_order=..., _reuse_graph_input_output_buffers=True)``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten

from mhc_cg.core.pipeline_order import decode_order, pass_windows


@dataclass(frozen=True)
class OrderLayout:
    """Where each (chunk, microbatch, layer) lives in ``callables`` and ``sample_args``.

    Chunks are 0-based here; ``order`` entries are 1-based.
    """

    order: tuple[int, ...]
    num_chunks: int
    num_microbatches: int
    layers_per_chunk: tuple[int, ...]

    @property
    def chunk_offsets(self) -> list[int]:
        offsets = [0]
        for n in self.layers_per_chunk:
            offsets.append(offsets[-1] + n)
        return offsets

    def callable_index(self, chunk: int, layer: int) -> int:
        return self.chunk_offsets[chunk] + layer

    def sample_index(self, chunk: int, microbatch: int, layer: int) -> int:
        return (self.chunk_offsets[chunk] * self.num_microbatches
                + microbatch * self.layers_per_chunk[chunk] + layer)

    def passes(self) -> list[tuple[bool, int, int]]:
        """``(is_forward, chunk, microbatch)`` for every entry of the order (chunk 0-based)."""
        return [(s.forward, s.chunk - 1, s.microbatch) for s in decode_order(list(self.order))]


def order_layout(order: Sequence[int], num_layers_per_chunk: int | Sequence[int] | None,
                 num_callables: int, num_samples: int) -> OrderLayout:
    """Validate ``order`` against the callables and samples; clear errors name the rule."""
    order = tuple(int(c) for c in order)
    if not order or any(c == 0 for c in order):
        raise ValueError(f"make_graphed_callables: order must be a non-empty list of non-zero chunk "
                         f"ids (+c forward, -c backward, 1-based), got {list(order)}")
    num_chunks = max(abs(c) for c in order)
    if len(order) % (2 * num_chunks):
        raise ValueError(f"make_graphed_callables: order has {len(order)} entries, not a multiple of "
                         f"2 * {num_chunks} chunks (every chunk needs M forwards and M backwards)")
    num_microbatches = len(order) // (2 * num_chunks)
    steps = decode_order(list(order))
    pass_windows(steps)  # every backward after its forward, every forward with its backward
    counts = [sum(s.forward and s.chunk == c for s in steps) for c in range(1, num_chunks + 1)]
    if counts != [num_microbatches] * num_chunks:
        raise ValueError(f"make_graphed_callables: every chunk needs {num_microbatches} forwards and "
                         f"as many backwards; order has forwards {counts} per chunk")
    if num_layers_per_chunk is None:
        if num_callables % num_chunks:
            raise ValueError(f"make_graphed_callables: {num_callables} callables do not split evenly "
                             f"into {num_chunks} chunks; pass num_layers_per_chunk")
        layers = (num_callables // num_chunks,) * num_chunks
    elif isinstance(num_layers_per_chunk, int):
        layers = (num_layers_per_chunk,) * num_chunks
    else:
        layers = tuple(int(n) for n in num_layers_per_chunk)
        if len(layers) != num_chunks:
            raise ValueError(f"make_graphed_callables: num_layers_per_chunk needs one entry per chunk "
                             f"({num_chunks}), got {list(layers)}")
    if sum(layers) != num_callables:
        raise ValueError(f"make_graphed_callables: num_layers_per_chunk {list(layers)} sums to "
                         f"{sum(layers)}, but {num_callables} callables were given")
    if num_samples != sum(layers) * num_microbatches:
        raise ValueError(f"make_graphed_callables: sample_args needs one entry per (chunk, "
                         f"microbatch, layer) = {sum(layers)} layers x {num_microbatches} "
                         f"microbatches = {sum(layers) * num_microbatches}, got {num_samples}")
    return OrderLayout(order, num_chunks, num_microbatches, layers)


def buffer_key(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.stride(), t.device) for t in tensors)


def share_static_inputs(layout: OrderLayout, sample_args: list, sample_kwargs: list) -> None:
    """Rewrite ``sample_args``/``sample_kwargs`` in place so later forwards reuse released buffers.

    A backward of chunk ``c`` releases the inputs of the oldest forward of ``c`` still in flight
    (one entry per layer) to a free queue keyed by :func:`buffer_key`; each forward takes, per
    layer, the oldest released entry with its key, if any.
    """
    free: dict[tuple, deque[int]] = {}
    in_flight: list[deque[int]] = [deque() for _ in range(layout.num_chunks)]

    def key_of(index: int) -> tuple:
        return buffer_key(flat_tensors(sample_args[index], sample_kwargs[index]))

    for is_forward, chunk, microbatch in layout.passes():
        layers = range(layout.layers_per_chunk[chunk])
        if is_forward:
            for layer in layers:
                index = layout.sample_index(chunk, microbatch, layer)
                queue = free.get(key_of(index))
                if queue:
                    donor = queue.popleft()
                    sample_args[index], sample_kwargs[index] = sample_args[donor], sample_kwargs[donor]
                in_flight[chunk].append(index)
        else:
            for _ in layers:
                index = in_flight[chunk].popleft()
                free.setdefault(key_of(index), deque()).append(index)


def flat_tensors(args: Any, kwargs: dict) -> list[torch.Tensor]:
    flat = tree_flatten(args)[0] + tree_flatten([kwargs[k] for k in kwargs])[0]
    return flat


def label_of(layout: OrderLayout, index: int) -> str:
    for chunk in range(layout.num_chunks):
        start = layout.sample_index(chunk, 0, 0)
        span = layout.layers_per_chunk[chunk] * layout.num_microbatches
        if start <= index < start + span:
            mb, layer = divmod(index - start, layout.layers_per_chunk[chunk])
            return f"(chunk {chunk + 1}, microbatch {mb}, layer {layer})"
    return f"#{index}"
