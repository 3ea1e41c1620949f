"""An MHCGPT trained with static-buffer mHC recompute, its sublayers and recompute in graphs.

``cuda_graph_scope`` decides what is captured (DESIGN.md item 6):

* ``attn`` / ``mlp``: the whole attention / dense MLP sublayer, mHC ops included, as one graphed
  callable (forward graph + backward graph) whose mHC ops save into arena slots;
* ``moe_router`` [+ ``moe_preprocess``]: the MoE MLP sublayer's mHC ops before F and the router
  [and the dispatcher's preprocess] are captured; capture ends with megatron-core's
  ``MoECudaGraphPartialCaptureSignal`` and the rest (dispatch, experts, mHC ops after F) runs eagerly
  from a ``MoECudaGraphTensorStore`` and writes its own arena segment;
* ``mhc_recompute``: the block recompute, one graph per (recompute block, persistent slot set),
  each in its own private pool.

What is not captured runs eagerly through the same runtime and writes the same slots, so every
combination of scopes computes the same numbers, bit for bit, as eager without recompute.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from .megatron_moe import MoECudaGraphPartialCaptureSignal, MoECudaGraphTensorStore
from .model import MHCGPT, MoEMLP
from .nvtx_ranges import nvtx_range
from .static_recompute import StaticRecompute, StaticRecomputeError, build_static_recompute

SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mhc_recompute")


class SlotSublayer(nn.Module):
    """One whole mHC sublayer on the static runtime: ``(x, seed) -> (out, F output)``.

    A module (its parameters are the sublayer's) so that graph capture computes their gradients.
    The F output is returned detached: it only feeds the persistent slot set.
    """

    def __init__(self, runtime: StaticRecompute, sub: nn.Module, position: int, k: int):
        super().__init__()
        self.sub = sub
        self.runtime, self.position, self.k = runtime, position, k

    def forward(self, x: Tensor, seed: Tensor) -> tuple[Tensor, Tensor]:
        out, y = self.runtime.sublayer(self.sub, self.position, self.k, x, seed)
        return out, y.detach()


class PartialMoESublayer(nn.Module):
    """The captured head of a MoE MLP sublayer: mHC ops before F, then the router [+ preprocess].

    Returns ``(mixed, h_post, *early)`` where ``early`` is what megatron-core's signal collects
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

    def forward(self, x: Tensor, seed: Tensor) -> tuple[Tensor, ...]:
        normed, h_post, mixed = self.runtime.sublayer_pre(self.sub, self.position, self.k, x)
        moe: MoEMLP = self.sub.fn
        moe.partial_capture = self.step
        try:
            with self.runtime.fn_region():
                moe(normed)
        except MoECudaGraphPartialCaptureSignal as signal:
            early = signal.get_early_return_outputs(normed.reshape(-1, normed.shape[-1]), None)
        else:
            raise StaticRecomputeError("the MoE layer did not raise its partial-capture signal")
        finally:
            moe.partial_capture = None
        return (mixed, h_post, *early)


def moe_eager_tail(runtime: StaticRecompute, sub: nn.Module, position: int, k: int, step: str,
                   head_outputs: Sequence[Tensor], seed: Tensor) -> tuple[Tensor, Tensor]:
    """The eager rest of a partially captured MoE sublayer; returns (out, F output)."""
    mixed, h_post, hidden, probs, *rest = head_outputs
    moe: MoEMLP = sub.fn
    store = MoECudaGraphTensorStore()
    if step == "route":
        store.set(hidden_states=hidden, probs=probs, routing_map=rest[0])
    else:
        store.set(hidden_states=hidden, probs=probs)
        for name, value in zip(moe.token_dispatcher.valid_cudagraph_attrs, rest):
            setattr(moe.token_dispatcher, name, value)
    with runtime.fn_region():
        y = moe(mixed.narrow(-1, 0, hidden.shape[-1]), store)  # only its shape is read
    return runtime.sublayer_post(sub, position, k, y, h_post, mixed, seed), y


class GraphedStaticModel:
    """``model`` with static-buffer recompute; the scopes in ``scopes`` run as graphs.

    ``prepare()`` does everything that allocates: arena layout, persistent sets, capture. After
    it, a training step allocates nothing static and moves no slot. ``capacity`` is how many
    microbatches may be in flight between a forward and its backward (1 without pipelining).
    """

    def __init__(self, model: MHCGPT, scopes: Sequence[str], *, micro_batch_size: int,
                 backend: str = "auto", capacity: int = 1, block_size: int | None = None):
        unknown = [s for s in scopes if s not in SCOPES]
        if unknown:
            raise StaticRecomputeError(f"unknown cuda_graph_scope entries {unknown}; "
                                       f"known: {list(SCOPES)}")
        if "moe" in scopes:
            raise StaticRecomputeError(
                "scope 'moe' captures the whole MoE layer, whose dispatch has data-dependent "
                "shapes; use [moe_router] or [moe_router, moe_preprocess] (partial capture)")
        self.model, self.scopes = model, tuple(scopes)
        sublayer_scopes = {"attn", "mlp", "moe_router", "moe_preprocess"} & set(scopes)
        if capacity > 1 and sublayer_scopes:
            # one graph per sublayer serves every microbatch: a second forward replay before the
            # first one's backward would overwrite the activations that backward reads
            raise StaticRecomputeError(
                f"capacity={capacity} microbatches in flight with graphed sublayers "
                f"{sorted(sublayer_scopes)}: each sublayer has one graph here, valid for one "
                f"microbatch at a time; for pipelined schedules capture one graph per (chunk, "
                f"microbatch, layer) with make_graphed_callables(..., order=pipeline_order(...)) "
                f"(see tests/test_static_pipeline.py), or graph only mhc_recompute")
        self.micro_batch_size, self.capacity = micro_batch_size, capacity
        self.block_size = block_size or model.cfg.resolved_recompute_layers
        self.backend_name = backend
        self.runtime: StaticRecompute | None = None
        self.sublayer_fns: dict[tuple[int, int], Callable] = {}
        self.graphed_callables: tuple = ()  # make_graphed_callables' result (has .graphs())
        self.backend = None

    @property
    def moe_step(self) -> str | None:
        if "moe_preprocess" in self.scopes:
            return "preprocess"
        return "route" if "moe_router" in self.scopes else None

    def prepare(self, device: torch.device | str) -> "GraphedStaticModel":
        from .graphed_sublayers import sublayer_sample_args
        from .graphs import get_backend
        from .graphs.graphed_callables import make_graphed_callables

        cfg = self.model.cfg
        layers = list(self.model.layers)
        dtype = self.model.embedding.weight.dtype  # activations follow the parameters
        self.runtime = build_static_recompute(
            layers, self.block_size, seq_length=cfg.seq_length,
            micro_batch_size=self.micro_batch_size, capacity=self.capacity, device=device,
            dtype=dtype)
        self.backend = get_backend(self.backend_name)
        modules, keys = [], []
        for index, layer in enumerate(layers):
            position = index % self.block_size
            if "attn" in self.scopes:
                modules.append(SlotSublayer(self.runtime, layer.attention, position, 0))
                keys.append((layer.layer_number, 0))
            if cfg.is_moe and self.moe_step:
                modules.append(PartialMoESublayer(self.runtime, layer.mlp, position, 1,
                                                  self.moe_step))
                keys.append((layer.layer_number, 1))
            elif not cfg.is_moe and "mlp" in self.scopes:
                modules.append(SlotSublayer(self.runtime, layer.mlp, position, 1))
                keys.append((layer.layer_number, 1))
        if modules:
            sample_args = sublayer_sample_args(self.model, self.micro_batch_size, len(modules),
                                               device)
            # a partially captured MoE sublayer leaves its experts' parameters to the eager tail
            graphed = make_graphed_callables(tuple(modules), sample_args,
                                             backend=self.backend,
                                             allow_unused_input=self.moe_step is not None)
            self.graphed_callables = graphed
            for key, module, fn in zip(keys, modules, graphed):
                self.sublayer_fns[key] = self._wrap(key, module, fn)
        if "mhc_recompute" in self.scopes:
            self.runtime.capture_recompute_graphs(self.backend)
        return self

    def _wrap(self, key: tuple[int, int], module: nn.Module, fn: Callable) -> Callable:
        layer, k = key
        phase = "attn" if k == 0 else "mlp"
        if isinstance(module, PartialMoESublayer):
            def run_partial(x: Tensor, seed: Tensor) -> tuple[Tensor, Tensor]:
                with nvtx_range("fwd", 0, None, f"{layer}.moe_head"):
                    head = fn(x, seed)
                with nvtx_range("eager", 0, None, f"{layer}.moe_tail"):
                    return moe_eager_tail(self.runtime, module.sub, module.position, module.k,
                                          module.step, head, seed)
            return run_partial

        def run(x: Tensor, seed: Tensor) -> tuple[Tensor, Tensor]:
            with nvtx_range("fwd", 0, None, f"{layer}.{phase}"):
                return fn(x, seed)
        return run

    def forward(self, input_ids: Tensor, dropout_seed: Tensor) -> Tensor:
        if self.runtime is None:
            raise StaticRecomputeError("GraphedStaticModel.prepare(device) must run before forward")
        x = self.model.embed(input_ids)
        x = self.runtime.forward(x, dropout_seed, self.sublayer_fns)
        return self.model.logits(x)

    __call__ = forward

    def graphs(self) -> list:
        """Every captured graph: sublayer forward/backward graphs, then recompute graphs."""
        sublayer = list(self.graphed_callables.graphs()) if self.graphed_callables else []
        return sublayer + list(self.runtime.recompute_graphs.values())

    @property
    def num_graphs(self) -> int:
        return len(self.graphs())

    def describe(self) -> dict:
        rt = self.runtime
        return {
            "scopes": list(self.scopes),
            "block_size": self.block_size,
            "arena_bytes": rt.arena.nbytes,
            "persistent_bytes_per_microbatch": rt.sets.nbytes_per_set,
            "persistent_sets": rt.sets.capacity,
            "graphs": self.num_graphs,
            "recompute_graphs": len(rt.recompute_graphs),
        }
