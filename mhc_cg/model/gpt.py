"""A tiny GPT whose residual stream is widened n-fold by mHC.

Every sublayer (attention, MLP) is the same sequence of named steps, so that the recompute
runtimes can checkpoint, discard and replay them one by one::

    h_pre, h_post, h_res = mappings(x)        # [s,b,n], [s,b,n], [s,b,n,n]
    agg    = aggregate(x, h_pre)               # [s,b,C]
    normed = norm(agg)                         # [s,b,C]
    y      = fn(normed)                        # [s,b,C]   F: attention or MLP (never recomputed)
    mixed  = h_res_step(h_res, x)              # [s,b,n*C]
    out    = post_bda(y, h_post, mixed, seed)  # [s,b,n*C] = mixed + dropout(h_post * y)

``mappings``, ``aggregate``, ``h_res_step`` and ``post_bda`` are one fused op each, forward and
backward (``mhc_cg.ops.kernels``; ``model.kernels`` picks Triton or the torch reference).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhc_cg.core.errors import ConfigError
from mhc_cg.ops.hyper_connection import HyperConnection, contract_streams, expand_streams
from mhc_cg.ops import kernels as fused
from mhc_cg.ops.kernels import KERNELS, kernels_problem
from mhc_cg.tools.memory.analytical import paper_block_size

RECOMPUTE_MODES = ("none", "block")
DROPOUT_IMPLS = ("counter", "torch")


@dataclass
class MHCGPTConfig:
    vocab_size: int = 64
    seq_length: int = 32
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 4
    num_streams: int = 4
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    hidden_dropout: float = 0.1
    dropout_impl: str = "counter"  # "counter": graph-replayable; "torch": stateful generator
    sinkhorn_iterations: int = 20
    init_gating_factor: float = 0.01
    init_std: float = 0.02
    recompute: str = "none"  # "none" | "block"
    recompute_layers: int | None = None  # L_r; None: the paper's sqrt(n*L/(n+2))
    num_experts: int | None = None  # None: dense MLP; else a top-k routed MoE MLP
    moe_top_k: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    recompute_activation: bool = False  # drop the MLP's gelu output, recompute it
    recompute_activation_layers: int | None = None  # the first N layers do it; None: all
    kernels: str = "auto"  # fused mHC ops: "auto" (triton on CUDA, torch on CPU) | "torch" | "triton"

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        problems = []
        for name in ("vocab_size", "seq_length", "hidden_size", "num_heads", "num_layers",
                     "num_streams", "ffn_hidden_size", "sinkhorn_iterations"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"model.{name}: must be a positive integer, got {value!r}")
        if not problems and self.hidden_size % self.num_heads:
            problems.append(f"model.num_heads: must divide hidden_size={self.hidden_size}, "
                            f"got {self.num_heads}")
        if not (isinstance(self.hidden_dropout, (int, float)) and 0.0 <= self.hidden_dropout < 1.0):
            problems.append(f"model.hidden_dropout: must be in [0, 1), got {self.hidden_dropout!r}")
        if self.dropout_impl not in DROPOUT_IMPLS:
            problems.append(f"model.dropout_impl: must be one of {list(DROPOUT_IMPLS)}, "
                            f"got {self.dropout_impl!r}")
        if self.kernels not in KERNELS:
            problems.append(f"model.kernels: must be one of {list(KERNELS)}, got {self.kernels!r}")
        elif (problem := kernels_problem(self.kernels, torch.cuda.is_available())) is not None:
            problems.append(problem)
        if self.recompute not in RECOMPUTE_MODES:
            problems.append(f"model.recompute: must be one of {list(RECOMPUTE_MODES)}, "
                            f"got {self.recompute!r}")
        if self.recompute_layers is not None and not (
                isinstance(self.recompute_layers, int) and 1 <= self.recompute_layers):
            problems.append(f"model.recompute_layers: must be a positive integer or null, "
                            f"got {self.recompute_layers!r}")
        if self.num_experts is not None and not (
                isinstance(self.num_experts, int) and self.num_experts >= 1
                and isinstance(self.moe_top_k, int) and 1 <= self.moe_top_k <= self.num_experts):
            problems.append(f"model.moe_top_k: must be in [1, num_experts={self.num_experts}], "
                            f"got {self.moe_top_k!r}")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        elif not (isinstance(self.moe_ffn_hidden_size, int)
                  and not isinstance(self.moe_ffn_hidden_size, bool)
                  and self.moe_ffn_hidden_size >= 1):
            problems.append(f"model.moe_ffn_hidden_size: must be a positive integer or null "
                            f"(null: ffn_hidden_size), got {self.moe_ffn_hidden_size!r}")
        if not problems:
            from mhc_cg.config.rules import activation_recompute_problems  # validate imports this module

            problems.extend(activation_recompute_problems(self))
        if problems:
            raise ConfigError(problems)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def resolved_recompute_layers(self) -> int:
        """L_r: the configured block size, or the paper's optimum sqrt(n*L/(n+2)), within [1, L]."""
        if self.recompute_layers is not None:
            return min(self.recompute_layers, self.num_layers)
        return paper_block_size(self.num_streams, self.num_layers)

    def recomputes_activation(self, layer_number: int) -> bool:
        """Whether layer ``layer_number`` (0-based, of the whole model) recomputes its gelu."""
        if not self.recompute_activation:
            return False
        return self.recompute_activation_layers is None or layer_number < self.recompute_activation_layers

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x**2) + eps) * weight``, one fused op (``mhc_cg.ops.kernels.rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return fused.rms_norm(x, self.weight, self.eps, self.kernels)


class CausalSelfAttention(nn.Module):
    """``[s, b, C] -> [s, b, C]``."""

    def __init__(self, cfg: MHCGPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        s, b, c = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.num_heads, c // self.num_heads).permute(2, 1, 3, 0, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, s, d]
        return self.proj(out.permute(2, 0, 1, 3).reshape(s, b, c))


class MLP(nn.Module):
    """``[s, b, C] -> [s, b, C]``: fc1 -> gelu -> fc2.

    With ``recompute_activation`` the gelu output, ``ffn`` per token and the largest
    tensor of the MLP, is not kept: fc2's backward needs it before gelu's backward runs, so a
    recompute bound to gelu's own backward would come too late. Instead the gelu runs in a
    ``CheckpointWithoutOutput`` (which keeps only fc1's output, as gelu itself would), its output
    is freed once fc2 has saved it, and a hook on fc2's output gradient recomputes it into the same
    storage before fc2's backward reads it. The static-buffer runtime does not call this forward
    for such an MLP (``StaticRecompute.mlp_with_activation_recompute``): it keeps the gelu output
    in an arena slot instead, since freeing a storage is illegal under graph capture.
    """

    def __init__(self, cfg: MHCGPTConfig, ffn_hidden_size: int | None = None,
                 recompute_activation: bool = False):
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or cfg.ffn_hidden_size
        self.fc1 = nn.Linear(cfg.hidden_size, ffn_hidden_size)
        self.fc2 = nn.Linear(ffn_hidden_size, cfg.hidden_size)
        self.recompute_activation = recompute_activation
        self.activation_checkpoint = None  # the last forward's gelu checkpoint (memory reports)

    def forward(self, x: Tensor) -> Tensor:
        if not (self.recompute_activation and torch.is_grad_enabled()):
            return self.fc2(F.gelu(self.fc1(x)))
        from mhc_cg.runtime.recompute.checkpoint import CheckpointWithoutOutput

        ckpt = CheckpointWithoutOutput(name="mlp/gelu")
        act = ckpt.checkpoint(F.gelu, self.fc1(x))
        out = self.fc2(act)
        if out.requires_grad:  # otherwise no backward will ever need act
            ckpt.discard_output_and_register_recompute(out)
        self.activation_checkpoint = ckpt
        return out


class MoEDispatchState:
    """What the preprocess step hands to dispatch; the names are the graph outputs that Megatron's
    partial-capture signal collects (``cudagraph_attrs``) when capture ends after preprocess."""

    cudagraph_attrs = ["tokens_per_expert", "token_order"]

    def __init__(self):
        self.tokens_per_expert: Tensor | None = None  # [E] int64, on device
        self.token_order: Tensor | None = None  # [E, T] int64: per expert, its tokens first
        self.valid_cudagraph_attrs: list[str] | None = None


class MoEMLP(nn.Module):
    """A small top-k routed MoE MLP, ``[s, b, C] -> [s, b, C]``, in three steps:

    * ``route``: router logits, softmax, top-k -> dense ``probs [T, E]`` and ``routing_map [T, E]``;
    * ``preprocess``: per-expert token counts and order, on device, static shapes;
    * ``dispatch``: each expert runs on its tokens (data-dependent shapes: never graph-capturable).

    ``partial_capture`` (``None``, ``"route"`` or ``"preprocess"``) makes the forward stop after
    that step by raising megatron-core's ``MoECudaGraphPartialCaptureSignal``; it is set only while
    a graph is being captured. ``forward(x, store)`` with a filled ``MoECudaGraphTensorStore``
    resumes after the captured steps from the replayed graph's outputs.
    """

    def __init__(self, cfg: MHCGPTConfig):
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg, ffn_hidden_size=cfg.moe_ffn_hidden_size) for _ in range(cfg.num_experts))
        self.token_dispatcher = MoEDispatchState()
        self.partial_capture: str | None = None

    def route(self, x2d: Tensor) -> tuple[Tensor, Tensor]:
        scores = torch.softmax(self.router(x2d).float(), dim=-1)
        top_p, top_i = scores.topk(self.top_k, dim=-1)
        probs = torch.zeros_like(scores).scatter(1, top_i, top_p / top_p.sum(-1, keepdim=True))
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_i, True)
        return probs.to(x2d.dtype), routing_map

    def preprocess(self, routing_map: Tensor) -> None:
        state = self.token_dispatcher
        state.tokens_per_expert = routing_map.sum(0)
        state.token_order = torch.argsort(routing_map.t().to(torch.int8), dim=1, descending=True,
                                          stable=True)

    def dispatch(self, x2d: Tensor, probs: Tensor) -> Tensor:
        state = self.token_dispatcher
        counts = state.tokens_per_expert.tolist()  # the host sync that ends any graph capture
        out = torch.zeros_like(x2d)
        for e, expert in enumerate(self.experts):
            if counts[e]:
                idx = state.token_order[e, :counts[e]]
                out = out.index_add(0, idx, expert(x2d[idx]) * probs[idx, e:e + 1])
        return out

    def forward(self, x: Tensor, store=None) -> Tensor:
        from mhc_cg.model.moe import MoECudaGraphPartialCaptureSignal

        s, b, c = x.shape
        x2d = x.reshape(s * b, c)
        if store is not None and not store.is_empty():
            x2d, probs = store.hidden_states, store.probs
            if store.routing_map is not None:  # capture ended after route
                self.preprocess(store.routing_map)
        else:
            probs, routing_map = self.route(x2d)
            if self.partial_capture == "route":
                raise MoECudaGraphPartialCaptureSignal(self, "route", probs=probs,
                                                       routing_map=routing_map)
            self.preprocess(routing_map)
            if self.partial_capture == "preprocess":
                raise MoECudaGraphPartialCaptureSignal(self, "preprocess", hidden_states=x2d,
                                                       probs=probs)
        return self.dispatch(x2d, probs).view(s, b, c)


