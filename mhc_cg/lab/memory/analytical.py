"""The analytical memory model of docs/design.md, in elements per token (multiply by tokens and bytes).

One place for the formulas, so the planner, the memory report and the arena agree.
Per sublayer (attention or MLP), the discardable mHC intermediates of the design are:
    mappings  h_pre, h_post (n each), h_res (n*n)          n*n + 2n
    aggregate, norm output                                  2C
    mixed residual (h_res x), h_post output, BDA output     3nC
"""

from __future__ import annotations



def sublayer_transient_elements(num_streams: int, hidden_size: int) -> int:
    n, c = num_streams, hidden_size
    return n * n + 2 * n + (3 * n + 2) * c


def no_recompute_elements_per_layer(num_streams: int, hidden_size: int) -> int:
    """mHC state kept from forward to backward per layer without recompute (both sublayers)."""
    return 2 * sublayer_transient_elements(num_streams, hidden_size)


def state_elements(num_streams: int, element_bytes: int = 4) -> float:
    """One sublayer's mapping state ``[proj | xnorm | rstd]`` (n*n + 2n + 2 values, kept in fp32, or
    fp64 for fp64 models), in elements of the model's dtype (``element_bytes`` each)."""
    n = num_streams
    return (n * n + 2 * n + 2) * max(4, element_bytes) / element_bytes


def sublayer_saved_elements(num_streams: int, hidden_size: int, element_bytes: int = 4) -> float:
    """What autograd actually keeps of one sublayer without recompute, op by op (per token).

    The intermediates listed above are not what autograd saves: the fused ops
    (``mhc_cg.ops.kernels``) keep their inputs and one small per-token state, and derive every
    mapping from it; the mixed residual, h_post's output, the dropout mask (regenerated from the
    seed) and the aggregate (recomputed from x) are never kept::

        x, read once by the pre (and by the post, through the pre's hand-over)    n*C
        F's input (the norm's output, saved by F)                                   C
        F's output (saved by the post)                                              C
        the mapping state [proj | xnorm | rstd]                                     n*n + 2n + 2, fp32

    plus one seed scalar per sublayer (not per token). ``mhc-cg memory`` measures the real figure
    beside this one.
    """
    n, c = num_streams, hidden_size
    return n * c + 2 * c + state_elements(n, element_bytes)


def saved_elements_per_layer(num_streams: int, hidden_size: int, element_bytes: int = 4) -> float:
    """``sublayer_saved_elements`` for both sublayers of a layer (no recompute)."""
    return 2 * sublayer_saved_elements(num_streams, hidden_size, element_bytes)


def block_persistent_elements(num_streams: int, hidden_size: int, layers_in_block: int) -> int:
    """What eager block recompute keeps per block: the block input x_l0 (n*C) and each F output
    (C); it re-runs the pre, so the mapping states are recomputed."""
    return num_streams * hidden_size + 2 * layers_in_block * hidden_size


def persistent_set_elements(num_streams: int, hidden_size: int, layers_in_block: int,
                            element_bytes: int = 4) -> float:
    """What static-buffer recompute keeps per block and microbatch: the same, and per sublayer the
    mapping state, which its recompute derives the mappings from instead of re-running the
    projection."""
    return (block_persistent_elements(num_streams, hidden_size, layers_in_block)
            + 2 * layers_in_block * state_elements(num_streams, element_bytes))


def arena_elements(num_streams: int, hidden_size: int, layers_in_block: int) -> int:
    """One recompute block's transient state: what the static-buffer arena holds, once per rank:
    each sublayer's stream input but the block's first (saved from its persistent slot) and each
    sublayer's F input."""
    sublayers = 2 * layers_in_block
    return (sublayers - 1) * num_streams * hidden_size + sublayers * hidden_size


def mlp_activation_elements(ffn_hidden_size: int) -> int:
    """The MLP's gelu output per token and layer: what activation recompute no longer
    keeps. Its input, fc1's output (also ``ffn`` per token), stays: the gelu's backward needs it."""
    return ffn_hidden_size
