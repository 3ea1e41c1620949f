"""mHC math: Manifold-Constrained Hyper-Connections (arXiv 2512.24880).

Layout and conventions (kept identical to Megatron-LM ``main`` so weights interoperate):

* A residual stream tensor is ``[s, b, n*C]``, viewed as ``[s, b, n, C]``: stream-major, the
  C features of one stream contiguous.
* ``mapping_proj`` maps ``n*C -> n*n + 2n``; its output columns are ``[pre (n) | post (n) | res (n*n)]``.
* ``apply_h_res(h_res, x)[i] = sum_j h_res[i, j] * x[j]``: row ``i`` of ``h_res`` says how much
  of every input stream ``j`` flows into output stream ``i`` (Megatron-LM ``main``). With
  ``h_res_transposed=True`` it is ``sum_j h_res[j, i] * x[j]``, ``H_res^T x`` (Megatron-LM
  ``dev``): the same parameters and the same ``h_res``, applied as its transpose.
* ``arithmetic``: ``main``, the paper's as Megatron-LM main computes it; ``dev``, DeepSeek-V4's
  as Megatron-LM dev does (``h_pre = sigmoid + 1e-6``, dev's Sinkhorn: Note [dev's Sinkhorn] in
  :mod:`mhc_cg.ops.kernels.reference`); ``v41``, DeepSeek-V4.1's mappings (dev's, the mixes
  scaled by ``rsqrt(mean(x^2) + eps)``), which a sublayer applies with the delayed pre
  (:mod:`mhc_cg.model.delayed_pre`): stepwise, on torch's ops.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from mhc_cg.core.storage import alias
from mhc_cg.ops import kernels as fused
from mhc_cg.ops.dropout import dropout
from mhc_cg.ops.kernels import reference
from mhc_cg.ops.kernels.reference import RMS_EPS, SINKHORN_EPS
from mhc_cg.core.regions import region

# the fused ops' arithmetics, and DeepSeek-V4.1's, which runs stepwise
ARITHMETICS = (*reference.ARITHMETICS, "v41")


def _check_streams(name: str, x: Tensor, num_streams: int, hidden_size: int | None = None) -> int:
    """Validate ``x`` as ``[s, b, n*C]`` and return C."""
    if x.dim() != 3:
        raise ValueError(
            f"{name}: expected shape [s, b, n*C] with n={num_streams}, got {tuple(x.shape)}")
    width = x.shape[-1]
    if hidden_size is not None and width != num_streams * hidden_size:
        raise ValueError(
            f"{name}: expected shape [s, b, n*C] = [*, *, {num_streams * hidden_size}] "
            f"(n={num_streams}, C={hidden_size}), got {tuple(x.shape)}")
    if width % num_streams:
        raise ValueError(
            f"{name}: last dim {width} of shape {tuple(x.shape)} is not a multiple of n={num_streams}")
    return width // num_streams


def _sinkhorn_iterate(logits: Tensor, iterations: int) -> Tensor:
    m = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(dim=-1, keepdim=True).clamp_min(SINKHORN_EPS)
        m = m / m.sum(dim=-2, keepdim=True).clamp_min(SINKHORN_EPS)
    return m


class _SinkhornKnopp(torch.autograd.Function):
    """Sinkhorn-Knopp projection onto doubly stochastic matrices.

    Saves only the logits (n*n per token); the backward re-runs the ``iterations`` steps under
    autograd and differentiates them, instead of keeping every iterate (O(T*n*n)) alive.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, iterations: int) -> Tensor:
        ctx.iterations = iterations
        ctx.save_for_backward(logits)
        return _sinkhorn_iterate(logits, iterations)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            out = _sinkhorn_iterate(leaf, ctx.iterations)
            (grad,) = torch.autograd.grad(out, leaf, grad_out)
        return grad, None


def sinkhorn_knopp(logits: Tensor, iterations: int = 20) -> Tensor:
    """Doubly stochastic matrix from ``logits [..., n, n]``: rows and columns sum to 1."""
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn_knopp: expected logits of shape [..., n, n], got {tuple(logits.shape)}")
    if iterations < 1:
        raise ValueError(f"sinkhorn_knopp: iterations must be >= 1, got {iterations}")
    return _SinkhornKnopp.apply(logits, iterations)


