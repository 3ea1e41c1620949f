"""The fused ops' Triton kernels compiled ahead of time for a GPU this machine need not have.

Each case calls one real launcher of ``mhc_cg.ops.kernels.triton_kernels`` on ``meta`` tensors of
a model shape, while Triton's active driver is a stand-in that reports the target GPU and every
launch is turned into a warm-up: Triton chooses block sizes, grid and specialization exactly as it
would on the GPU, compiles down to a cubin, and launches nothing (meta tensors cost no memory).
``cuobjdump --dump-resource-usage`` then reads each cubin's registers, stack, local and shared
memory. A kernel spills when it needs local memory or a stack frame.

To cover a new launcher, add one ``Case`` to ``CASES``::

    Case("fused_pre", lambda k, s: k.fused_pre(s.t(s.T, s.n * s.C), s.t(s.T, s.M), s.n)),

``k`` is the Triton kernel module, ``s`` the ``Shape`` (``s.t(*dims)``: a meta tensor of the
shape's dtype; ``s.T`` tokens, ``s.n`` streams, ``s.C`` hidden, ``s.M = n*n + 2n``, ``s.seed``,
``s.sqrt_d``, ``s.iterations``, ``s.dropout``). Every kernel the call launches is reported under
the case's name; a ``[variant]`` suffix names a second call of the same launcher that Triton
compiles differently (an integer argument equal to 1, or divisible by 16, or another constexpr).

Triton decides when ``triton`` is first imported whether kernels are compiled or interpreted: a
process with ``TRITON_INTERPRET=1`` (the test suite) compiles in a child process without it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.core.errors import ConfigError
from mhc_cg.lab.cost.gpus import DEFAULT_GPU, GPUS
from mhc_cg.core.progress import ProgressBar
from mhc_cg.ops.kernels.dispatch import interpret_requested, triton_kernels
from mhc_cg.ops.kernels.tiling import MIN_PROGRAMS

DEFAULT_TARGET = "sm_90a"
DEFAULT_HIDDEN = (2048, 7168)
DEFAULT_TOKENS = 4096  # configs/bench_h100.yaml: seq 2048 x micro-batch 2
DEFAULT_VOCAB = 32000  # configs/bench_h100.yaml's, for the loss


@dataclass(frozen=True)
class Shape:
    """One model shape, and meta tensors of it for the launchers."""
    hidden: int
    streams: int = 4
    tokens: int = DEFAULT_TOKENS
    dtype: str = "bf16"
    iterations: int = 20
    dropout: float = 0.1
    vocab: int = DEFAULT_VOCAB

    @property
    def C(self) -> int:
        return self.hidden

    @property
    def n(self) -> int:
        return self.streams

    @property
    def T(self) -> int:
        return self.tokens

    @property
    def M(self) -> int:
        return self.n * self.n + 2 * self.n

    @property
    def sqrt_d(self) -> float:
        return math.sqrt(self.n * self.C)

    @property
    def seed(self) -> torch.Tensor:
        return torch.empty((), dtype=torch.int64, device="meta")

    def t(self, *dims: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(*dims, dtype=dtype or TORCH_DTYPES[self.dtype], device="meta")


@dataclass(frozen=True)
class Case:
    """A launcher and how to call it at a shape: ``call(kernel_module, shape)``."""
    name: str
    call: Callable

    @property
    def launcher(self) -> str:
        return self.name.split("[")[0]


def _alphas(s: Shape) -> tuple:
    return s.t(1), s.t(1), s.t(1)


# Megatron-LM dev's layer: dev's (DeepSeek-V4's) arithmetic, H_res applied transposed
DEV = {"arithmetic": "dev", "h_res_transposed": True}


def _pre(k, s: Shape, norm: bool = True, weight_dtype: torch.dtype | None = None,
         arithmetic: str = "main"):
    return k.pre(s.t(s.T, s.n * s.C), s.t(s.M, s.n * s.C, dtype=weight_dtype), *_alphas(s),
                 s.t(s.M), s.t(s.C) if norm else None, s.n, s.iterations, 1e-5,
                 arithmetic=arithmetic)


def _pre_backward(k, s: Shape, in_place: bool = False, norm: bool = True, fused: bool = False,
                  weight_dtype: torch.dtype | None = None, **variant):
    g_post = s.t(s.T, s.n * s.C)
    # fused: with its post's reductions and the previous post's F output gradient, as the model
    # runs it inside a chain of sublayers, where the state's one consumer is that post
    seed = s.seed
    g_state = None if fused else s.t(s.T, s.M + 2, dtype=torch.float32)
    around = dict(post=(s.t(s.T, s.C), seed, s.dropout, 3),
                  prev=(s.t(s.T, s.M + 2, dtype=torch.float32), s.t(1), s.t(s.M), seed,
                        s.dropout, 2), g_y_out=s.t(s.T, s.C)) if fused else {}
    return k.pre_backward(s.t(s.T, s.C), g_state, g_post,
                          s.t(s.T, s.n * s.C), s.t(s.M, s.n * s.C, dtype=weight_dtype),
                          *_alphas(s), s.t(s.M),
                          s.t(s.C) if norm else None, s.t(s.T, s.M + 2, dtype=torch.float32), s.n,
                          s.iterations, 1e-5, g_post if in_place else None, **around, **variant)


@contextlib.contextmanager
def _launch_row(kernel: str, s: Shape, **config):
    """Within: the launchers read ``config`` for ``kernel`` at this shape from a table of its own
    (as a sweep's configuration is read), on the ``meta`` device the cases launch on."""
    from mhc_cg.ops.kernels.launch import ENV

    with tempfile.TemporaryDirectory() as folder:
        table = Path(folder) / "launch_configs.json"
        table.write_text(json.dumps({"rows": [{"device": "meta", "hidden": s.C, "kernel": kernel,
                                               "config": config}]}))
        previous = os.environ.get(ENV)
        os.environ[ENV] = str(table)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous


def _with_row(kernel: str, call: Callable, **config) -> Callable:
    def run(k, s: Shape):
        with _launch_row(kernel, s, **config):
            return call(k, s)
    return run


def _maps(s: Shape, posts: int = 1) -> torch.Tensor:
    return s.t(posts, s.T, s.n + s.n * s.n, dtype=torch.float32)


def _post_maps(k, s: Shape, posts: int = 1, arithmetic: str = "main"):
    params = s.t(posts, s.M + 3)  # the recompute's layout: strided views of one block
    return k.post_maps(s.t(posts, s.T, s.M + 2, dtype=torch.float32), params[:, :s.M],
                       params[:, s.M + 1], params[:, s.M + 2], s.n * s.C, s.n, s.iterations,
                       arithmetic=arithmetic)


def _post(k, s: Shape, stream: int, dropout: bool = True):
    return k.post(s.t(s.T, s.n * s.C), s.t(s.T, s.M + 2, dtype=torch.float32), *_alphas(s),
                  s.t(s.M), s.t(s.T, s.C), s.seed if dropout else None,
                  s.dropout if dropout else 0.0, stream, s.n, s.iterations, maps=_maps(s)[0])


def _post_state(k, s: Shape, stream: int, dropout: bool = True, **variant):
    return k.post_state(s.t(s.T, s.n * s.C), _maps(s)[0], s.t(s.T, s.C),
                        s.seed if dropout else None, s.dropout if dropout else 0.0, stream, s.n,
                        s.t(s.M, s.n * s.C), s.t(1), s.t(s.M), True, 1e-5, **variant)


def _post_backward(k, s: Shape, stream: int, dropout: bool = True, **variant):
    return k.post_backward(s.t(s.T, s.n * s.C), s.t(s.T, s.n * s.C),
                           s.t(s.T, s.M + 2, dtype=torch.float32), *_alphas(s), s.t(s.M),
                           s.t(s.T, s.C), s.seed if dropout else None,
                           s.dropout if dropout else 0.0, stream, s.n, s.iterations, **variant)


def _recompute(k, s: Shape, steps: int = 4, dropout: bool = True, **variant):
    # a block of `steps` sublayers, its streams evenly spaced as the model numbers them
    return k.recompute(s.t(s.T, s.n * s.C), s.t(steps, s.T, s.C),
                       s.t(steps, s.T, s.M + 2, dtype=torch.float32), s.t(steps, s.M + 3),
                       s.t(steps, s.C), s.seed if dropout else None, s.dropout if dropout else 0.0,
                       list(range(2, 2 + steps)), s.n, s.iterations, 1e-5,
                       s.t(steps - 1, s.T, s.n * s.C), s.t(steps, s.T, s.C),
                       maps=_maps(s, steps - 1), **variant)


# The arguments are those the model passes: parameters in the shape's dtype, dropout on in
# training and off in evaluation, stream = 2 * layer + sublayer (Triton specializes an integer
# equal to 1 or divisible by 16, so streams 0, 1 and 2 are three compiles of one kernel).
CASES = (
    Case("pre", lambda k, s: _pre(k, s)),
    Case("pre[no norm]", lambda k, s: _pre(k, s, norm=False)),
    Case("pre_backward", lambda k, s: _pre_backward(k, s)),
    Case("pre_backward[in place]", lambda k, s: _pre_backward(k, s, in_place=True)),
    Case("pre_backward[no norm]", lambda k, s: _pre_backward(k, s, norm=False)),
    Case("pre_backward[fused]", lambda k, s: _pre_backward(k, s, in_place=True, fused=True)),
    # DeepSeek's recipe: the mapping parameters in fp32 beside bf16 activations
    Case("pre[fp32 weight]", lambda k, s: _pre(k, s, weight_dtype=torch.float32)),
    Case("pre_backward[fp32 weight]",
         lambda k, s: _pre_backward(k, s, weight_dtype=torch.float32)),
    # programmatic dependent launch, a sweep option (Note [programmatic dependent launch])
    Case("pre[pdl]", _with_row("state", lambda k, s: _pre(k, s), pdl=True)),
    Case("fn_input[pdl]", _with_row("chain", lambda k, s: k.fn_input(
        s.t(s.T, s.n * s.C), s.t(s.T, s.M + 2, dtype=torch.float32), *_alphas(s), s.t(s.M),
        s.t(s.C), s.n), pdl=True)),
    Case("post_maps", lambda k, s: _post_maps(k, s)),
    Case("post_maps[block]", lambda k, s: _post_maps(k, s, posts=3)),
    Case("post", lambda k, s: _post(k, s, 2)),
    Case("post[stream 0]", lambda k, s: _post(k, s, 0)),
    Case("post[stream 1]", lambda k, s: _post(k, s, 1)),
    Case("post[no dropout]", lambda k, s: _post(k, s, 2, dropout=False)),
    Case("post_state", lambda k, s: _post_state(k, s, 2)),
    Case("post_state[stream 1]", lambda k, s: _post_state(k, s, 1)),
    Case("post_state[no dropout]", lambda k, s: _post_state(k, s, 2, dropout=False)),
    Case("fn_input", lambda k, s: k.fn_input(s.t(s.T, s.n * s.C),
                                             s.t(s.T, s.M + 2, dtype=torch.float32), *_alphas(s),
                                             s.t(s.M), s.t(s.C), s.n)),
    Case("post_backward", lambda k, s: _post_backward(k, s, 2)),
    Case("post_backward[stream 0]", lambda k, s: _post_backward(k, s, 0)),
    Case("post_backward[stream 1]", lambda k, s: _post_backward(k, s, 1)),
    Case("post_backward[no dropout]", lambda k, s: _post_backward(k, s, 2, dropout=False)),
    Case("post_grad_y", lambda k, s: k.post_grad_y(s.t(s.T, s.n * s.C),
                                                   s.t(s.T, s.M + 2, dtype=torch.float32),
                                                   s.t(1), s.t(s.M), s.seed, s.dropout, 2, s.n,
                                                   torch.bfloat16)),
    Case("recompute", lambda k, s: _recompute(k, s)),
    Case("recompute[no dropout]", lambda k, s: _recompute(k, s, dropout=False)),
    # Megatron-LM dev's layer (use_fused_mhc): every kernel dev's arithmetic compiles otherwise
    Case("pre[dev]", lambda k, s: _pre(k, s, arithmetic="dev")),
    Case("pre_backward[dev fused]",
         lambda k, s: _pre_backward(k, s, in_place=True, fused=True, **DEV)),
    Case("post_maps[dev]", lambda k, s: _post_maps(k, s, arithmetic="dev")),
    Case("post_state[dev]", lambda k, s: _post_state(k, s, 2, **DEV)),
    Case("post_backward[dev]", lambda k, s: _post_backward(k, s, 2, **DEV)),
    Case("recompute[dev]", lambda k, s: _recompute(k, s, **DEV)),
    Case("rms_norm", lambda k, s: k.rms_norm(s.t(s.T, s.C), s.t(s.C), 1e-5)),
    Case("rms_norm_backward", lambda k, s: k.rms_norm_backward(s.t(s.T, s.C), s.t(s.T, s.C),
                                                                s.t(s.C), 1e-5)),
    Case("cross_entropy", lambda k, s: k.cross_entropy(s.t(s.T, s.vocab),
                                                        s.t(s.T, dtype=torch.int64))),
    Case("cross_entropy_backward", lambda k, s: k.cross_entropy_backward(
        s.t(s.T, dtype=torch.float32), s.t(s.T, s.vocab), s.t(s.T, dtype=torch.int64),
        s.t(s.T, dtype=torch.float32))),
)


@dataclass
class KernelUsage:
    """One compiled kernel: what launched it, and the resources its cubin declares."""
    case: str
    kernel: str
    grid: list = field(default_factory=list)
    programs: int | None = None  # the grid's size (None where Triton reports no sizes)
    num_warps: int = 0
    registers: int = 0
    stack: int = 0
    local: int = 0
    shared: int = 0          # static shared memory in the cubin (cuobjdump SHARED)
    dynamic_shared: int = 0  # shared memory Triton requests at launch
    spilled: bool = False
    resident_warps: int = 0  # warps per SM, under every limit below (SM) and the grid's size
    warp_limit: str = ""     # the limit that binds: registers, shared, warps, blocks or grid
    loads: str = ""          # the HBM loads one step keeps outstanding (see STREAM_LOADS)
    load_bytes: float | None = None  # per thread and step, times the steps a pipelined load runs ahead
    in_flight: float | None = None   # bytes per SM: resident warps x 32 threads x load_bytes
    bandwidth_share: float | None = None  # in_flight / SMLimits.bytes_in_flight(); < 1: cannot reach it
    tensor_cores: bool = False  # its PTX multiplies on tensor cores (mma / wgmma)
    pdl: bool = False  # launched with programmatic dependent launch (waits in its PTX)
    # the projection's mapping-weight bytes per byte of x it reads (each program reads the
    # weight's m rows over its features once, for its tokens); None for other kernels
    weight_per_x: float | None = None


# ---- targets ------------------------------------------------------------------------------------

def _target_name(capability: int) -> str:
    return f"sm_{capability}{'a' if capability >= 90 else ''}"  # Triton's own spelling


# Capabilities this Triton's LLVM and bundled ptxas compile for (others abort inside LLVM).
TARGETS = tuple(_target_name(c) for c in (75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121))


def parse_target(name: str) -> int:
    """``sm_90a`` -> 90."""
    if name in TARGETS:
        return int(name[3:].rstrip("a"))
    match = re.fullmatch(r"sm_(\d+)a?", str(name))
    hint = ""
    if match and _target_name(int(match.group(1))) in TARGETS:
        hint = f" (Triton compiles capability {match.group(1)} as {_target_name(int(match.group(1)))})"
    raise ConfigError(f"--target: {name!r} is not a target Triton compiles for{hint}; "
                      f"use one of {', '.join(TARGETS)}")


# ---- resource usage -------------------------------------------------------------------------------

def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump --dump-resource-usage`` output -> {function: {"REG": .., "STACK": .., ...}}."""
    usage, function = {}, None
    for line in text.splitlines():
        header = re.match(r"\s*Function (\S+?):\s*$", line)
        if header:
            function = header.group(1)
        elif function and "REG:" in line:
            usage[function] = {key: int(value) for key, value in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", line)}
            function = None
    return usage


def cubin_resources(cubin: bytes) -> dict[str, dict[str, int]]:
    from triton import knobs

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                             check=True, capture_output=True, text=True).stdout
    return parse_resource_usage(out)


def _resources(kernel) -> dict:
    """A compiled kernel's registers, stack, local and shared memory, and whether it spills (local
    memory or a stack frame in any function of its cubin)."""
    functions = cubin_resources(kernel.asm["cubin"])
    own = functions.get(kernel.name) or next(iter(functions.values()))
    return dict(num_warps=kernel.metadata.num_warps, registers=own["REG"], stack=own["STACK"],
                local=own["LOCAL"], shared=own["SHARED"], dynamic_shared=kernel.metadata.shared,
                spilled=any(f["LOCAL"] > 0 or f["STACK"] > 0 for f in functions.values()))


def uses_tensor_cores(ptx: str) -> bool:
    """Whether PTX multiplies on tensor cores: an ``mma`` or ``wgmma`` instruction (fp32 FMA
    loops have neither)."""
    return re.search(r"^\s*(wgmma|mma)\.", ptx, re.MULTILINE) is not None


def projection_weight_per_x(kernel: str, bound: dict) -> float | None:
    """The state's first stage reads the mapping weight's ``m`` rows (masked loads fetch no
    padding) over its features once per program of ``BT`` tokens, which read ``BT`` tokens of
    x over the same features: weight bytes per byte of x ``m * size(w) / (BT * size(x))``."""
    if not kernel.startswith("_state_part"):
        return None
    n = int(bound["N"])
    return ((n * n + 2 * n) * bound["w_ptr"].element_size()
            / (int(bound["BT"]) * bound["x_ptr"].element_size()))


# ---- can a kernel keep HBM busy: warps per SM and bytes in flight (Little's law) -----------------

@dataclass(frozen=True)
class SMLimits:
    """One GPU's per-SM limits and its memory's bandwidth-latency product. Assumed, not measured:
    compute capability 9.0 as NVIDIA's Hopper tuning guide and the CUDA programming guide's table
    give it (64K 32-bit registers, 228 KiB shared memory of which a block may take 227 KiB and
    1 KiB is reserved per block, 64 warps and 32 blocks), registers allocated per warp in units
    of 256 with warps in groups of 4 (CUDA occupancy calculator, 9.0); the SMs and the HBM
    bandwidth are the GPU's (:func:`sm_limits`, ``mhc_cg.lab.cost.gpus``), and 700 ns a loaded DRAM
    latency inside the 600 to 800 ns that microbenchmarks of Hopper report."""
    name: str = "NVIDIA H100 SXM5 80GB"
    sms: int = 132
    registers: int = 65536
    register_unit: int = 256
    warp_granularity: int = 4
    shared: int = 228 * 1024
    shared_per_block: int = 227 * 1024
    shared_reserved: int = 1024
    warps: int = 64
    blocks: int = 32
    bandwidth: float = 3.35e12  # bytes/s, the HBM peak
    latency: float = 700e-9     # s

    def bytes_in_flight(self) -> float:
        """Bytes each SM must keep outstanding to hold the bandwidth (Little's law)."""
        return self.bandwidth * self.latency / self.sms


def sm_limits(gpu: str = DEFAULT_GPU) -> SMLimits:
    """The limits of a GPU of ``mhc_cg.lab.cost.gpus`` (every one of them compute capability 9.0)."""
    row = GPUS[gpu]
    return SMLimits(name=row.name, sms=row.sms, bandwidth=row.hbm_bytes_per_s.value)


H100 = sm_limits("h100")


def resident_warps(registers: int, num_warps: int, shared: int, programs: int | None = None,
                   sm: SMLimits = H100) -> tuple[int, str]:
    """Warps per SM a kernel keeps resident, and the limit that binds first: ``shared`` is the
    block's static plus dynamic shared memory; ``programs`` (the grid), when given, caps the blocks
    per SM at an even share of them."""
    per_warp = -(-registers * 32 // sm.register_unit) * sm.register_unit
    by_registers = sm.registers // per_warp // sm.warp_granularity * sm.warp_granularity
    block_shared = shared + sm.shared_reserved
    limits = {"registers": by_registers // num_warps,
              "shared": sm.shared // block_shared if shared <= sm.shared_per_block else 0,
              "warps": sm.warps // num_warps,
              "blocks": sm.blocks}
    if programs is not None:
        limits["grid"] = -(-programs // sm.sms)
    binding = min(limits, key=limits.get)  # the first of equals, in the order above
    return limits[binding] * num_warps, binding


def in_flight(warps: int, load_bytes: float, sm: SMLimits = H100) -> tuple[float, float]:
    """Bytes per SM outstanding when ``warps`` warps each have ``load_bytes`` per thread in flight,
    and their share of the bandwidth-latency product: below 1 the SM cannot reach the bandwidth."""
    flight = warps * 32 * load_bytes
    return flight, flight / sm.bytes_in_flight()


def tile(name: str, bound: dict, pointer: str, *dims: str | int) -> tuple[str, int, int]:
    sizes = [d if isinstance(d, int) else int(bound[d]) for d in dims]
    return f"{name}[{'x'.join(map(str, sizes))}]", math.prod(sizes), bound[pointer].element_size()


# Per kernel: the loads of one step of its streaming loop from tensors that scale with tokens x
# hidden (read from HBM once). Weights, the per-token state and the mask's seed are left out: they
# are small and served from L2. Every load of a step counts as outstanding at once (the most the
# step could have in flight), and a ``pipelined`` load (a tl.dot operand that ptxas receives as
# cp.async copies, num_stages deep) counts num_stages - 1 steps. A kernel that loads its tiles
# ``steps`` steps ahead into registers itself (:func:`ahead`) has that many steps outstanding.
def ahead(steps: int, loads: list[tuple[str, int, int, bool]]) -> list[tuple[str, int, int, bool]]:
    return [(f"{name} x{steps} ahead", n * steps, size, piped) for name, n, size, piped in loads]


STREAM_LOADS: dict[str, Callable[[dict], list[tuple[str, int, int, bool]]]] = {
    # with POST (a post writing the next pre's state) x and y feed the post, not the tl.dot, yet
    # they are still staged through shared memory num_stages deep: the launch's dynamic shared
    # memory grows by y's tile and the mappings' per stage (37888 -> 47896 B at C 2048)
    "_state_part": lambda b: [(*tile("x", b, "x_ptr", "BT", "N", "BC"), True)]
    + ([(*tile("y", b, "y_ptr", "BT", "BC"), True)] if b["POST"] else []),
    # the state's second stage streams each split's fp32 rows of its tokens
    "_state_sum": lambda b: [(f"part[{b['BT']}x{int(b['MP']) + int(b['NP']) ** 2}]",
                              int(b["BT"]) * (int(b["MP"]) + int(b["NP"]) ** 2), 4, False)],
    # the post's mappings stream per-token states alone: their tile is all a step loads
    "_post_maps": lambda b: [(f"state[{b['BT']}x{b['N'] * b['N'] + 2 * b['N'] + 2}]",
                              int(b["BT"]) * (b["N"] * b["N"] + 2 * b["N"] + 2), 4, False)],
    "_chain": lambda b: [(*tile("x", b, "x_ptr", "BT", "N", "BC"), False)]
    + ([(*tile("y", b, "y_ptr", "BT", "BC"), False)] if b["posts"] > 0 else []),
    "_pre_bwd_coef": lambda b: [(*tile("x", b, "x_ptr", "BT", "N", "BC"), False),
                                (*tile("g", b, "gout_ptr", "BT", "BC"), False)]
    + ([(*tile("g_post", b, "gpost_ptr", "BT", "N", "BC"), False),
        (*tile("y", b, "y_ptr", "BT", "BC"), False)] if b["POST"] else []),
    "_pre_bwd_x": lambda b: ahead(2, [(*tile("x", b, "x_ptr", "BT", "N", "BC"), False),
                                      (*tile("g", b, "gout_ptr", "BT", "BC"), False)]
                                  + ([(*tile("g_post", b, "gpost_ptr", "BT", "N", "BC"), False)]
                                     if b["GPOST"] else [])),
    "_post_bwd": lambda b: [(*tile("g", b, "g_ptr", "BT", "N", "BC"), False)]
    + ([(*tile("x", b, "x_ptr", "BT", "N", "BC"), False),
        (*tile("y", b, "y_ptr", "BT", "BC"), False)] if b["REDUCE"] else []),
    "_rms_fwd": lambda b: [(*tile("x", b, "x_ptr", "BC"), False)],
    "_rms_bwd": lambda b: [(*tile("g", b, "g_ptr", "R", "BC"), False),
                           (*tile("x", b, "x_ptr", "R", "BC"), False)],
    "_ce_fwd": lambda b: [(*tile("logits", b, "logits_ptr", "BV"), False)],
    "_ce_bwd": lambda b: [(*tile("logits", b, "logits_ptr", "BV"), False)],
}

_DTYPE_NAMES = {1: "8-bit", 2: "16-bit", 4: "fp32", 8: "64-bit"}


def _with_in_flight(usage: KernelUsage, kernel, bound: dict, sm: SMLimits = H100) -> KernelUsage:
    """``usage`` with its resident warps, its loads in flight and their share of the bandwidth."""
    programs = math.prod(int(g) for g in usage.grid) if all(str(g).isdigit() for g in usage.grid) else None
    usage.programs = programs
    usage.resident_warps, usage.warp_limit = resident_warps(
        usage.registers, usage.num_warps, usage.shared + usage.dynamic_shared, programs, sm)
    spec = STREAM_LOADS.get(usage.kernel)
    if spec is None:
        usage.loads = "(no STREAM_LOADS entry)"
        return usage
    ahead = max(1, kernel.metadata.num_stages - 1) if "cp.async" in kernel.asm["ptx"] else 1
    loads = spec(bound)
    threads = usage.num_warps * 32
    usage.load_bytes = sum(n * size * (ahead if piped else 1) for _, n, size, piped in loads) / threads
    usage.loads = " + ".join(f"{name} {_DTYPE_NAMES.get(size, f'{size}-byte')}"
                             + (f" x{ahead} stages" if piped and ahead > 1 else "")
                             for name, _, size, piped in loads)
    usage.in_flight, usage.bandwidth_share = in_flight(usage.resident_warps, usage.load_bytes, sm)
    return usage


# ---- launches as ahead-of-time compiles ---------------------------------------------------------

def _stand_in_driver(capability: int):
    """A Triton driver for a GPU that is not here: it names the target, device 0 and stream 0."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandIn(DriverBase):
        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("nothing is launched ahead of time")

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_benchmarker(self):
            raise NotImplementedError("nothing runs ahead of time: autotuning cannot benchmark")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    return StandIn()


@contextlib.contextmanager
def compiling_launches(capability: int):
    """Within: every Triton launch compiles for ``capability`` and launches nothing; yields the list
    of ``(jit_function, grid, compiled_kernel, arguments by name)`` launched so far. Each kernel's own compile caches are
    set aside, so a later real launch in this process is not served a kernel for another GPU."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if interpret_requested():
        raise RuntimeError("Triton kernels are interpreted in this process (TRITON_INTERPRET is set): "
                           "compile in a process without it (kernel_report does)")
    launches, caches, real_run = [], {}, JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        bound = {**dict(zip(self.arg_names, args)), **kwargs}
        if id(self) not in caches:
            caches[id(self)] = (self, defaultdict(self.create_binder))  # the binder reads the target
        own, self.device_caches = self.device_caches, caches[id(self)][1]
        try:
            kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        finally:
            self.device_caches = own
        launches.append((self, grid, kernel, bound))
        return kernel

    previous = driver._active  # None until a real driver was asked for; set_active cannot restore that
    driver.set_active(_stand_in_driver(capability))
    JITFunction.run = run
    try:
        with warnings.catch_warnings():
            # fusion stays on, as on the GPU today; the warning is about a later Triton's default
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            yield launches
    finally:
        JITFunction.run = real_run
        driver._active = previous


def compile_shapes(shapes: list[Shape], target: str = DEFAULT_TARGET, cases=CASES,
                   progress: bool = False, sm: SMLimits = H100) -> list[list[KernelUsage]]:
    """Per shape, every kernel the cases launch, compiled for ``target``; a specialization that
    two shapes share is compiled and read once."""
    capability, module, read = parse_target(target), triton_kernels(), {}
    results = []
    with compiling_launches(capability) as launches:
        for shape in shapes:
            bar = ProgressBar(len(cases), f"[kernels] {target} hidden {shape.hidden}", progress)
            rows = []
            for done, case in enumerate(cases, 1):
                start = len(launches)
                try:
                    case.call(module, shape)
                except ValueError as exc:  # the launchers' refusals of a shape
                    raise ConfigError(f"--hidden {shape.hidden}: {case.name}: {exc}") from None
                for _, grid, kernel, bound in launches[start:]:
                    if kernel.hash not in read:
                        read[kernel.hash] = _resources(kernel)
                    grid = list(grid) if isinstance(grid, (tuple, list)) else [str(grid)]
                    usage = KernelUsage(case.name, kernel.name, grid, **read[kernel.hash],
                                        tensor_cores=uses_tensor_cores(kernel.asm["ptx"]),
                                        pdl=bool(getattr(kernel.metadata, "launch_pdl", False))
                                        and "griddepcontrol.wait" in kernel.asm["ptx"],
                                        weight_per_x=projection_weight_per_x(kernel.name, bound))
                    rows.append(_with_in_flight(usage, kernel, bound, sm))
                bar.update(done, case.name)
            results.append(rows)
    return results


# ---- the report, in this process or in a child that compiles --------------------------------------

def resolve_cases(spec: str) -> tuple[Case, ...]:
    """``"module:NAME"`` -> that module's tuple of cases."""
    import importlib

    module, _, name = spec.partition(":")
    return tuple(getattr(importlib.import_module(module), name or "CASES"))


def _check_sizes(hidden, tokens) -> None:
    bad = [h for h in hidden if isinstance(h, bool) or not isinstance(h, int) or h < 1]
    if bad or not hidden:
        raise ConfigError(f"--hidden: {bad[0] if bad else 'nothing'!r} is not a hidden size; "
                          "give positive integers, e.g. --hidden 2048,7168")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ConfigError(f"--tokens: {tokens!r} is not a token count; give a positive integer, "
                          f"e.g. --tokens {DEFAULT_TOKENS}")


def kernel_report(hidden=DEFAULT_HIDDEN, target: str = DEFAULT_TARGET, tokens: int = DEFAULT_TOKENS,
                  cases: str = f"{__name__}:CASES", progress: bool = False,
                  gpu: str = DEFAULT_GPU) -> dict:
    """Every case's kernels compiled for ``target`` at each hidden size: ``{"target", "shapes":
    [{shape..., "kernels": [KernelUsage as dict]}], "spilled": ["hidden H: case kernel", ...]}``.
    Runs in a child process without ``TRITON_INTERPRET`` when this process interprets Triton."""
    hidden = list(hidden)
    _check_sizes(hidden, tokens)
    parse_target(target)
    if gpu not in GPUS:
        raise ConfigError(f"--gpu: must be one of {list(GPUS)}, got {gpu!r}")
    request = {"hidden": hidden, "target": target, "tokens": tokens, "cases": cases,
               "progress": progress, "gpu": gpu}
    return _report_in_child(request) if interpret_requested() else _report(request)


def _report(request: dict) -> dict:
    shapes = [Shape(h, tokens=request["tokens"]) for h in request["hidden"]]
    sm = sm_limits(request.get("gpu", DEFAULT_GPU))
    per_shape = compile_shapes(shapes, request["target"], resolve_cases(request["cases"]),
                               request["progress"], sm)
    report = {"target": request["target"],
              "sm": {**asdict(sm), "bytes_in_flight": sm.bytes_in_flight()},
              "shapes": [], "spilled": [], "below_bandwidth": [], "few_programs": [],
              "min_programs": MIN_PROGRAMS}
    for shape, rows in zip(shapes, per_shape):
        report["shapes"].append({**asdict(shape), "kernels": [asdict(r) for r in rows]})
        report["spilled"] += [f"hidden {shape.hidden}: {r.case} ({r.kernel}): {r.local} B local, "
                              f"{r.stack} B stack" for r in rows if r.spilled]
        report["below_bandwidth"] += [
            f"hidden {shape.hidden}: {r.case} ({r.kernel}): {r.in_flight:.0f} B in flight per SM, "
            f"{r.bandwidth_share:.2f} of {sm.bytes_in_flight():.0f}" for r in rows
            if r.bandwidth_share is not None and r.bandwidth_share < 1.0]
        report["few_programs"] += [
            f"hidden {shape.hidden}: {r.case} ({r.kernel}): {r.programs} programs" for r in rows
            if is_mhc_case(r.case) and r.programs is not None and r.programs < MIN_PROGRAMS]
    return report


def is_mhc_case(case: str) -> bool:
    """A case of a fused mHC op (not the model's final norm or its loss)."""
    return not case.startswith(("rms_norm", "cross_entropy"))


def _report_in_child(request: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the child imports what this process imports (this checkout, and the cases' module)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    code = f"from {__name__} import child_main; child_main()"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(request)], env=env,
                          stdout=subprocess.PIPE, text=True)
    *printed, last = done.stdout.splitlines() or [""]
    if printed:  # what the compiler printed (a ptxas failure, say) belongs with the errors
        print("\n".join(printed), file=sys.stderr)
    try:
        answer = json.loads(last)
    except json.JSONDecodeError:
        raise RuntimeError(f"compiling the kernels in a child process failed (exit status "
                           f"{done.returncode}); its error is above") from None
    if "error" in answer:
        raise ConfigError(answer["error"])
    return answer


def child_main() -> None:
    """The child's side: the request as JSON in argv, the report (or ``{"error": [lines]}``) as
    JSON on stdout."""
    try:
        answer = _report(json.loads(sys.argv[1]))
    except ConfigError as exc:
        answer, status = {"error": exc.problems}, 2
    else:
        status = 0
    print(json.dumps(answer))  # one line, the last on stdout
    sys.exit(status)


# ---- the table ----------------------------------------------------------------------------------

_COLUMNS = (("launcher", "case", "<"), ("kernel", "kernel", "<"), ("grid", "grid", "<"),
            ("programs", "programs", ">"),
            ("warps", "num_warps", ">"), ("REG", "registers", ">"), ("STACK", "stack", ">"),
            ("LOCAL", "local", ">"), ("SHARED", "shared", ">"), ("DYN SHARED", "dynamic_shared", ">"),
            ("spills", "spilled", "<"), ("WARPS/SM", "resident_warps", ">"),
            ("limit", "warp_limit", "<"), ("B/thread", "load_bytes", ">"),
            ("in flight/SM", "in_flight", ">"), ("share", "bandwidth_share", ">"),
            ("bandwidth", "bandwidth_share", "<"), ("TC", "tensor_cores", "<"),
            ("W/x", "weight_per_x", ">"))


def _cell(key: str, value, head: str = "") -> str:
    if head == "bandwidth":
        return "?" if value is None else "CANNOT REACH" if value < 1.0 else "ok"
    if value is None:
        return "-" if key == "weight_per_x" else "?"
    if key in ("load_bytes", "in_flight"):
        return f"{value:.0f}"
    if key == "tensor_cores":
        return "mma" if value else "-"
    if key == "weight_per_x":
        return f"{value:.2f}"
    if key == "bandwidth_share":
        return f"{value:.2f}"
    if key == "grid":
        return " x ".join(str(v) for v in value)
    if key == "spilled":
        return "SPILLS" if value else "no"
    return str(value)


def format_shape(target: str, shape: dict) -> str:
    """One shape's kernels as a table (bytes for STACK, LOCAL and the shared columns)."""
    title = (f"{target}, hidden {shape['hidden']}, n={shape['streams']}, {shape['tokens']} tokens, "
             f"{shape['dtype']}, Sinkhorn {shape['iterations']} iterations, dropout {shape['dropout']}"
             " (compiled ahead of time, not run)")
    cells = [[_cell(key, row[key], head) for head, key, _ in _COLUMNS] for row in shape["kernels"]]
    widths = [max([len(head)] + [len(r[i]) for r in cells]) for i, (head, _, _) in enumerate(_COLUMNS)]

    def line(values):
        return "  ".join(f"{v:{align}{w}}" for v, w, (_, _, align) in zip(values, widths, _COLUMNS)).rstrip()

    return "\n".join([title, line([h for h, _, _ in _COLUMNS]), line(["-" * w for w in widths]),
                      *(line(r) for r in cells)])


def format_sm(sm: dict) -> str:
    return (f"in flight: Little's law on an {sm['name']} (HBM peak, latency assumed): "
            f"{sm['bandwidth'] / 1e12:.2f} TB/s x "
            f"{sm['latency'] * 1e9:.0f} ns / {sm['sms']} SMs = {sm['bytes_in_flight']:.0f} B per SM; "
            "share below 1: the kernel cannot reach the bandwidth")


def format_report(report: dict) -> str:
    tables = [format_shape(report["target"], shape) for shape in report["shapes"]]
    few = report.get("few_programs", [])
    grids = (f"grids: every fused mHC kernel has at least {report['min_programs']} programs (4 per "
             f"SM of an H100)" if not few else
             f"grids under {report['min_programs']} programs: " + "; ".join(few))
    return "\n\n".join(tables + ([format_sm(report["sm"])] if "sm" in report else []) + [grids])