class HyperConnectionSteps:
    """The mHC steps every sublayer adapter shares, delegated to its hyper-connection ``hc``
    (ours, or Megatron-LM main's ``HyperConnectionModule``: same method names)."""

    hc: nn.Module

    def mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.hc.compute_mappings(x)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        return self.hc.aggregate(x, h_pre)

    def h_res_step(self, h_res: Tensor, x: Tensor) -> Tensor:
        return self.hc.apply_h_res(h_res, x)


class MHCSublayer(HyperConnectionSteps, nn.Module):
    """One residual branch: mHC around F (attention or MLP), as named steps."""

    def __init__(self, cfg: MHCGPTConfig, fn: nn.Module, dropout_stream: int):
        super().__init__()
        self.cfg = cfg
        self.hc = HyperConnection(cfg.hidden_size, cfg.num_streams, cfg.sinkhorn_iterations,
                                  cfg.init_gating_factor, kernels=cfg.kernels)
        self.norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.fn = fn
        self.dropout_stream = dropout_stream  # unique per (layer, sublayer) within a microbatch

    def post_bda(self, y: Tensor, h_post: Tensor, mixed: Tensor, seed: Tensor | None) -> Tensor:
        """h_post and bias-dropout-add (F's bias is inside ``y``): ``mixed + dropout(h_post * y)``."""
        return self.hc.post_bda(y, h_post, mixed, seed, self.cfg.hidden_dropout if self.training else 0.0,
                                self.dropout_stream, self.cfg.dropout_impl)

    def forward(self, x: Tensor, seed: Tensor | None = None) -> Tensor:
        return sublayer_forward(self, x, seed)


