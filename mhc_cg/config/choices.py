"""The values a config field may take, named once: read by the rules, the CLI and the runtime."""

MODEL_RECOMPUTE = ("none", "block")
# mhc: the n-stream mHC residual; plain: x + dropout(F(norm(x))), the baseline of mHC's overhead
RESIDUALS = ("mhc", "plain")
# the mHC arithmetic: the paper's (Megatron-LM main), DeepSeek-V4's (Megatron-LM dev) and
# DeepSeek-V4.1's delayed pre
ARITHMETICS = ("main", "dev", "v41")
ARITHMETIC_NAMES = {"main": "the paper's mHC (Megatron-LM main)",
                    "dev": "DeepSeek-V4's mHC (Megatron-LM dev)",
                    "v41": "DeepSeek-V4.1's mHC, the delayed pre"}
DROPOUT_IMPLS = ("counter", "torch")  # counter: mask = hash(seed, index); torch: stateful generator
DEVICES = ("cpu", "cuda", "auto")
GRAPH_BACKENDS = ("auto", "cuda", "te", "tape")

# graph.cuda_graph_scope: what is captured (mhc_cg.modes.plan says what each one means)
SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mhc_recompute")
MOE_SCOPES = ("moe", "moe_router", "moe_preprocess")
RECOMPUTE_SCOPE = "mhc_recompute"


def split_recompute_scope(scopes) -> tuple[list[str], bool]:
    """``(the scopes megatron knows, whether 'mhc_recompute' was listed)``: megatron's
    ``CudaGraphScope`` has no ``mhc_recompute``, so it is taken off before megatron parses them."""
    return [s for s in scopes if s != RECOMPUTE_SCOPE], RECOMPUTE_SCOPE in scopes


# what static-buffer recompute graphs when no scope is configured
DEFAULT_STATIC_SCOPES = ("attn", RECOMPUTE_SCOPE)

# The synthetic corpus (mhc_cg.training.data) needs room for its strides.
MIN_VOCAB_SIZE = 8
