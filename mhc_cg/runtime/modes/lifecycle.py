"""What a graphed model must check around its captures: forward-only passes and stale captures.

A capture freezes Python-level choices into the graph: the dropout probability and kind, the
parameters' dtype, device and addresses, the input shapes. :class:`CapturedState` records them
when the graphs are captured and :meth:`CapturedState.check` refuses a training forward once any
of them changed, naming the field (the graph would otherwise keep applying the old value, silently).

A forward with no backward to come (``model.eval()``, ``torch.no_grad()``) never replays a graph:
:func:`runs_graphs` is false and the graphed models run the plain model eagerly, so evaluation
claims no persistent set and leaves every pool's replay order where it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhc_cg.core.errors import StaleCaptureError
from mhc_cg.model import MHCGPT


class GraphedModel:
    """What every graphed model shares: ``train()``/``eval()`` reach the wrapped model (so an eval
    forward never replays a training graph), and the rewind of an aborted step's replay position."""

    model: MHCGPT

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)


def rewind_replay_order(graphed_callables) -> int:
    """Put the replay position of ``graphed_callables``' pool back at its first graph, after
    training forwards whose backward never came; returns 1 if it had moved, else 0."""
    order = getattr(getattr(graphed_callables, "pool", None), "order", None)
    if order is None or order.cursor == 0:
        return 0
    order.rewind()
    return 1


def runs_graphs(model: MHCGPT) -> bool:
    """A forward replays the captured (training) graphs only when it trains and records autograd."""
    return model.training and torch.is_grad_enabled()


@dataclass(frozen=True)
class CapturedState:
    """The Python-level values the captured graphs baked in."""

    hidden_dropout: float
    dropout_impl: str
    dtype: torch.dtype
    device: torch.device
    param_ptrs: tuple[int, ...]

    @classmethod
    def of(cls, model: MHCGPT) -> "CapturedState":
        params = list(model.parameters())
        return cls(model.cfg.hidden_dropout, model.cfg.dropout_impl, params[0].dtype,
                   params[0].device, tuple(p.data_ptr() for p in params))

    def check(self, model: MHCGPT) -> None:
        """Raise :class:`StaleCaptureError` naming the first field that changed since capture."""
        now = CapturedState.of(model)
        rebuild = "or build the model again (the graphs are captured in prepare())"
        for name, field in (("hidden_dropout", "model.hidden_dropout"),
                            ("dropout_impl", "model.dropout_impl"), ("dtype", "train.dtype"),
                            ("device", "train.device")):
            old, new = getattr(self, name), getattr(now, name)
            if old != new:
                raise StaleCaptureError(
                    f"{field}: changed from {old!r} to {new!r} after the graphs were captured; "
                    f"they still apply {old!r}; set it back, {rebuild}")
        if now.param_ptrs != self.param_ptrs:
            raise StaleCaptureError(
                "model parameters: replaced or moved since the graphs were captured (model.to(), "
                "a new nn.Parameter, load_state_dict(assign=True)); the graphs read the old "
                "addresses; copy new values in place (param.data.copy_(...)), " + rebuild)
