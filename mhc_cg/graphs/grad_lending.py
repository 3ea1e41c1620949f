"""Gradient buffers handed to autograd uncloned down a chain of graphs, and who reads them.

A backward graph may return a grad uncloned when the one who reads it next reads it where it
lies (the graphed producer's backward, or an eager op that reads its grad once), and an eager
consumer may write a graph's grad output in place. Each shared grad-output buffer of one set of
graphed callables (``make_graphed_callables`` makes them; :class:`LentGrads` holds them, and each
graphed callable's state holds its own) says to whom it is lent: a backward graph that would
overwrite a buffer before its reader read it raises instead of feeding the reader another graph's
gradient. The lending is held by the buffer object both parties refer to, never looked up by a
tensor.
"""

from __future__ import annotations

from typing import Any

import torch


class GradBuffer:
    """One static grad-output buffer shared by the backward graphs of one set of graphed
    callables, and whom it is lent to: ``lent`` is ``(reader, lender)`` (a graphed callable's
    state or an :class:`EagerOp`, each with a ``label``) until the reader's backward replays."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.lent: tuple[Any, Any] | None = None

    def lend(self, reader: Any, lender: Any) -> None:
        """``lender`` handed this buffer uncloned to ``reader``."""
        self.lent = (reader, lender)


class LentGrads:
    """The shared grad-output buffers of one set of graphed callables, each lent until its one
    reader's backward replays.

    Autograd hands a lent buffer to the producer's backward next along the chain; if any other
    backward graph would overwrite the buffer first (two graphed consumers of one output, say),
    its replay raises instead of feeding the producer another graph's gradient.
    """

    def __init__(self):
        self.buffers: list[GradBuffer] = []

    def add(self, tensor: torch.Tensor) -> GradBuffer:
        """A new shared buffer over ``tensor``."""
        self.buffers.append(GradBuffer(tensor))
        return self.buffers[-1]

    def forget(self, party: Any) -> None:
        """End every lending ``party`` is the reader or the lender of."""
        for buffer in self.buffers:
            if buffer.lent is not None and any(p is party for p in buffer.lent):
                buffer.lent = None

    def check_writer(self, state: Any) -> None:
        """Before ``state``'s backward replays (it writes its grad-output buffers)."""
        for buffer in state.grad_buffers:
            if buffer is None or buffer.lent is None:
                continue
            reader, lender = buffer.lent
            if reader is not state:
                fix = ("an eager op shares grad buffers with the graphs only when one chain of "
                       "graphs runs per backward: make them with GraphOptions(lend_grads_to_eager=False) and "
                       "pass no grad_into" if EagerOp in (type(reader), type(lender)) else
                       "an output of a graphed callable that feeds another graphed callable must "
                       "feed only that one (clone it for any other use: out.clone())")
                raise RuntimeError(
                    f"graphed callable {state.label}'s backward would overwrite the grad that "
                    f"{lender.label} handed uncloned to {reader.label} before {reader.label} "
                    f"read it; {fix}")
            buffer.lent = None


def reads_grad_once(node) -> bool:
    """The eager op behind ``node`` reads its incoming grad once and keeps nothing of it."""
    return bool(getattr(getattr(node, "_forward_cls", None), "reads_grad_once", False))


class EagerOp:
    """An eager op at one end of a lent grad buffer: the reader of a grad a backward graph hands
    it uncloned (the lending ends when its node runs), or the writer of a graph's grad output."""

    def __init__(self, label: str):
        self.label = label

    @classmethod
    def reading(cls, node, lent: LentGrads) -> "EagerOp":
        reader = cls(f"the eager {node.name()}")
        node.register_prehook(lambda grad_outputs: lent.forget(reader))
        return reader
