"""The analytical memory model of docs/design.md, in elements per token (multiply by tokens and bytes).

One place for the formulas, so the planner, the memory report and the arena agree.
Per sublayer (attention or MLP), the discardable mHC intermediates are:
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


def sublayer_saved_elements(num_streams: int, hidden_size: int) -> int:
    """What autograd actually keeps of one sublayer without recompute, op by op (per token).

    The intermediates listed above are not what autograd saves: the fused ops (``mhc_cg.ops.kernels``)
    keep their inputs only, so the mixed residual, the h_post output and the BDA output are never
    kept, nor is a dropout mask (the backward regenerates it from the seed); instead these are::

        x, read by the mapping projection, its norm, aggregate and h_res           n*C
        aggregate output (RMSNorm's input; its scale is recomputed)               C
        norm output (F's input, which F saves and block recompute discards)       C
        F output (saved by post_bda)                                              C
        projection output (n*n + 2n), h_pre, h_post (n each), h_res (n*n)         2(n*n + 2n)
        the norm of x                                                             1

    plus one seed scalar per sublayer (not per token). ``mhc-cg memory`` measures the real figure
    beside this one.
    """
    n, c = num_streams, hidden_size
    return n * c + 3 * c + 2 * (n * n + 2 * n) + 1


def saved_elements_per_layer(num_streams: int, hidden_size: int) -> int:
    """``sublayer_saved_elements`` for both sublayers of a layer (no recompute)."""
    return 2 * sublayer_saved_elements(num_streams, hidden_size)


def block_persistent_elements(num_streams: int, hidden_size: int, layers_in_block: int) -> int:
    """What block recompute keeps per block: the block input x_l0 (n*C) and each F output (C)."""
    return num_streams * hidden_size + 2 * layers_in_block * hidden_size


def arena_elements(num_streams: int, hidden_size: int, layers_in_block: int) -> int:
    """One recompute block's transient state: what the static-buffer arena holds, once per rank.
    The block's input (n*C) is saved from its persistent slot, not copied into the arena."""
    return (2 * layers_in_block * sublayer_transient_elements(num_streams, hidden_size)
            - num_streams * hidden_size)


def mlp_activation_elements(ffn_hidden_size: int) -> int:
    """The MLP's gelu output per token and layer: what activation recompute no longer
    keeps. Its input, fc1's output (also ``ffn`` per token), stays: the gelu's backward needs it."""
    return ffn_hidden_size
