"""How the Triton kernels tile their work: tokens and features per program, feature splits,
the grids that fill 132 SMs, and the fp32 buffers their passes hand each other (the kernels size
them from here; the cost model counts their bytes from here)."""

from __future__ import annotations

import math

DOT_ROWS = 16  # tokens per Triton program where a kernel multiplies by the mapping weight (tl.dot)
SUM_ROWS = 4  # tokens per program of the state's second stage
# Programs a kernel's grid should have at least: 4 per SM of an H100 or H200 (132 SMs), so that
# every SM holds several blocks to hide latency with
MIN_PROGRAMS = 4 * 132


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def block_c(c: int, budget: int) -> int:
    """Features per step: ``budget`` elements over the tile's other axes, 16 to the width of C."""
    return max(16, min(next_pow2(c), next_pow2(budget)))


def mapping_columns(n: int) -> int:
    """The mappings' ``n^2 + 2n`` columns padded to a power of two, at least 16 (``tl.dot``)."""
    return max(16, next_pow2(n * n + 2 * n))


# The state's first stage holds its streams' [rows, BC] tiles of x per step: its features per
# step shrink as its tokens per program grow, so the tiles keep about the same registers
STATE_TILE = 4096


def state_rows(x_bytes: int, weight_bytes: int, rows: int | None = None) -> int:
    """Tokens per program of the state's first stage (``rows`` given: that).
    Note [wide token tiles]: each program reads the mapping weight's m rows over its features
    once for its tokens, so the weight's reads are ``m * size(w) / (rows * size(x))`` of x's: 64 tokens keep
    them at 0.375 of x for weights in x's dtype, 128 for fp32 weights beside bf16 x."""
    if rows is not None:
        return rows
    return 64 if weight_bytes <= x_bytes else 128


def state_tiling(c: int, n: int, rows: int) -> tuple[int, int, int]:
    """``(NP, MP, BC)`` of the state kernels at ``rows`` tokens per program: streams and mapping
    columns padded to powers of two (the rows the second stage sums), features per step (each
    stream's ``tl.dot`` depth, at least 16)."""
    np_ = next_pow2(n)
    bc = max(16, min(next_pow2(c), next_pow2(max(1, STATE_TILE // (rows * np_)))))
    return np_, mapping_columns(n), bc


def state_splits(tokens: int, c: int, bc: int, rows: int,
                 splits: int | None = None) -> tuple[int, int]:
    """``(splits, features per split)`` of the state's first stage: whole ``bc`` steps per split;
    ``splits`` None: a power of two, enough that ``tokens / rows x splits`` programs reach
    :data:`MIN_PROGRAMS`; never more splits than steps, never an empty one."""
    steps = max(1, math.ceil(c / bc))
    blocks = max(1, math.ceil(tokens / rows))
    if splits is None:
        splits = next_pow2(math.ceil(MIN_PROGRAMS / blocks))
    splits = max(1, min(splits, next_pow2(steps)))
    while splits > 1 and math.ceil(steps / splits) * (splits - 1) >= steps:
        splits //= 2  # no empty split
    span = math.ceil(steps / splits) * bc
    return math.ceil(c / span), span


def state_scratch(tokens: int, c: int, n: int, m: int, rows: int) -> dict[str, tuple[int, ...]]:
    """The fp32 rows the state's first stage writes and its second sums: per split and token
    ``[proj (MP) | Gram matrix (NP * NP)]``."""
    np_, mp, bc = state_tiling(c, n, rows)
    return {"part": (state_splits(tokens, c, bc, rows)[0], tokens, mp + np_ * np_)}


def weight_grad_groups(tokens: int, c: int, m: int, n: int) -> tuple[int, int]:
    """``(groups, tokens per group)`` the pre's backward sums the mapping weight's gradient over
    (each group writes an fp32 ``[m, nC]`` partial, then summed in group order): enough groups
    that the second pass's grid (feature chunks x groups) reaches :data:`MIN_PROGRAMS`, never
    more partial bytes than an eighth of x's (``groups * m * 4 <= tokens * 2 / 8``); whole
    ``DOT_ROWS`` blocks per group."""
    blocks = max(1, math.ceil(tokens / DOT_ROWS))
    chunks = math.ceil(c / block_c(c, 128 // next_pow2(n)))
    want = max(1, min(blocks, math.ceil(MIN_PROGRAMS / chunks), tokens // (16 * max(m, 1))))
    per_group = math.ceil(blocks / want) * DOT_ROWS
    return math.ceil(blocks * DOT_ROWS / per_group), per_group


def post_backward_scratch(tokens: int, c: int, n: int, m: int) -> dict[str, tuple[int, ...]]:
    """The fp32 buffer the post's backward kernel writes and torch sums after it: per token the
    parameters' shares ``[bias (m) | alpha_pre, alpha_post, alpha_res]``."""
    return {"shares": (tokens, m + 3)}


def pre_backward_scratch(tokens: int, c: int, n: int, m: int, post: bool = False,
                         prev: bool = False) -> dict[str, tuple[int, ...]]:
    """The fp32 buffers the pre's backward kernels hand each other: per token the projection's
    gradient, the parameters' shares (as the post's) and the coefficients ``[kappa, coef, rstd,
    s | H_res]`` (and ``| s_prev`` with the previous post's F output gradient, ``prev``); per
    group of tokens the mapping weight's gradient; with the post's reductions (``post``), the
    state's gradient they are summed into."""
    groups, _ = weight_grad_groups(tokens, c, m, n)
    return {"g_proj": (tokens, m), **post_backward_scratch(tokens, c, n, m),
            "aux": (tokens, 3 + n + n * n + (n if prev else 0)), "g_weight": (groups, m, n * c),
            **({"g_state": (tokens, m + 2)} if post else {})}


def post_maps_shape(tokens: int, n: int, posts: int) -> tuple[int, int, int]:
    """:func:`post_maps`'s result: per post and token ``[H_post / 2 (n) | H_res (n*n)]``."""
    return posts, tokens, n + n * n
