"""The static runtime's sublayers as modules a graph captures.

``make_graphed_callables`` (TransformerEngine's, or mhc_cg's) graphs modules, whose parameters
get gradients: :class:`SlotSublayer` is one whole mHC sublayer on the runtime, and
:class:`PartialMoESublayer` a MoE MLP sublayer's head, up to megatron-core's partial-capture
signal (the runtime runs its eager tail, :func:`moe_tail`). The modules of one capture share one
frame (:class:`~mhc_cg.runtime.frame.Frame`): the captures record one microbatch, and
its set is the pool's fixed set, or ``None`` where one graph serves several microbatches (the
runtime's forward then copies what the set needs in after it). The graphed modes ask
:func:`graphable_sublayers` for them and hand the graphs back to the runtime's forward.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.model import MoEMLP
from mhc_cg.model.moe import MoECudaGraphPartialCaptureSignal, MoECudaGraphTensorStore
from mhc_cg.runtime.chunk import SublayerRecord
from mhc_cg.runtime.frame import Frame
from mhc_cg.runtime.static import StaticRecompute


class SlotSublayer(nn.Module):
    """One whole mHC sublayer on the static runtime: ``(x, seed) -> (out, F output, state)``.

    F's output and the mapping state are returned detached: they only feed the persistent set.
    The fused sublayer writes its output into the next sublayer's input buffer itself; the
    chunk's last writes it into the capture's ``scratch`` when given one (Note [forward scratch]).
    ``grad_owned``: the capture says the output's gradient comes in the graph's own buffer.
    """

    def __init__(self, runtime: StaticRecompute, record: SublayerRecord, frame: Frame):
        super().__init__()
        self.sub = record.sub
        self.runtime, self.record, self.frame = runtime, record, frame

    def forward(self, x: Tensor, seed: Tensor, scratch: Tensor | None = None,
                grad_owned: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        self.frame.seed = seed  # the capture's seed: this graph's input
        out, y, state = self.runtime.path.run(self.record, x, self.frame, scratch, grad_owned)
        return out, y.detach(), state.detach()


class PartialMoESublayer(nn.Module):
    """The captured head of a MoE MLP sublayer: the pre, then the router [+ preprocess].

    Returns ``(state, x_on, *early)`` where ``early`` is what megatron-core's signal collects
    (``get_early_return_outputs``): hidden states, probs and routing map after ``route``; hidden
    states, probs and the dispatcher's tensors after ``preprocess``. ``grad_owned``: the
    capture says its outputs' gradients (``x_on``'s among them) come in the graph's own buffers.
    """

    def __init__(self, runtime: StaticRecompute, record: SublayerRecord, frame: Frame, step: str):
        super().__init__()
        if not isinstance(record.sub.fn, MoEMLP):
            raise StaticRecomputeError("moe_router / moe_preprocess scopes need a MoE MLP "
                                       "(model.num_experts); this sublayer is dense")
        self.sub = record.sub
        self.runtime, self.record, self.frame, self.step = runtime, record, frame, step

    def forward(self, x: Tensor, seed: Tensor, grad_owned: bool = False) -> tuple[Tensor, ...]:
        self.frame.seed = seed
        fn_input, (state, x_on) = self.runtime.sublayers.pre(self.record, x, self.frame,
                                                             grad_owned)
        try:
            self.sub.fn(fn_input, partial_capture=self.step)
        except MoECudaGraphPartialCaptureSignal as signal:
            early = signal.get_early_return_outputs(fn_input.reshape(-1, fn_input.shape[-1]), None)
        else:
            raise StaticRecomputeError("the MoE layer did not raise its partial-capture signal")
        return (state, x_on, *early)


def moe_tail(runtime: StaticRecompute, step: str, record: SublayerRecord,
             head_outputs: Sequence[Tensor], frame: Frame) -> tuple[Tensor, Tensor, Tensor]:
    """The eager rest of a MoE sublayer whose head was captured (megatron-core's partial
    capture: the router [and the dispatcher's preprocess]); returns (out, F output, state)."""
    state, x_on, hidden, probs, *rest = head_outputs
    moe: MoEMLP = record.sub.fn
    store = MoECudaGraphTensorStore()
    if step == "route":
        store.set(hidden_states=hidden, probs=probs, routing_map=rest[0])
    else:
        store.set(hidden_states=hidden, probs=probs)
        for name, value in zip(moe.token_dispatcher.valid_cudagraph_attrs, rest):
            setattr(moe.token_dispatcher, name, value)
    y = moe(x_on.narrow(-1, 0, hidden.shape[-1]), store)  # only its shape is read
    return runtime.path.finish(record, y, (state, x_on), frame)


def graphable_sublayers(runtime: StaticRecompute, *, attn: bool, mlp: bool,
                        moe_step: str | None) -> tuple[list[nn.Module], list[SublayerRecord]]:
    """The modules to capture over ``runtime``'s chunk, and their records: whole attention
    sublayers (``attn``), whole MLP sublayers (``mlp``) or a MoE MLP sublayer's head up to
    ``moe_step`` (``route`` / ``preprocess``). They share one frame (the module docstring)."""
    frame = Frame(runtime.sets.fixed_set(), None)
    modules, records = [], []
    for record in runtime.layout.records:
        if record.k == 0 and attn:
            modules.append(SlotSublayer(runtime, record, frame))
        elif record.k == 1 and moe_step is not None:
            modules.append(PartialMoESublayer(runtime, record, frame, moe_step))
        elif record.k == 1 and mlp:
            modules.append(SlotSublayer(runtime, record, frame))
        else:
            continue
        records.append(record)
    return modules, records


def sublayer_label(record: SublayerRecord, module: nn.Module) -> str:
    """``L3.attn``, ``L3.mlp``, or ``L3.mlp.head`` for a MoE sublayer's captured head."""
    return record.label + (".head" if isinstance(module, PartialMoESublayer) else "")
