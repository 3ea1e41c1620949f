"""Fused mHC kernels: a sublayer's mHC work is two ops around F, forward and backward, plus one op
that recomputes a whole block; Triton on CUDA, the torch reference on CPU.

* ``pre``: the mappings and F's input, in two passes over the stream ``x``: the first computes
  the per-token ``state = [proj | xnorm | rstd]`` (n^2 + 2n + 2 values: the mapping projection,
  the norm of ``x`` and, through the streams' Gram matrix, the scale of the sublayer's RMSNorm),
  the second F's input ``rstd * w * sum_i h_pre[i] x[i]``. Every mapping is derived from the
  state (Sinkhorn in registers, per token), never stored. Its backward adds the stream gradient
  the post sent in place (:mod:`mhc_cg.ops.kernels.autograd`);
* ``post``: ``H_res x + dropout(H_post y)``, the residual mix, H_post, the counter dropout (mask
  ``counter_hash(seed, stream, index)``, drawn again in the backward) and the add in one pass;
  told the next sublayer's pre (``next_pre``), the same pass also computes that pre's state
  from the tiles it writes, and the pre then reads its input once (same bits);
* ``recompute_block``: a block's chain of residual updates from its input and F's outputs, writing
  each sublayer's input and F's input into the buffers given (the static runtime's slots);
* ``rms_norm``: an RMSNorm (the model's final norm);
* ``cross_entropy``: the language-model loss, in fp32 one row at a time: the logits are read
  once forward and once backward, and no fp32 ``[tokens, vocab]`` tensor is made.

These wrappers take the model's ``[s, b, ...]`` tensors and a ``kernels`` choice
(``auto | torch | triton``, see ``mhc_cg.ops.kernels.dispatch``), and H_res's layout
``h_res_transposed`` (False: ``H_res x``, Megatron-LM main; True: ``H_res^T x``, Megatron-LM dev).
"""

from __future__ import annotations

from torch import Tensor

from mhc_cg.ops.kernels import custom_ops as ops
from mhc_cg.ops.kernels.autograd import (Handoff, NextPre, Post, PostConfig, PostLink, Pre,
                                         PreConfig, Target)
from mhc_cg.ops.kernels.dispatch import KERNELS, kernels_problem, use_triton

__all__ = ["KERNELS", "Handoff", "NextPre", "PostLink", "Target", "kernels_problem",
           "use_triton", "pre", "post", "post_feeding", "recompute_block", "rms_norm",
           "cross_entropy"]


def pre(x: Tensor, weight: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor,
        norm_weight: Tensor | None, n: int, iterations: int, eps: float, kernels: str = "auto",
        fn_input_out: Target | None = None, state_out: Target | None = None, *,
        h_res_transposed: bool = False, state: Tensor | None = None,
        link: PostLink | None = None, grad_owned: bool = False,
        arithmetic: str = "main") -> tuple[Tensor, Tensor, Tensor]:
    """``x [*, nC] -> (F's input [*, C], state [*, m+2], x_on [*, nC])``. ``x_on`` (a view of
    ``x``) is for the sublayer's :func:`post` and nothing else (see
    :mod:`mhc_cg.ops.kernels.autograd`). ``norm_weight`` None: no RMSNorm. ``h_res_transposed``
    must be the post's: the pre's backward adds the post's residual path to x's gradient.
    ``state``: x's state as the post before computed it (:func:`post_feeding`; it may lie in
    ``state_out`` already); else the pre computes it: the same bits, a given state saves a read
    of x. ``link``: that post's :class:`PostLink`: this pre's backward computes the post's F
    output gradient, so the post's does not read x's gradient again. ``grad_owned``: ``x_on``
    is a graph's output, whose gradient comes in the graph's own buffer (no post reads it in the
    graph). ``arithmetic``: main's or dev's mHC (``reference.ARITHMETICS``), the post's too."""
    cfg = PreConfig(n, iterations, float(eps), use_triton(kernels, x.device),
                    bool(h_res_transposed), arithmetic)
    return Pre.apply(x, weight, a_pre, a_post, a_res, bias, norm_weight, cfg, fn_input_out,
                     state_out, state, link, bool(grad_owned))


def post(x_on: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor, bias: Tensor,
         y: Tensor, seed: Tensor | None, p: float, stream: int, n: int, iterations: int,
         kernels: str = "auto", out: Target | None = None, *,
         h_res_transposed: bool = False, grad_owned: bool = False,
         arithmetic: str = "main") -> Tensor:
    """``H_res x + dropout(H_post y)``: ``[*, nC], [*, m+2], [*, C] -> [*, nC]``. ``seed`` None
    or ``p == 0``: no dropout; the mask is the one ``mhc_cg.ops.dropout`` draws for a ``[*, nC]``
    tensor with the same seed and stream. ``grad_owned``: the result's gradient will come in a
    buffer only this backward reads (a graph's static grad output), which the pre's backward may
    write x's gradient over."""
    return _post(x_on, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
                 kernels, out, h_res_transposed, None, None, grad_owned, arithmetic)[0]


