"""Gradient sums in the plain graph's order, for tensors that several checkpoints consume.

Note [gradient sums in the plain graph's order] (docs/design.md, item 9). Autograd adds the uses
of a tensor in the order their backward nodes run. A checkpoint adds its own uses of an input first, inside its backward, so a tensor used by several checkpoints gets
``(a + b) + (c + d)`` where the plain graph computes ``((a + b) + c) + d``: a different rounding.
The block manager (:mod:`mhc_cg.recompute.block_recompute`) fixes the order with two halves that live here:
each checkpoint's recompute sends its per-use gradient terms to a sink
(:func:`capture_use_gradients`), and a pre-hook on the tensor's gradient node replaces autograd's
sum with the left fold of those terms (:func:`order_gradient_sums`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from torch import Tensor


class GradientConsumer(Protocol):
    """What :func:`order_gradient_sums` reads of a checkpoint, and the sinks it sets."""

    input_grad_nodes: dict[int, tuple[Any, int]]  # input index -> (autograd node, output slot)
    edge_sinks: dict[int, Callable[[Tensor], None]]  # input index -> where its per-use terms go


def grad_node_key(t: Tensor) -> tuple[Any, int] | None:
    """The autograd node and output slot where ``t``'s gradient is accumulated (None: no grad)."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn, t.output_nr
    return t.view_as(t).grad_fn.next_functions[0][0], 0  # the leaf's AccumulateGrad node


def capture_use_gradients(outputs: Sequence[Tensor], leaf: Tensor, sink: Callable[[Tensor], None]) -> None:
    """Send every per-use gradient of ``leaf`` in the recomputed graph to ``sink``, as it is made.

    Autograd sums the uses of one tensor in the order their backward nodes run; a checkpoint sums
    its own uses of an input locally, before the outer graph adds the other consumers. That
    changes the association of a three-or-more-term sum and so its rounding. A manager that
    wants the plain graph's exact sum collects the per-use terms here and adds them itself.
    """
    if not leaf.requires_grad:
        return
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        slots = []
        for j, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):  # AccumulateGrad: a leaf, stop here
                if nxt.variable is leaf:
                    slots.append(j)
            else:
                stack.append(nxt)
        if slots:
            node.register_hook(_UseGradientTap(tuple(slots), sink))


class _UseGradientTap:
    """Node post-hook: pass the gradients a node sends along ``slots`` to ``sink``, in slot order."""

    def __init__(self, slots: tuple[int, ...], sink: Callable[[Tensor], None]):
        self.slots, self.sink = slots, sink

    def __call__(self, grad_inputs, _grad_outputs) -> None:
        for j in self.slots:
            if grad_inputs[j] is not None:
                self.sink(grad_inputs[j])


def order_gradient_sums(checkpoints: Sequence[GradientConsumer], hook_tensor: Tensor,
                    first_seq: int) -> list:
    """Make the gradient of every tensor consumed by several of ``checkpoints`` bit-identical to
    the un-checkpointed graph's; returns the pre-hook handles (remove them to undo).

    Autograd adds the uses of a tensor in the order their backward nodes run. A checkpoint
    adds its own uses of an input first, inside its backward (``mappings`` uses x twice, then
    ``aggregate`` and ``h_res`` once each): ``(a + b) + (c + d)`` instead of
    ``((a + b) + c) + d``, a different rounding. For each such tensor whose every use is a
    checkpoint of this block, the checkpoints send their per-use terms to a list as they
    are made, and a pre-hook on the tensor's gradient node replaces autograd's sum with the
    list's left fold, which is the plain graph's order. A tensor with other consumers
    keeps autograd's sum (correct, maybe not bit-identical).
    """
    uses: dict[tuple[int, int], list[tuple[GradientConsumer, int]]] = {}
    nodes: dict[tuple[int, int], tuple[object, int]] = {}
    for ckpt in checkpoints:
        for i, (node, slot) in ckpt.input_grad_nodes.items():
            key = (id(node), slot)
            uses.setdefault(key, []).append((ckpt, i))
            nodes[key] = (node, slot)
    shared = {k for k, v in uses.items() if len(v) >= 2}
    if not shared or hook_tensor.grad_fn is None:
        return []
    edges = _count_edges_into(hook_tensor.grad_fn, shared, first_seq)
    handles = []
    for key in shared:
        if edges.get(key, 0) != len(uses[key]):
            continue  # some consumer is not a checkpoint: leave autograd's sum alone
        terms: list[Tensor] = []
        for ckpt, i in uses[key]:
            ckpt.edge_sinks[i] = terms.append
        node, slot = nodes[key]
        handles.append(node.register_prehook(_TermSum(terms, slot)))
    return handles


def _count_edges_into(root, targets: set[tuple[int, int]], first_seq: int) -> dict[tuple[int, int], int]:
    """How many graph edges reachable from ``root`` point at each ``(id(node), slot)`` target.

    Nodes created before the block (sequence number below ``first_seq``) and leaves are not
    expanded, so the walk stays inside the block.
    """
    counts: dict[tuple[int, int], int] = {}
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for nxt, slot in node.next_functions:
            if nxt is None:
                continue
            key = (id(nxt), slot)
            if key in targets:
                counts[key] = counts.get(key, 0) + 1
            if not hasattr(nxt, "variable") and nxt._sequence_nr() >= first_seq:
                stack.append(nxt)
    return counts


class _TermSum:
    """Node pre-hook: replace the gradient of output ``slot`` by the left fold of ``terms``."""

    def __init__(self, terms: list[Tensor], slot: int):
        self.terms, self.slot = terms, slot

    def __call__(self, grad_outputs):
        if not self.terms:
            return None
        total = self.terms[0]
        for term in self.terms[1:]:
            total = total + term
        self.terms.clear()
        grads = list(grad_outputs)
        grads[self.slot] = total
        return tuple(grads)