class _ExpandStreams(torch.autograd.Function):
    """``x [s, b, C]`` written n times into ``out [s, b, n*C]``; returns ``out`` (an alias).

    Its backward reads the incoming gradient once and keeps nothing of it (``reads_grad_once``):
    a graphed consumer may hand it a static grad buffer uncloned
    (:mod:`mhc_cg.graphs.graphed_callables`).
    """

    reads_grad_once = True

    @staticmethod
    def forward(ctx, x: Tensor, num_streams: int, out: Tensor, grad_into: Tensor | None) -> Tensor:
        s, b, c = x.shape
        ctx.shape, ctx.grad_into = (s, b, num_streams, c), grad_into
        out.view(ctx.shape).copy_(x.unsqueeze(-2))
        return alias(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the expand's own backward (the sum over the streams), into the buffer lent for it
        if ctx.grad_into is None:
            return grad.reshape(ctx.shape).sum(-2), None, None, None
        torch.sum(grad.reshape(ctx.shape), dim=-2, out=ctx.grad_into)
        return alias(ctx.grad_into), None, None, None


class _ContractStreams(torch.autograd.Function):
    """The mean over the n streams, whose backward writes the stream's gradient into ``into``
    (the buffer its consumer reads it from: a graph's static grad output)."""

    @staticmethod
    def forward(ctx, x: Tensor, num_streams: int, into: Tensor) -> Tensor:
        s, b, width = x.shape
        ctx.shape, ctx.into = (s, b, num_streams, width // num_streams), into
        return x.view(ctx.shape).mean(dim=-2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # the mean's own backward (expand, then divide by n), written where it is read
        torch.div(grad.unsqueeze(-2).expand(ctx.shape), ctx.shape[2],
                  out=ctx.into.view(ctx.shape))
        return alias(ctx.into), None, None


def _check_buffer(name: str, field: str, buffer: Tensor, shape: tuple, dtype: torch.dtype) -> None:
    """A buffer an op writes whole must be contiguous, of ``shape`` and ``dtype``."""
    if tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype or not buffer.is_contiguous():
        raise ValueError(f"{name}: {field} must be a contiguous {dtype} tensor of shape "
                         f"{tuple(shape)}, got {buffer.dtype} {tuple(buffer.shape)}")


def expand_streams(x: Tensor, num_streams: int, out: Tensor | None = None,
                   grad_into: Tensor | None = None) -> Tensor:
    """``[s, b, C] -> [s, b, n*C]``: every stream starts as a copy of ``x``; written into ``out``
    when given (where the consumer keeps its input: no copy after). ``grad_into``: a buffer
    shaped like ``x`` that the backward writes x's gradient into, for a gradient that dies before
    the buffer is written again (not a leaf's: its ``.grad`` would keep the buffer)."""
    if x.dim() != 3:
        raise ValueError(f"expand_streams: expected shape [s, b, C], got {tuple(x.shape)}")
    s, b, c = x.shape
    if out is None:
        out = x.new_empty(s, b, num_streams * c)
    _check_buffer("expand_streams", "out", out, (s, b, num_streams * c), x.dtype)
    if grad_into is not None:
        if x.requires_grad and x.grad_fn is None:
            raise ValueError("expand_streams: grad_into needs an x made by an op, not a leaf "
                             "tensor (its .grad would keep the lent buffer)")
        _check_buffer("expand_streams", "grad_into", grad_into, (s, b, c), x.dtype)
    with region("mhc"):
        return _ExpandStreams.apply(x, num_streams, out, grad_into)


def contract_streams(x: Tensor, num_streams: int, grad_into: Tensor | None = None) -> Tensor:
    """``[s, b, n*C] -> [s, b, C]``: the mean over the n streams. ``grad_into``: a contiguous
    buffer shaped like ``x`` that the backward writes x's gradient into."""
    c = _check_streams("contract_streams", x, num_streams)
    s, b, _ = x.shape
    with region("mhc"):
        if grad_into is None:
            return x.view(s, b, num_streams, c).mean(dim=-2)
        _check_buffer("contract_streams", "grad_into", grad_into, tuple(x.shape), x.dtype)
        return _ContractStreams.apply(x, num_streams, grad_into)


class HyperConnectionOps:
    """The mHC ops of one hyper-connection, unfused and fused, over parameters named as
    Megatron-LM names them (``mapping_proj.weight``, ``alpha_pre``, ``alpha_post``,
    ``alpha_res``, ``bias``) and the settings ``hidden_size``, ``num_streams``,
    ``sinkhorn_iterations``, ``kernels``, ``h_res_transposed``, ``arithmetic``: the owner of
    the parameters is :class:`HyperConnection` or, for a Megatron module, :class:`KernelsOver`."""

    hidden_size: int
    num_streams: int
    sinkhorn_iterations: int
    kernels: str
    h_res_transposed: bool
    arithmetic: str

    def _gating_scale(self) -> Tensor:
        n = self.num_streams
        return torch.cat([self.alpha_pre.expand(n), self.alpha_post.expand(n),
                          self.alpha_res.expand(n * n)])

    def compute_mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [s, b, n*C] -> h_pre [s, b, n], h_post [s, b, n], h_res [s, b, n, n]``."""
        _check_streams("compute_mappings", x, self.num_streams, self.hidden_size)
        n = self.num_streams
        with region("mhc"):
            mixes = self.mapping_proj(x) * self._gating_scale()
            if self.arithmetic == "v41":  # DeepSeek-V4.1's scale of the mixes
                h = mixes * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) + self.bias
            else:
                rms = x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
                h = mixes / (rms + RMS_EPS) + self.bias
            h_pre = torch.sigmoid(h[..., :n])
            if self.arithmetic != "main":
                h_pre = h_pre + reference.H_PRE_EPS
            return (h_pre, 2.0 * torch.sigmoid(h[..., n:2 * n]),
                    self._sinkhorn(h[..., 2 * n:].unflatten(-1, (n, n))))

    def _sinkhorn(self, logits: Tensor) -> Tensor:
        """H_res from its logits, differentiable: main's Sinkhorn or dev's."""
        if self.arithmetic != "main":
            return reference.sinkhorn_dev(logits, self.sinkhorn_iterations)
        return sinkhorn_knopp(logits, self.sinkhorn_iterations)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        """``sum_i h_pre[i] * x[i]``: ``[s, b, n*C], [s, b, n] -> [s, b, C]``."""
        _check_streams("aggregate", x, self.num_streams, self.hidden_size)
        _check_mapping("aggregate", h_pre, x.shape[:2], (self.num_streams,))
        with region("mhc"):
            return (h_pre.unsqueeze(-1) * x.unflatten(-1, (self.num_streams, -1))).sum(-2)

    def apply_h_res(self, h_res: Tensor, residual: Tensor) -> Tensor:
        """``out[i] = sum_j h_res[i, j] * residual[j]`` (``h_res[j, i]`` with
        ``h_res_transposed``): ``[s, b, n, n], [s, b, n*C] -> [s, b, n*C]``."""
        _check_streams("apply_h_res", residual, self.num_streams, self.hidden_size)
        _check_mapping("apply_h_res", h_res, residual.shape[:2], (self.num_streams, self.num_streams))
        if self.h_res_transposed:
            h_res = h_res.transpose(-1, -2)
        with region("mhc"):
            return torch.matmul(h_res, residual.unflatten(-1, (self.num_streams, -1))).flatten(-2)

    def apply_h_post(self, y: Tensor, h_post: Tensor) -> Tensor:
        """``out[i] = h_post[i] * y``: ``[s, b, C], [s, b, n] -> [s, b, n*C]``."""
        if y.dim() != 3 or y.shape[-1] != self.hidden_size:
            raise ValueError(f"apply_h_post: expected y of shape [s, b, C] = [*, *, {self.hidden_size}], "
                             f"got {tuple(y.shape)}")
        _check_mapping("apply_h_post", h_post, y.shape[:2], (self.num_streams,))
        return (h_post.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None, p: float,
                 stream: int, dropout_impl: str = "counter") -> Tensor:
        """``mixed + dropout(apply_h_post(y, h_post))`` with the counter mask (or torch's)."""
        _check_mapping("post_bda", h_post, y.shape[:2], (self.num_streams,))
        with region("mhc"):
            return mixed + dropout(self.apply_h_post(y, h_post), p, p > 0, impl=dropout_impl,
                                   seed=seed, stream=stream)

    # -- fused: what the model runs ---------------------------------------------------------------
    def pre(self, x: Tensor, norm_weight: Tensor | None, eps: float,
            fn_input_out: fused.Target | None = None, state_out: fused.Target | None = None,
            state: Tensor | None = None, link: fused.PostLink | None = None,
            handoff: fused.Handoff | None = None, *,
            grad_owned: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``(F's input, state, x_on)``: the mappings' state, ``norm(aggregate(x, h_pre))`` from
        one read of ``x``, and ``x`` handed on to :meth:`post` (:mod:`mhc_cg.ops.kernels`).
        ``state``/``link``: x's state as the post before computed it, and that post's link;
        ``handoff``: both as that post handed them on (:meth:`post_feeding`), taken where it is
        for ``x`` and this pre. ``grad_owned``: see :func:`mhc_cg.ops.kernels.pre`."""
        _check_streams("pre", x, self.num_streams, self.hidden_size)
        self._check_fused()
        if state is None and handoff is not None:
            state, link = handoff.for_pre(x, self.mapping_proj.weight, self.alpha_pre, self.bias,
                                          norm_weight is not None, eps, self.arithmetic)
        return fused.pre(x, self.mapping_proj.weight, self.alpha_pre, self.alpha_post,
                         self.alpha_res, self.bias, norm_weight, self.num_streams,
                         self.sinkhorn_iterations, eps, self.kernels, fn_input_out, state_out,
                         h_res_transposed=self.h_res_transposed, state=state, link=link,
                         grad_owned=grad_owned, arithmetic=self.arithmetic)

    def next_pre(self, norm_weight: Tensor | None, eps: float) -> fused.NextPre:
        """This pre, as the post before it sees it (:meth:`post_feeding`'s ``next_pre``)."""
        return fused.NextPre(self.mapping_proj.weight, self.alpha_pre, self.bias,
                             norm_weight is not None, float(eps), self.arithmetic)

    def post(self, x_on: Tensor, state: Tensor, y: Tensor, seed: Tensor | None, p: float,
             stream: int, dropout_impl: str = "counter", out: fused.Target | None = None, *,
             grad_owned: bool = False) -> Tensor:
        """``H_res x + dropout(H_post y)`` (``H_res^T x`` with ``h_res_transposed``), the mappings
        from :meth:`pre`'s state. torch's stateful dropout (eager only) runs unfused from the
        same state. ``grad_owned``: see :func:`mhc_cg.ops.kernels.post`."""
        return self._post(x_on, state, y, seed, p, stream, dropout_impl, out, None, None,
                          grad_owned)[0]

    def post_feeding(self, next_pre: fused.NextPre, x_on: Tensor, state: Tensor, y: Tensor,
                     seed: Tensor | None, p: float, stream: int, dropout_impl: str = "counter",
                     out: fused.Target | None = None, state_out: fused.Target | None = None, *,
                     grad_owned: bool = False) -> tuple[Tensor, fused.Handoff | None]:
        """:meth:`post`, and the state of ``next_pre`` (:meth:`next_pre` of the hyper-connection
        whose pre reads the result; into ``state_out`` when given): ``(result, handoff)``, the
        handoff ``None`` where the post runs unfused (torch's dropout)."""
        return self._post(x_on, state, y, seed, p, stream, dropout_impl, out, next_pre, state_out,
                          grad_owned)

    def _check_fused(self) -> None:
        if self.arithmetic not in reference.ARITHMETICS:
            raise ValueError(f"HyperConnection: the fused ops take arithmetic "
                             f"{' or '.join(reference.ARITHMETICS)}; {self.arithmetic} runs "
                             f"stepwise (mhc_cg.model.delayed_pre)")

    def _post(self, x_on, state, y, seed, p, stream, dropout_impl, out, next_pre, state_out,
              grad_owned) -> tuple[Tensor, fused.Handoff | None]:
        self._check_fused()
        if p > 0 and dropout_impl == "torch":
            h, _, _, _ = reference.logits_of(state.flatten(0, -2), self.alpha_pre, self.alpha_post,
                                             self.alpha_res, self.bias, self.num_streams,
                                             math.sqrt(x_on.shape[-1]))
            n = self.num_streams
            h = h.view(*state.shape[:-1], -1).to(x_on.dtype)
            h_res = self._sinkhorn(h[..., 2 * n:].unflatten(-1, (n, n)))
            return self.post_bda(y, 2.0 * torch.sigmoid(h[..., n:2 * n]),
                                 self.apply_h_res(h_res, x_on), None, p, stream, "torch"), None
        if dropout_impl not in ("counter", "torch"):
            raise ValueError(f"dropout impl must be 'counter' or 'torch', got {dropout_impl!r}")
        if p > 0 and seed is None:
            raise ValueError("counter dropout needs a seed tensor (one int64 scalar per microbatch)")
        args = (x_on, state, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias, y, seed,
                p, stream, self.num_streams, self.sinkhorn_iterations)
        if next_pre is None:
            return fused.post(*args, self.kernels, out, h_res_transposed=self.h_res_transposed,
                              grad_owned=grad_owned, arithmetic=self.arithmetic), None
        return fused.post_feeding(*args, next_pre, self.kernels, out, state_out,
                                  h_res_transposed=self.h_res_transposed, grad_owned=grad_owned,
                                  arithmetic=self.arithmetic)


class HyperConnection(HyperConnectionOps, nn.Module):
    """The mHC mappings around one sublayer F: ``x' = H_res x + H_post^T F(H_pre x)``, with
    their parameters."""

    def __init__(self, hidden_size: int, num_streams: int = 4, sinkhorn_iterations: int = 20,
                 init_gating_factor: float = 0.01, kernels: str = "auto",
                 h_res_transposed: bool = False, arithmetic: str = "main"):
        super().__init__()
        _check_arithmetic(arithmetic)
        if hidden_size < 1 or num_streams < 1:
            raise ValueError(f"HyperConnection: hidden_size and num_streams must be >= 1, "
                             f"got {hidden_size} and {num_streams}")
        self.hidden_size = hidden_size
        self.num_streams = n = num_streams
        self.sinkhorn_iterations = sinkhorn_iterations
        self.kernels = kernels  # mhc_cg.ops.kernels: "auto" | "torch" | "triton"
        self.h_res_transposed = bool(h_res_transposed)  # see the module docstring
        self.arithmetic = arithmetic  # see the module docstring
        self.mapping_proj = nn.Linear(n * hidden_size, n * n + 2 * n, bias=False)
        self.alpha_pre = nn.Parameter(torch.full((1,), float(init_gating_factor)))
        self.alpha_post = nn.Parameter(torch.full((1,), float(init_gating_factor)))
        self.alpha_res = nn.Parameter(torch.full((1,), float(init_gating_factor)))
        self.bias = nn.Parameter(torch.zeros(n * n + 2 * n))


class KernelsOver(HyperConnectionOps):
    """mhc_cg's mHC ops on the parameters of another hyper-connection module (Megatron-LM's
    ``HyperConnectionModule``, main's or dev's: the same parameter names), read from it at every
    call, so its optimizer, checkpoint and device moves stay the module's own."""

    def __init__(self, module: nn.Module, hidden_size: int, num_streams: int,
                 sinkhorn_iterations: int, kernels: str = "auto", h_res_transposed: bool = False,
                 arithmetic: str = "main"):
        _check_arithmetic(arithmetic)
        self.module = module
        self.hidden_size, self.num_streams = hidden_size, num_streams
        self.sinkhorn_iterations, self.kernels = sinkhorn_iterations, kernels
        self.h_res_transposed, self.arithmetic = bool(h_res_transposed), arithmetic

    mapping_proj = property(lambda self: self.module.mapping_proj)
    alpha_pre = property(lambda self: self.module.alpha_pre)
    alpha_post = property(lambda self: self.module.alpha_post)
    alpha_res = property(lambda self: self.module.alpha_res)
    bias = property(lambda self: self.module.bias)


def _check_arithmetic(arithmetic: str) -> None:
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"HyperConnection: arithmetic must be one of {list(ARITHMETICS)}, "
                         f"got {arithmetic!r}")


def _check_mapping(name: str, h: Tensor, lead: torch.Size, tail: tuple[int, ...]) -> None:
    expected = (*lead, *tail)
    if tuple(h.shape) != expected:
        raise ValueError(f"{name}: expected mapping of shape {list(expected)}, got {list(h.shape)}")