def sublayer_forward(steps, x: Tensor, seed: Tensor | None) -> Tensor:
    """The plain mHC sublayer over named steps (an ``MHCSublayer`` or an adapter with its steps,
    e.g. ``megatron_integration.steps.SublayerSteps``)."""
    h_pre, h_post, h_res = steps.mappings(x)
    y = steps.fn(steps.norm(steps.aggregate(x, h_pre)))
    return steps.post_bda(y, h_post, steps.h_res_step(h_res, x), seed)


class MHCTransformerLayer(nn.Module):
    def __init__(self, cfg: MHCGPTConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.attention = MHCSublayer(cfg, CausalSelfAttention(cfg), dropout_stream=2 * layer_number)
        mlp = MoEMLP(cfg) if cfg.is_moe else MLP(
            cfg, recompute_activation=cfg.recomputes_activation(layer_number))
        self.mlp = MHCSublayer(cfg, mlp, dropout_stream=2 * layer_number + 1)

    def forward(self, x: Tensor, seed: Tensor | None = None) -> Tensor:
        return self.mlp(self.attention(x, seed), seed)


class MHCGPT(nn.Module):
    """``model(input_ids [b, s]) -> logits [b, s, vocab]``."""

    def __init__(self, cfg: MHCGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.layers = nn.ModuleList(MHCTransformerLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, kernels=cfg.kernels)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def new_dropout_seed(self, device: torch.device | str | None = None) -> Tensor:
        """One int64 seed per microbatch, drawn from torch's generator (the only stateful draw)."""
        return torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64).to(device or "cpu")

    def embed(self, input_ids: Tensor) -> Tensor:
        """``[b, s] -> [s, b, n*C]``."""
        if input_ids.dim() != 2:
            raise ValueError(f"MHCGPT: expected input_ids of shape [b, s], got {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if s > self.cfg.seq_length:
            raise ValueError(f"MHCGPT: sequence length {s} exceeds seq_length={self.cfg.seq_length}")
        pos = torch.arange(s, device=input_ids.device)
        h = (self.embedding(input_ids) + self.position(pos)).transpose(0, 1)
        return expand_streams(h, self.cfg.num_streams)

    def run_layers(self, x: Tensor, seed: Tensor | None) -> Tensor:
        if self.cfg.recompute == "block" and self.training and torch.is_grad_enabled():
            return self._run_layers_block_recompute(x, seed)
        for layer in self.layers:
            x = layer(x, seed)
        return x

    def _run_layers_block_recompute(self, x: Tensor, seed: Tensor | None) -> Tensor:
        """Eager block recompute; ``self.recompute_managers`` holds this forward's managers."""
        from mhc_cg.runtime.recompute.eager import run_recompute_blocks

        self.recompute_managers = []
        return run_recompute_blocks(self.layers, x, seed, self.cfg.resolved_recompute_layers,
                                    self.recompute_managers)

    def logits(self, x: Tensor) -> Tensor:
        """``[s, b, n*C] -> [b, s, vocab]``."""
        h = self.final_norm(contract_streams(x, self.cfg.num_streams))
        return self.head(h).transpose(0, 1)

    def forward(self, input_ids: Tensor, dropout_seed: Tensor | None = None) -> Tensor:
        if dropout_seed is None and self.training and self.cfg.hidden_dropout > 0:
            dropout_seed = self.new_dropout_seed(input_ids.device)
        return self.logits(self.run_layers(self.embed(input_ids), dropout_seed))


def recomputes_activation(sub: MHCSublayer) -> bool:
    """Whether ``sub`` is a dense MLP sublayer whose gelu output is recomputed."""
    return isinstance(sub.fn, MLP) and sub.fn.recompute_activation
