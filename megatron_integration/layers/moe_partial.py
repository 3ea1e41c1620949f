"""A MoE layer of Megatron-LM dev graphed up to megatron's partial-capture signal, on the static
runtime.

With ``moe_router`` (and ``moe_preprocess``) in ``cuda_graph_modules``, megatron's ``MoELayer``
stops its forward while the helper captures: after the router (``route``) or after the
dispatcher's preprocess (``preprocess``), its ``MoECudaGraphPartialCaptureSignal`` turns the
forward's return value into the tensors computed so far (hidden states, probs, routing map or
the dispatcher's tensors). The token dispatch, the experts and the combine follow the routing,
so they stay eager.

On the static runtime a MoE layer's graph then holds its attention sublayer, the MLP
sublayer's mHC ops before F (their state in arena slots) and F up to the signal
(:func:`moe_head`); on replay :func:`moe_tail` hands megatron's tensors back to the MoE layer
(its ``cudagraph_tensor_store``, as megatron's own replay does), which runs the rest, and then the
mHC ops after F, which save into the same slots as an eager forward and keep F's output in the
microbatch's persistent set. The recompute graphs rebuild both sublayers' mHC state as for a
dense layer: F is never recomputed.
"""

from __future__ import annotations

from torch import Tensor


def moe_capture_step(layer) -> str | None:
    """``"route"`` or ``"preprocess"`` where megatron's helper ends ``layer``'s graph inside its
    MoE MLP (``moe_router`` [+ ``moe_preprocess``] in scope); ``None`` for a dense layer or
    without those scopes."""
    if not getattr(layer, "is_moe_layer", False):
        return None
    scopes = {getattr(s, "name", s) for s in getattr(layer.config, "cuda_graph_modules", None) or ()}
    if "moe_router" not in scopes:
        return None
    if getattr(layer.config, "moe_shared_expert_intermediate_size", None) is not None:
        raise ValueError(f"layer {layer.layer_number}: shared experts under MoE partial capture "
                         f"are not wired on the static runtime; set "
                         f"moe_shared_expert_intermediate_size=None")
    return "preprocess" if "moe_preprocess" in scopes else "route"


def moe_head(runtime, steps, record, x: Tensor, frame) -> tuple[Tensor, ...]:
    """The graphed part of the MLP sublayer (``record``): its mHC ops before F (writing
    ``frame``'s persistent set), then the MoE layer up to the signal. Returns
    ``(*carry, *early)``: what the mHC ops after F take, then megatron's early outputs."""
    fn_input, carry = runtime.sublayers.pre(record, x, frame)
    early = steps.layer.mlp(fn_input, **steps.mlp_kwargs)
    if not isinstance(early, list):
        raise RuntimeError(f"layer {steps.layer_number}: the MoE layer ran to its end inside the "
                           f"layer graph; megatron's partial-capture signal fires only while its "
                           f"helper captures (is_graph_capturing) with moe_router in "
                           f"cuda_graph_modules")
    return (*carry, *early)


def moe_tail(runtime, steps, record, step: str, head: tuple[Tensor, ...],
             frame) -> tuple[Tensor, Tensor, Tensor | None]:
    """The eager rest of the MLP sublayer (``record``) after a replay of its graph: the MoE layer
    from megatron's early outputs (dispatch, experts, combine), then the mHC ops after F, writing
    the forward's persistent set (its ``frame``'s); returns ``(output, F output as the persistent
    set keeps it, mapping state)``."""
    sub, moe = steps.mlp, steps.layer.mlp
    carry, early = tuple(head[:2]), list(head[2:])
    if step == "preprocess":
        hidden, probs, *attrs = early
        routing_map = None
        names = moe.token_dispatcher.valid_cudagraph_attrs
        if len(names) != len(attrs):
            raise RuntimeError(f"layer {steps.layer_number}: the graph returned {len(attrs)} "
                               f"dispatcher tensors for {len(names)} attributes")
        for name, value in zip(names, attrs):
            moe.token_dispatcher.set_cudagraph_attr(name, value)
    else:
        hidden, probs, routing_map = early
    moe.cudagraph_tensor_store.set(hidden_states=hidden, probs=probs, routing_map=routing_map,
                                   shared_expert_output=None)
    try:
        y, sub.bias = moe(hidden)  # as megatron's replay calls it: the store holds the rest
    finally:
        moe.cudagraph_tensor_store.clear()
    return runtime.path.finish(record, y, carry, frame)
