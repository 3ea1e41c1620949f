"""``transformer_engine.pytorch.router``: TE's fused MoE router kernels, imported by Megatron's
extension for ``--moe-router-fusion``; they need TE's C extension."""


def _unserved(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name} is TE's fused router kernel, not served by the CPU "
                                  f"stand-in of TransformerEngine; drop --moe-router-fusion")
    call.__name__ = name
    return call


fused_topk_with_score_function = _unserved("fused_topk_with_score_function")
fused_compute_score_for_moe_aux_loss = _unserved("fused_compute_score_for_moe_aux_loss")
fused_moe_aux_loss = _unserved("fused_moe_aux_loss")
