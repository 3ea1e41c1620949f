"""Gradient buffers handed to autograd uncloned down a chain of graphs, and who reads them.

A backward graph may return a grad uncloned when the one who reads it next reads it where it
lies (the graphed producer's backward, or an eager op that reads its grad once), and an eager
consumer may write a graph's grad output in place. :class:`LentGrads` is the ledger of those
buffers for one set of graphed callables (``make_graphed_callables`` makes one and each graphed
callable's state holds it): a backward graph that would overwrite a buffer before its reader read
it raises instead of feeding the reader another graph's gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from mhc_cg.core.storage import storage_id


class LentGrads:
    """Grad buffers handed to autograd uncloned, each until its one reader's backward replays.

    Autograd hands a lent buffer to the producer's backward next along the chain; if any other
    backward graph would overwrite the buffer first (two graphed consumers of one output, say),
    its replay raises instead of feeding the producer another graph's gradient.
    """

    def __init__(self):
        self._by_storage: dict[int, tuple[Any, Any]] = {}

    def lend(self, buffer: torch.Tensor, reader: Any, lender: Any) -> None:
        """``lender`` handed ``buffer`` uncloned to ``reader`` (a graphed callable or an
        :class:`EagerOp`; each has a ``label``)."""
        self._by_storage[storage_id(buffer)] = (reader, lender)

    def forget(self, party: Any) -> None:
        """End every lending ``party`` is the reader or the lender of."""
        for key in [k for k, (r, l) in self._by_storage.items() if party is r or party is l]:
            del self._by_storage[key]

    def check_writer(self, state: Any) -> None:
        """Before ``state``'s backward replays (it writes its grad-output buffers)."""
        for buffer in state.static_grad_outputs:
            if buffer is None or storage_id(buffer) not in self._by_storage:
                continue
            reader, lender = self._by_storage[storage_id(buffer)]
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
            del self._by_storage[storage_id(buffer)]


def reads_grad_once(node) -> bool:
    """The eager op behind ``node`` reads its incoming grad once and keeps nothing of it."""
    return bool(getattr(getattr(node, "_forward_cls", None), "reads_grad_once", False))


class EagerOp:
    """An eager op at one end of a lent grad buffer: the reader of a grad a backward graph hands
    it uncloned (the lending ends when its node runs), or the writer of a graph's grad output."""

    def __init__(self, label: str):
        self.label = label

    @classmethod
    def reading(cls, node, ledger: LentGrads) -> "EagerOp":
        reader = cls(f"the eager {node.name()}")
        node.register_prehook(lambda grad_outputs: ledger.forget(reader))
        return reader