def post_feeding(x_on: Tensor, state: Tensor, a_pre: Tensor, a_post: Tensor, a_res: Tensor,
                 bias: Tensor, y: Tensor, seed: Tensor | None, p: float, stream: int, n: int,
                 iterations: int, next_pre: NextPre, kernels: str = "auto",
                 out: Target | None = None, state_out: Target | None = None, *,
                 h_res_transposed: bool = False, grad_owned: bool = False,
                 arithmetic: str = "main") -> tuple[Tensor, Handoff]:
    """:func:`post`, and the state of ``next_pre`` (the pre that reads the result next)
    computed from the tiles written (into ``state_out`` when given): ``(result, handoff)``,
    the :class:`Handoff` for the caller to give that pre (same bits as the pre computing it)."""
    return _post(x_on, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations,
                 kernels, out, h_res_transposed, next_pre, state_out, grad_owned, arithmetic)


def _post(x_on, state, a_pre, a_post, a_res, bias, y, seed, p, stream, n, iterations, kernels,
          out, h_res_transposed, next_pre, state_out, grad_owned,
          arithmetic) -> tuple[Tensor, Handoff | None]:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    cfg = PostConfig(float(p), int(stream), n, iterations, use_triton(kernels, x_on.device),
                     bool(h_res_transposed), arithmetic)
    links: list = []
    result, state = Post.apply(x_on, state, a_pre, a_post, a_res, bias, y,
                               seed if p > 0 else None, cfg, out, next_pre, state_out, links,
                               bool(grad_owned))
    if state is None:
        return result, None
    return result, Handoff(result, result._version, state, next_pre, links[0])


def recompute_block(x0: Tensor, ys: Tensor, states: Tensor, params: Tensor,
                    norm_weights: Tensor | None, seed: Tensor | None, p: float,
                    streams: list[int], n: int, iterations: int, eps: float, x_out: Tensor,
                    fn_input_out: Tensor, kernels: str = "auto", *,
                    h_res_transposed: bool = False, arithmetic: str = "main") -> None:
    """A block's recompute into ``x_out [S-1, *, nC]`` and ``fn_input_out [S, *, C]`` (writers):
    ``x0 [*, nC]`` its input, ``ys [S, *, C]`` F's outputs, ``states [S, *, m+2]``,
    ``params [S, m+3]`` (``bias | a_pre, a_post, a_res`` per sublayer), ``norm_weights [S, C]``."""
    s, width = ys.shape[0], x0.shape[-1]
    states = states.reshape(s, -1, states.shape[-1])
    m, use = n * n + 2 * n, use_triton(kernels, x0.device)
    maps = ops.post_maps(states[:-1], params[:-1, :m], params[:-1, m + 1], params[:-1, m + 2],
                         width, n, iterations, use, arithmetic)
    ops.recompute(x0.reshape(-1, width), ys.reshape(s, -1, ys.shape[-1]), states, maps, params,
                  norm_weights, seed if p > 0 else None, float(p), list(streams), n, iterations,
                  float(eps), use, x_out.view(max(s - 1, 0), -1, width),
                  fn_input_out.view(s, -1, ys.shape[-1]), bool(h_res_transposed), arithmetic)


def rms_norm(x: Tensor, weight: Tensor, eps: float, kernels: str = "auto") -> Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight``: ``[*, C], [C] -> [*, C]``."""
    out = ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, float(eps), use_triton(kernels, x.device))
    return out.view(x.shape)


def cross_entropy(logits: Tensor, targets: Tensor, kernels: str = "auto", *,
                  grad_over_logits: bool = False) -> Tensor:
    """The mean over tokens of ``logsumexp(logits) - logits[target]``, in fp32 (fp64 for fp64
    logits): ``[*, V], [*] -> []``, as ``F.cross_entropy(logits.float(), targets)`` computes it
    (targets in ``[0, V)``; no ignored index, no smoothing).

    ``grad_over_logits``: the backward writes the logits' gradient into the logits' memory
    (Megatron's fused cross entropy does the same): one ``[T, V]`` tensor at the loss's backward,
    not two. Only for logits nothing else reads after the loss; a leaf is refused (its ``.grad``
    would be itself)."""
    if grad_over_logits and logits.requires_grad and logits.grad_fn is None:
        raise ValueError("mhc_cg cross_entropy: grad_over_logits needs logits made by the model, "
                         "not a leaf tensor (its .grad would overwrite it)")
    v = logits.shape[-1]
    logits, targets = _in_memory_order(logits, targets)
    loss, _ = ops.cross_entropy(logits.reshape(-1, v), targets.reshape(-1),
                                use_triton(kernels, logits.device), grad_over_logits)
    return loss.mean()


def _in_memory_order(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``logits`` and ``targets`` with their token dims permuted alike into the logits' memory
    order, when that makes the logits contiguous: ``[b, s, V]`` logits that are a transposed view
    of ``[s, b, V]`` then flatten to rows as a view, not a copy of every logit (the mean over
    tokens does not depend on their order; the targets are the ones copied)."""
    lead = list(range(logits.dim() - 1))
    order = sorted(lead, key=lambda d: -logits.stride(d))
    if order != lead and logits.permute(*order, len(lead)).is_contiguous():
        return logits.permute(*order, len(lead)), targets.permute(*order)
    return logits, targets
