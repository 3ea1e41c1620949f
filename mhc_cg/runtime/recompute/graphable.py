"""The static runtime's sublayers as modules a graph captures.

``make_graphed_callables`` (TransformerEngine's, or mhc_cg's) graphs modules, whose parameters
get gradients: :class:`SlotSublayer` is one whole mHC sublayer on the runtime, and
:class:`PartialMoESublayer` a MoE MLP sublayer's head, up to megatron-core's partial-capture
signal (the runtime runs its eager tail, ``StaticRecompute.moe_tail``). Each is built for the
persistent set its capture writes: the pool's fixed set, or ``None`` where one graph serves
several microbatches (the runtime's forward then copies what the set needs in after it). The
graphed modes ask :func:`graphable_sublayers` for them and hand the graphs back to the
runtime's forward.
"""

from __future__ import annotations

from torch import Tensor, nn

from mhc_cg.core.errors import StaticRecomputeError
from mhc_cg.model import MoEMLP
from mhc_cg.model.moe import MoECudaGraphPartialCaptureSignal
from mhc_cg.runtime.recompute.static import StaticRecompute
from mhc_cg.runtime.recompute.sublayers import SUBLAYER_NAMES


class SlotSublayer(nn.Module):
    """One whole mHC sublayer on the static runtime: ``(x, seed) -> (out, F output, state)``.

    F's output and the mapping state are returned detached: they only feed the persistent set.
    The fused sublayer writes its output into the next sublayer's input buffer itself; the
    chunk's last writes it into the capture's ``scratch`` when given one (Note [forward scratch]).
    """

    def __init__(self, runtime: StaticRecompute, sub: nn.Module, position: int, k: int):
        super().__init__()
        self.sub = sub
        self.runtime, self.position, self.k = runtime, position, k
        self.pset = runtime.sets.fixed_set()

    def forward(self, x: Tensor, seed: Tensor,
                scratch: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        out, y, state = self.runtime.sublayer(self.sub, self.position, self.k, x, seed, self.pset,
                                              scratch)
        return out, y.detach(), state.detach()


class PartialMoESublayer(nn.Module):
    """The captured head of a MoE MLP sublayer: the pre, then the router [+ preprocess].

    Returns ``(state, x_on, *early)`` where ``early`` is what megatron-core's signal collects
    (``get_early_return_outputs``): hidden states, probs and routing map after ``route``; hidden
    states, probs and the dispatcher's tensors after ``preprocess``.
    """

    def __init__(self, runtime: StaticRecompute, sub: nn.Module, position: int, k: int, step: str):
        super().__init__()
        if not isinstance(sub.fn, MoEMLP):
            raise StaticRecomputeError("moe_router / moe_preprocess scopes need a MoE MLP "
                                       "(model.num_experts); this sublayer is dense")
        self.sub = sub
        self.runtime, self.position, self.k, self.step = runtime, position, k, step
        self.pset = runtime.sets.fixed_set()

    def forward(self, x: Tensor, seed: Tensor) -> tuple[Tensor, ...]:
        fn_input, (state, x_on) = self.runtime.sublayers.pre(self.sub, self.position, self.k, x,
                                                             self.pset)
        try:
            self.sub.fn(fn_input, partial_capture=self.step)
        except MoECudaGraphPartialCaptureSignal as signal:
            early = signal.get_early_return_outputs(fn_input.reshape(-1, fn_input.shape[-1]), None)
        else:
            raise StaticRecomputeError("the MoE layer did not raise its partial-capture signal")
        return (state, x_on, *early)


def graphable_sublayers(runtime: StaticRecompute, layers, block_size: int, *, attn: bool,
                        mlp: bool, moe_step: str | None
                        ) -> tuple[list[nn.Module], list[tuple[int, int]]]:
    """The modules to capture over ``layers`` on ``runtime``, and their ``(layer number,
    sublayer)`` keys: whole attention sublayers (``attn``), whole MLP sublayers (``mlp``) or a
    MoE MLP sublayer's head up to ``moe_step`` (``route`` / ``preprocess``)."""
    modules, keys = [], []
    for index, layer in enumerate(layers):
        position = index % block_size
        if attn:
            modules.append(SlotSublayer(runtime, layer.attention, position, 0))
            keys.append((layer.layer_number, 0))
        if moe_step is not None:
            modules.append(PartialMoESublayer(runtime, layer.mlp, position, 1, moe_step))
            keys.append((layer.layer_number, 1))
        elif mlp:
            modules.append(SlotSublayer(runtime, layer.mlp, position, 1))
            keys.append((layer.layer_number, 1))
    return modules, keys


def sublayer_label(key: tuple[int, int], module: nn.Module) -> str:
    """``L3.attn``, ``L3.mlp``, or ``L3.mlp.head`` for a MoE sublayer's captured head."""
    layer, k = key
    head = ".head" if isinstance(module, PartialMoESublayer) else ""
    return f"L{layer}.{SUBLAYER_NAMES[k]}{head}"
