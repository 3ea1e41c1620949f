"""``mhc-cg kernels --peers``: our fused mHC ops beside the peers' on the same inputs, in one process.

The peers (none of their code is copied here; each is run as its users run it):

* ``te``: TransformerEngine 2.20.2's Triton mHC kernels with its own autograd wrappers
  (``transformer_engine/common/triton/mhc.py`` and ``pytorch/triton/mhc.py`` from the
  pure-Python wheel), loaded by file path from a folder of their own and never installed: with
  that wheel alone installed, ``import transformer_engine`` raises RuntimeError, which breaks
  every ``except ImportError`` (Megatron's too). The wrapper imports one CUDA-library call, TE's
  cuBLAS GEMM (the mapping weight's gradient without a norm weight), served here by
  ``torch.matmul`` (cuBLAS as well); TMA is asked of CUDA tensors only. Layout ``(s, b, C, n)``.
* ``dev``: Megatron-LM dev's fused mHC functions (``megatron/core/fusions/fused_mhc_kernels.py``
  of the snapshot), as its ``HyperConnectionModule`` calls them with ``use_fused_mhc``: Triton for
  Sinkhorn, the aggregate's forward and the post; torch (compiled) for the projection and the
  aggregate's backward, which have no Triton path (cuTile where installed). H_res transposed.
* ``torch``: Megatron-LM main's ``HyperConnectionModule`` (torch's unfused ops, its methods
  compiled by ``torch.compile`` where that runs), what an H100 user runs today: its file loaded by
  path in the same process, its imports served by dev's ``megatron.core``.

Families (F outside: its output ``y`` is an input): ``pre`` (projection, Sinkhorn, aggregate:
F's input, H_post, H_res), ``post`` (``H_res x + H_post y``), ``post.backward`` (x's and y's
gradients of the post alone), ``pre.backward`` (the gradients of x and the mapping parameters
through F's input alone), ``sublayer`` (the whole mHC forward and backward of one sublayer). Ours
runs with H_res applied as each peer applies it (``h_res_transposed``), in both mHC arithmetics
(main's, the paper's; dev's, DeepSeek-V4's): timed in the peer's own (:data:`ARITHMETIC_OF`),
compared in the other at fp32 only (its eps terms are far below bf16's rounding). Layout conversions happen before the timed calls.

On a GPU each row also has device time (the profiler's kernel durations per call, launch cost
apart), the host wall time per synchronised call, and GB/s against the family's bytes (every
input read once and every output written once: the bound a fused kernel can reach). ``--dry-run``:
numerics only, at a tiny shape, every Triton kernel through Triton's interpreter.

The parent finds the sources and runs the child (``python -m mhc_cg.lab.benchmarks.kernel_peers child``)
with dev's snapshot first on its path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from mhc_cg.lab.emulation.te_wheel import TE_VERSION, find_te_wheel, te_missing_reason, verified

TE_FILES = ("transformer_engine/common/triton/mhc.py", "transformer_engine/pytorch/triton/mhc.py")
PEERS = ("te", "dev", "torch")
ARITHMETICS = ("main", "dev")
# the arithmetic each peer computes: ours is timed beside it in that one
ARITHMETIC_OF = {"te": "main", "dev": "dev", "torch": "main"}
OPS = ("pre", "post", "post.backward", "pre.backward", "sublayer")
N = 4  # TE asserts n = 4
ITERATIONS = 20  # TE's mix-and-aggregate runs 20 Sinkhorn iterations
DRY_SHAPE = {"name": "dry", "seq": 4, "batch": 2, "hidden": 64}
DRY_DTYPES = ("float32", "bfloat16")
OUT = "bench/results/peers"  # peers.json and peers.md


# ----------------------------------------------------------------------------- tolerances
# Note [peer tolerances]: ``ok`` is max|peer - ours| <= rtol * max|ours| for every compared
# tensor. The math is the same; what differs is where each rounds and where the epsilons sit:
# * fp32: TE's norm is 1/sqrt(ms + 1e-6), ours and Megatron's 1/(rms + 1e-6), and dev's Sinkhorn
#   starts from softmax + 1e-6 and divides by (sum + 1e-6) where ours clamps the sum: each a
#   relative 1e-6 in the logits, which 20 Sinkhorn iterations and the sum over C (the weight's
#   gradient) carry to about 1e-5; rtol 1e-4 leaves a 10x margin and still fails a wrong stream,
#   a missed transpose or a dropped term (each O(1)).
# * bf16: every peer rounds the outputs to bf16 (half an ulp: 2^-9 relative), and the unfused
#   peers round each intermediate too (H_res x, H_post y and their sum: three roundings, about
#   3 x 2^-9 = 0.6 %); gradients summed over tokens round each token's share before the sum in
#   the unfused ones. rtol 2^-5 (3.1 %) covers that with a margin below the 5-100 % a wrong term
#   gives.
# On a GPU TE's projection runs TF32 (10-bit mantissa operands, fp32 sums: about 2^-11 relative
# per product): inside the fp32 bound's margin at C = 2048 (sqrt(nC) growth, about 1e-4 worst);
# the interpreter computes every dot in fp32, so CPU runs do not see it.
RTOL = {"float32": 1e-4, "bfloat16": 2.0 ** -5}


def tolerance(dtype: str) -> float:
    return RTOL[dtype]


# ------------------------------------------------------------------------- the parent side
def te_folder(source: Path, scratch: Path) -> Path:
    """A folder holding TE's two mHC files, extracted from the wheel when ``source`` is one."""
    if source.is_dir():
        return source
    out = scratch / "te"
    with zipfile.ZipFile(source) as wheel:
        for name in TE_FILES:
            wheel.extract(name, out)
    return out


def run(shapes: list[dict], dtypes: list[str], device: str, dry: bool, repo: Path, out: Path,
        reps: int = 10, progress: bool = True) -> dict:
    """Every row at every shape and dtype, in one child process that writes ``out/peers.json``
    after each peer (a run cut short keeps what it measured); the report, with ``peers.md``
    written beside it where the rows are timed."""
    from mhc_cg.lab.megatron_harness.child_process import (extract_snapshot, run_child,
                                                            snapshot_archive)

    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        spec: dict = {"shapes": shapes, "dtypes": dtypes, "device": device, "reps": reps,
                      "progress": progress, "te": None, "main": None}
        wheel = find_te_wheel(repo)
        if wheel is None:
            skipped["te"] = te_missing_reason(repo)
        else:
            spec["te"] = str(te_folder(wheel, scratch))
        first = []
        dev = snapshot_archive("dev")
        if dev is None:
            skipped["dev"] = "no Megatron-LM dev snapshot (megatron-lm-dev-*.tar.gz)"
        else:
            first = [extract_snapshot(dev, scratch / "dev")]
        main = snapshot_archive("main")
        if main is None or dev is None:
            skipped["torch"] = ("no Megatron-LM main snapshot (megatron-lm-main-*.tar.gz)"
                                if main is None else "main's module is loaded beside dev's "
                                "megatron.core, and there is no dev snapshot")
        else:
            root = extract_snapshot(main, scratch / "main")
            spec["main"] = str(root / "megatron" / "core" / "transformer" / "hyper_connection.py")
        spec["skipped"] = skipped
        out.mkdir(parents=True, exist_ok=True)
        spec_path, out_path = scratch / "spec.json", out / "peers.json"
        spec_path.write_text(json.dumps(spec))
        env = {"TORCH_COMPILE_DISABLE": "1"} if device == "cpu" else {}
        if dry:
            env.update(TRITON_INTERPRET="1", NVTE_DISABLE_TRITON_AUTOTUNING="1")
        status, output = run_child(["-m", "mhc_cg.lab.benchmarks.kernel_peers", "child", str(spec_path),
                                    str(out_path)], first, env=env,
                                   forward_prefix="[kernels]")
        if status != 0 or not out_path.exists():
            raise RuntimeError(f"the peers' child process failed (exit {status}):\n"
                               f"{output[-6000:]}")
        report = json.loads(out_path.read_text())
    if any(r.get("ms") is not None for r in report["rows"]):
        (out / "peers.md").write_text(markdown(report))
    return report


def format_report(report: dict) -> str:
    lines = [f"mHC ops beside their peers on {report['device']} (torch {report['torch']}); "
             f"ok: max|peer - ours| <= rtol x max|ours| per tensor (docs/kernels.md)"]
    for peer, why in report["skipped"].items():
        lines.append(f"{peer}: not run: {why}")
    for peer, how in report["peers"].items():
        lines.append(f"{peer}: {how}")
    for gap in report["not_run"]:
        lines.append(f"{gap['peer']} at {gap['dtype']}: {', '.join(gap['ops'])} not run: "
                     f"{gap['why']}")
    timed = any(r.get("ms") is not None for r in report["rows"])
    head = (f"{'shape':8} {'dtype':9} {'op':14} {'peer':6} {'ours in':8} {'max abs diff':>13} "
            f"{'rtol':>8} ok")
    if timed:
        head += f" {'ours ms':>9} {'peer ms':>9} {'x ours':>7} {'GB/s':>7}"
    lines += ["", head]
    for r in report["rows"]:
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3e}"
        line = (f"{r['shape']:8} {r['dtype']:9} {r['op']:14} {r['peer']:6} "
                f"{r.get('arithmetic', 'main'):8} {diff:>13} "
                f"{r['rtol']:>8.1e} {'yes' if r['ok'] else 'NO'}")
        if timed:
            line += (f" {_fig(r.get('ours_ms'), '.4f'):>9} {_fig(r.get('ms'), '.4f'):>9} "
                     f"{_fig(r.get('over_ours'), '.2f'):>7} {_fig(r.get('gb_per_s'), '.0f'):>7}")
        if r.get("worst"):
            line += f"  ({r['worst']})"
        lines.append(line)
    return "\n".join(lines)


def _fig(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    """The timed rows as a table: per op, ours and each peer in device ms per call, each peer's
    time over ours (ours timed beside it, in its H_res orientation)."""
    rows = [r for r in report["rows"] if r.get("ms") is not None]
    out = [f"# mHC ops beside their peers: {report['device']}", "",
           f"torch {report['torch']}, code {report['code']}. Device ms per call (the profiler's "
           f"kernel durations, launch cost apart); GB/s against the family's bytes (every input "
           f"read once, every output written once); wall ms per synchronised call.", "",
           "| shape | dtype | op | peer | ours in | ours ms | peer ms | peer / ours | ours GB/s | "
           "peer GB/s | ours wall ms | peer wall ms | max abs diff | ok |",
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        figures = [_fig(r[k], f) for k, f in (
            ("ours_ms", ".4f"), ("ms", ".4f"), ("over_ours", ".2f"), ("ours_gb_per_s", ".0f"),
            ("gb_per_s", ".0f"), ("ours_wall_ms", ".4f"), ("wall_ms", ".4f"))]
        out.append(f"| {r['shape']} | {r['dtype']} | {r['op']} | {r['peer']} | "
                   f"{r.get('arithmetic', 'main')} | " + " | ".join(figures)
                   + f" | {r['max_abs_diff']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------- the child side
def load_te(folder: str):
    """TE's autograd wrappers over its kernels, from ``folder`` (see the module docstring).
    The ``transformer_engine`` names it imports exist only while its files load."""
    packages = ["transformer_engine", "transformer_engine.common",
                "transformer_engine.common.triton", "transformer_engine.pytorch",
                "transformer_engine.pytorch.triton", "transformer_engine.pytorch.cpp_extensions",
                "transformer_engine.pytorch.cpp_extensions.gemm"]
    files = [f.removesuffix(".py").replace("/", ".") for f in TE_FILES]
    before = {name: sys.modules.get(name) for name in packages + files}

    def general_gemm(a, b, out_dtype=None, layout="TN", **_):
        if layout != "NT":
            raise NotImplementedError(f"the GEMM stand-in serves layout NT, not {layout}")
        return (b.t().to(out_dtype) @ a.to(out_dtype),)

    try:
        for name in packages:
            sys.modules[name] = types.ModuleType(name)
        sys.modules[packages[-1]].general_gemm = general_gemm
        loaded = []
        for name, rel in zip(files, TE_FILES):
            path = Path(folder) / rel
            source = verified(rel, path.read_bytes(), folder)  # Note [TE's files by their hashes]
            module = types.ModuleType(name)
            module.__file__, module.__package__ = str(path), name.rpartition(".")[0]
            sys.modules[name] = module
            exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
            loaded.append(module)
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    wrappers = loaded[1]
    tma = wrappers._support_tma
    wrappers._support_tma = lambda x: x.is_cuda and tma(x)  # it asks the CUDA device
    return wrappers


def _one_config_under_the_interpreter(module) -> None:
    """Triton's autotuner benchmarks on a GPU; under the interpreter each autotuned kernel keeps
    its first configuration (TE's own pruners do the same under NVTE_DISABLE_TRITON_AUTOTUNING)."""
    from triton.runtime.autotuner import Autotuner

    for value in vars(module).values():
        if isinstance(value, Autotuner):
            value.configs = value.configs[:1]


def load_dev(interpreted: bool):
    import megatron.core.fusions.fused_mhc_kernels as dev

    if interpreted:
        _one_config_under_the_interpreter(dev)
    return dev


def load_main_module(path: str):
    """Main's ``hyper_connection.py`` by path, its ``megatron.core`` imports served by dev's.
    Main imports ``CheckpointWithoutOutputManager``, which dev's ``tensor_parallel.random`` does
    not define: it only types the recompute manager, which these runs never pass, so a
    placeholder class stands for it when dev lacks it."""
    from megatron.core.tensor_parallel import random

    if not hasattr(random, "CheckpointWithoutOutputManager"):
        random.CheckpointWithoutOutputManager = type("CheckpointWithoutOutputManager", (), {})
    spec = importlib.util.spec_from_file_location("mhc_cg_peer_main_hyper_connection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Inputs:
    """One case's inputs in our layout: ``x [s, b, nC]`` (stream-major), the mapping weight
    ``[m, nC]``, ``a_pre``/``a_post``/``a_res`` ``[1]``, ``bias [m]``, F's output ``y [s, b, C]``
    and the gradients a loss sends to F's input and to the post's output."""
    x: object
    weight: object
    a_pre: object
    a_post: object
    a_res: object
    bias: object
    y: object
    g_fn: object
    g_out: object

    @property
    def shape(self) -> tuple[int, int, int]:
        s, b, _ = self.x.shape
        return s, b, self.y.shape[-1]


def make_inputs(seq: int, batch: int, hidden: int, dtype, device, seed: int = 0) -> Inputs:
    """Inputs whose every mapping matters: alphas and a bias away from their init, a weight
    that moves the logits by O(1)."""
    g = torch.Generator().manual_seed(seed)
    m, width = N * N + 2 * N, N * hidden

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    return Inputs(x=randn(seq, batch, width), weight=randn(m, width, scale=width ** -0.5),
                  a_pre=randn(1, scale=0.5).abs() + 0.5, a_post=randn(1, scale=0.5).abs() + 0.5,
                  a_res=randn(1, scale=0.5).abs() + 0.5, bias=randn(m, scale=0.5),
                  y=randn(seq, batch, hidden), g_fn=randn(seq, batch, hidden),
                  g_out=randn(seq, batch, width))


class Peer:
    """A peer's families over its own layout: :meth:`prepare` turns our inputs into its leaf
    tensors (before any timed call), :meth:`pre` and :meth:`post` run its ops, and
    :meth:`ours_layout` maps an x-shaped tensor or the weight back for the comparison."""
    name = ""
    transposed = False  # H_res applied transposed
    post_grads_x = True  # the post's backward alone gives x its whole gradient through the post

    def prepare(self, inp: Inputs) -> dict:
        t = {"x": inp.x, "weight": inp.weight, "a_pre": inp.a_pre, "a_post": inp.a_post,
             "a_res": inp.a_res, "bias": inp.bias, "y": inp.y}
        t = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
        t.update(g_fn=inp.g_fn, g_out=inp.g_out)
        return t

    def params(self, t: dict) -> dict:
        """The leaves whose gradients ``pre.backward`` and ``sublayer`` compare, in our layout."""
        return {"weight": t["weight"], "a_pre": t["a_pre"], "a_post": t["a_post"],
                "a_res": t["a_res"], "bias": t["bias"]}

    def param_grads(self, t: dict) -> dict:
        return {k: v.grad for k, v in self.params(t).items()}

    def ours_layout(self, name: str, value):
        return value

    def pre(self, t: dict, x):
        """``(F's input, h_post [s, b, n], h_res [s, b, n, n], what the post needs)``; a peer
        whose pre makes no mappings tensors returns ``None`` for them (:meth:`mappings`)."""
        raise NotImplementedError

    def mappings(self, t: dict, h_post, h_res, maps) -> tuple:
        """``(h_post, h_res)`` for the comparison, outside any timed call."""
        return h_post, h_res

    def post(self, t: dict, x, maps, y):
        raise NotImplementedError

    def detached(self, maps):
        return tuple(m.detach() for m in maps)


class Ours(Peer):
    """Ours, H_res applied as the peer beside it applies it.

    Note [the residual product in the pre's backward]: our post hands x's gradient on as it came
    (``g``) and the pre's backward adds ``H_res^T g`` in its pass over x, so the post alone gives
    no x gradient to compare: the ``post.backward`` row compares y's, and ``sublayer`` compares
    x's whole gradient."""
    name = "ours"
    post_grads_x = False

    def __init__(self, transposed: bool, arithmetic: str = "main"):
        self.transposed, self.arithmetic = transposed, arithmetic

    def pre(self, t, x):
        from mhc_cg.ops import kernels as k

        fn, state, x_on = k.pre(x, t["weight"], t["a_pre"], t["a_post"], t["a_res"], t["bias"],
                                None, N, ITERATIONS, 1e-6, "triton",
                                h_res_transposed=self.transposed, arithmetic=self.arithmetic)
        return fn, None, None, (x_on, state)

    def mappings(self, t, h_post, h_res, maps):
        """Ours keeps the state, which the post reads: the mappings are derived from it for the
        comparison only (the torch reference, never timed)."""
        from mhc_cg.ops.kernels.reference import _post_mappings

        state = maps[1]
        s, b, _ = t["x"].shape
        with torch.no_grad():
            *_, s_post, h_res = _post_mappings(
                state.reshape(s * b, -1), t["a_pre"], t["a_post"], t["a_res"], t["bias"], N,
                ITERATIONS, math.sqrt(t["x"].shape[-1]), self.arithmetic)
        return (2 * s_post).view(s, b, N), h_res.view(s, b, N, N)

    def post(self, t, x, maps, y):
        from mhc_cg.ops import kernels as k

        x_on, state = maps if maps[0] is not None else (x, maps[1])
        return k.post(x_on, state, t["a_pre"], t["a_post"], t["a_res"], t["bias"], y, None, 0.0,
                      0, N, ITERATIONS, "triton", h_res_transposed=self.transposed,
                      arithmetic=self.arithmetic)

    def detached(self, maps):
        return (None, maps[1].detach())  # the post alone reads x from its own input


class TE(Peer):
    name = "te"
    transposed = True

    def __init__(self, wrappers, tf32: bool):
        self.te = wrappers
        # TE's production setting on a GPU; under the interpreter a bf16 x bf16 dot asked for
        # TF32 comes out wrong (a GPU runs it on bf16 MMA whatever it is asked), so there TE runs
        # its fp32-exact path, as its own tests do
        self.tf32 = tf32

    def prepare(self, inp):
        s, b, c = inp.shape
        m = inp.weight.shape[0]
        # (s, b, C, n): feature k = c * n + i; the weight's columns likewise
        t = {"x": inp.x.view(s, b, N, c).transpose(-1, -2).contiguous(),
             "weight": inp.weight.view(m, N, c).transpose(1, 2).reshape(m, c * N),
             "alpha": torch.cat([inp.a_pre, inp.a_post, inp.a_res]),
             "bias": inp.bias.view(1, m), "y": inp.y}
        t = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
        t.update(g_fn=inp.g_fn, g_out=inp.g_out.view(s, b, N, c).transpose(-1, -2).contiguous())
        return t

    def params(self, t):
        return {"weight": t["weight"], "alpha": t["alpha"], "bias": t["bias"]}

    def param_grads(self, t):
        g = t["alpha"].grad
        return {"weight": self.ours_layout("weight", t["weight"].grad),
                "a_pre": g[0:1], "a_post": g[1:2], "a_res": g[2:3], "bias": t["bias"].grad[0]}

    def ours_layout(self, name, value):
        if name == "weight":
            m, width = value.shape
            return value.view(m, width // N, N).transpose(1, 2).reshape(m, width)
        s, b, c, n = value.shape
        return value.transpose(-1, -2).reshape(s, b, n * c)

    def pre(self, t, x):
        fn, h_post, h_res = self.te.mhc_generate_mix_and_aggregate(
            x, t["weight"], t["alpha"], t["bias"], use_tf32=self.tf32)
        return fn, h_post, h_res, (h_post, h_res)

    def post(self, t, x, maps, y):
        return self.te.mhc_fused_expand_combine(y, None, maps[0], x, maps[1], N,
                                                use_tf32=self.tf32)


class Dev(Peer):
    name = "dev"
    transposed = True

    def __init__(self, module):
        self.dev = module

    def pre(self, t, x):
        s, b, width = x.shape
        h_pre, h_post, h_res, _ = self.dev.fused_proj_rms_compute_h(
            x, t["weight"], t["a_pre"], t["a_post"], t["a_res"], t["bias"], N)
        h_res = self.dev.fused_sinkhorn(h_res.reshape(s, b, N, N), ITERATIONS)
        fn = self.dev.fused_h_aggregate(x.view(s, b, N, width // N), h_pre)
        return fn, h_post, h_res, (h_post, h_res)

    def post(self, t, x, maps, y):
        s, b, width = x.shape
        out = self.dev.fused_h_post_bda(maps[1], x.view(s, b, N, width // N), maps[0], y, None)
        return out.reshape(s, b, width)


class MainTorch(Peer):
    name = "torch"

    def __init__(self, module, config_type, inp: Inputs):
        s, b, c = inp.shape
        config = config_type(num_layers=1, hidden_size=c, num_attention_heads=1,
                             enable_hyper_connections=True, num_residual_streams=N,
                             mhc_sinkhorn_iterations=ITERATIONS, params_dtype=inp.x.dtype)
        config.mhc_num_residual_streams = N  # main's name for the field dev calls otherwise
        self.module = module.HyperConnectionModule(config, layer_number=1).to(
            device=inp.x.device, dtype=inp.x.dtype)
        self.torch = torch

    def prepare(self, inp):
        t = super().prepare(inp)
        for name in ("weight", "a_pre", "a_post", "a_res", "bias"):  # the module's own leaves
            t[name] = self.torch.nn.Parameter(t[name])
        m = self.module
        m.mapping_proj.weight = t["weight"]
        m.alpha_pre, m.alpha_post, m.alpha_res, m.bias = (t["a_pre"], t["a_post"], t["a_res"],
                                                          t["bias"])
        return t

    def pre(self, t, x):
        h_pre, h_post, h_res = self.module.compute_mappings(x)
        return self.module.aggregate(x, h_pre), h_post, h_res, (h_post, h_res)

    def post(self, t, x, maps, y):
        return self.module.fused_h_res_h_post_bda(maps[1], x, maps[0], (y, None), 0.0, True,
                                                  False)


# the work of each row: (run it once, returning the tensors compared by name)
def _row_pre(peer, t, compare: bool = True):
    fn, h_post, h_res, maps = peer.pre(t, t["x"])
    if not compare:  # timed: the pre alone
        return {"fn_input": fn}
    h_post, h_res = peer.mappings(t, h_post, h_res, maps)
    return {"fn_input": fn, "h_post": h_post, "h_res": h_res}


def _row_post(peer, t, maps):
    return {"out": peer.ours_layout("out", peer.post(t, t["x"], maps, t["y"]))}


def _clear(t: dict) -> None:
    for v in t.values():
        if getattr(v, "requires_grad", False):
            v.grad = None


def _row_post_backward(peer, t, maps):
    _clear(t)
    out = peer.post(t, t["x"], maps, t["y"])
    torch.autograd.backward(out, t["g_out"])
    grads = {"g_y": t["y"].grad}
    if peer.post_grads_x:
        grads["g_x"] = peer.ours_layout("g_x", t["x"].grad)
    return grads


def _row_pre_backward(peer, t):
    _clear(t)
    fn, *_ = peer.pre(t, t["x"])
    torch.autograd.backward(fn, t["g_fn"])
    return {"g_x": peer.ours_layout("g_x", t["x"].grad), **peer.param_grads(t)}


def _row_sublayer(peer, t):
    _clear(t)
    fn, _, _, maps = peer.pre(t, t["x"])
    out = peer.post(t, t["x"], maps, t["y"])
    torch.autograd.backward([fn, out], [t["g_fn"], t["g_out"]])
    return {"fn_input": fn, "out": peer.ours_layout("out", out),
            "g_x": peer.ours_layout("g_x", t["x"].grad), "g_y": t["y"].grad,
            **peer.param_grads(t)}


def _compare(ours: dict, theirs: dict, rtol: float) -> tuple[float, bool, str]:
    """``(max abs diff, ok, the worst tensor with its diff and bound)`` over the shared names."""
    worst, ok, note, top = 0.0, True, "", -1.0
    for name, value in ours.items():
        a, b = value.detach().double(), theirs[name].detach().double()
        diff = (a - b).abs().max().item()
        bound = rtol * max(a.abs().max().item(), 1e-30)
        if diff / bound > top:
            top, note = diff / bound, f"{name}: {diff:.2e} of {bound:.2e}"
        worst, ok = max(worst, diff), ok and diff <= bound
    return worst, ok, note


def family_bytes(op: str, s: int, b: int, c: int, es: int) -> int:
    """Every input read once and every output written once (the maps fp32): a fused kernel's
    bound."""
    t, m, maps = s * b, N * N + 2 * N, (N + N * N) * 4
    x, y = t * N * c * es, t * c * es
    w = m * N * c * es
    return {"pre": x + w + y + t * maps,
            "post": x + y + t * maps + x,
            "post.backward": x + t * maps + x + y,  # g_out, maps, x for H_res's grad; g_x, g_y
            "pre.backward": y + x + w + x + w,
            "sublayer": (x + w + y + t * maps) + (x + y + t * maps + x)
                        + (x + y + x + w + x + y + w)}[op]


def _device_ms(fn, reps: int) -> tuple[float, float]:
    """``(device ms per call: the union of the kernels' spans in a torch.profiler trace, as
    ``mhc-cg kernels --bench`` counts them; ms per call between CUDA events around back-to-back
    calls, launch gaps included, :func:`~mhc_cg.lab.benchmarks.timing.time_repeated`)``, after three
    warm-up calls (Triton's compiles, torch.compile's)."""
    from torch.profiler import ProfilerActivity, profile

    from mhc_cg.lab.benchmarks.timing import time_repeated
    from mhc_cg.lab.profiling.traces import read_timeline, union_ns

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    wall = time_repeated(fn, reps, torch.device("cuda")) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        spans = [(w.start, w.end) for w in read_timeline(path).work]
    return union_ns(spans) / 1e6 / reps, wall


def interpreter_bf16_dot_error() -> float:
    """The largest error of a 16 x 16 bf16 ``tl.dot`` (fp32 result) under Triton's interpreter
    against torch: Triton 3.9's interpreter gets it wrong (about 1e10), so a peer's kernel whose
    dot takes bf16 operands cannot be checked there."""
    import triton
    import triton.language as tl

    @triton.jit
    def product(a_ptr, b_ptr, out_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b, out_dtype=tl.float32))

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=g).bfloat16() for _ in range(2))
    out = torch.empty(16, 16)
    product[(1,)](a, b, out)
    return (out - a.float() @ b.float()).abs().max().item()


# the families whose TE kernels take a bf16 x bf16 dot (the aggregate's backward)
TE_BF16_DOT_OPS = ("pre.backward", "sublayer")


def child(spec_path: str, out_path: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")

    from mhc_cg.core.progress import log
    from mhc_cg.ops.kernels.dispatch import interpret_requested

    spec = json.loads(Path(spec_path).read_text())
    device = torch.device(spec["device"])
    say = (lambda m: log("kernels", m)) if spec["progress"] else (lambda m: None)
    timed = device.type == "cuda"
    if device.type == "cpu":
        torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()  # CPU torch raises
    skipped = dict(spec["skipped"])
    te = load_te(spec["te"]) if spec["te"] else None
    dev = load_dev(interpret_requested()) if "dev" not in skipped else None
    main = load_main_module(spec["main"]) if spec["main"] else None
    peers_said = {
        "te": f"TransformerEngine {TE_VERSION} Triton kernels, its autograd wrappers; "
              f"products {'TF32 (use_tf32=True)' if timed else 'fp32 (use_tf32=False)'}",
        "dev": "Megatron-LM dev fused_mhc_kernels: " + (dev._mhc_backend_selection()
                                                          if dev is not None else "-"),
        "torch": "Megatron-LM main HyperConnectionModule (torch ops"
                 + (", torch.compile)" if timed else ", eager)")}
    report = {"device": torch.cuda.get_device_name(device) if timed else "cpu (interpreter)",
              "torch": torch.__version__, "code": _code(), "skipped": skipped,
              "peers": {p: peers_said[p] for p in PEERS if p not in skipped}, "not_run": [],
              "rows": []}
    from megatron.core.transformer.transformer_config import TransformerConfig

    unchecked: tuple = ()
    if interpret_requested() and te is not None and "bfloat16" in spec["dtypes"]:
        error = interpreter_bf16_dot_error()
        if error > 1e-2:
            unchecked = TE_BF16_DOT_OPS
            report["not_run"] = [{"peer": "te", "dtype": "bfloat16", "ops": list(unchecked),
                                  "why": f"Triton's interpreter computes a bf16 tl.dot wrong "
                                         f"(16 x 16: off by {error:.1e}), and TE's aggregate "
                                         f"backward takes one; on a GPU they run"}]
    for shape in spec["shapes"]:
        for dtype_name in spec["dtypes"]:
            dtype = getattr(torch, dtype_name)
            inp = make_inputs(shape["seq"], shape["batch"], shape["hidden"], dtype, device)
            peers = []
            if te is not None:
                peers.append(TE(te, tf32=timed))
            if dev is not None:
                peers.append(Dev(dev))
            if main is not None:
                peers.append(MainTorch(main, TransformerConfig, inp))
            for peer in peers:
                say(f"{shape['name']} {dtype_name}: {peer.name}")
                skip = unchecked if (peer.name, dtype_name) == ("te", "bfloat16") else ()
                for arithmetic in ARITHMETICS:  # timed in the peer's own only
                    own = arithmetic == ARITHMETIC_OF[peer.name]
                    if not own and dtype_name != "float32":
                        continue  # the arithmetics' eps terms are far below bf16's rounding
                    report["rows"] += _rows(peer, Ours(peer.transposed, arithmetic), inp, shape,
                                            dtype_name, timed and own, spec["reps"], skip)
                Path(out_path).write_text(json.dumps(report, indent=1))
    Path(out_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _rows(peer: Peer, ours: Ours, inp: Inputs, shape: dict, dtype: str, timed: bool,
          reps: int, skip: tuple = ()) -> list[dict]:
    """Every family of ``peer`` but ``skip`` beside ours (ours with the peer's H_res
    orientation)."""
    rtol = tolerance(dtype)
    t_peer, t_ours = peer.prepare(inp), ours.prepare(inp)
    maps_peer = peer.detached(peer.pre(t_peer, t_peer["x"])[3])
    maps_ours = ours.detached(ours.pre(t_ours, t_ours["x"])[3])
    work = {"pre": (lambda p, t, m: _row_pre(p, t)),
            "post": _row_post, "post.backward": _row_post_backward,
            "pre.backward": (lambda p, t, m: _row_pre_backward(p, t)),
            "sublayer": (lambda p, t, m: _row_sublayer(p, t))}
    forward_of = {"post.backward": "post", "pre.backward": "pre"}
    # what a timed call runs: the op, none of the comparison's own work
    timed_work = {**work, "pre": (lambda p, t, m: _row_pre(p, t, compare=False))}
    rows, (s, b, c) = [], inp.shape
    es = inp.x.element_size()
    for op in (op for op in OPS if op not in skip):
        ref = work[op](ours, t_ours, maps_ours)
        got = work[op](peer, t_peer, maps_peer)
        diff, ok, note = _compare(ref, got, rtol)
        row = {"shape": shape["name"], "tokens": s * b, "hidden": c, "dtype": dtype, "op": op,
               "peer": peer.name, "h_res_transposed": peer.transposed,
               "arithmetic": ours.arithmetic, "max_abs_diff": diff,
               "rtol": rtol, "ok": ok, "worst": note}
        if timed:  # ours timed beside each peer, in the peer's H_res orientation
            for prefix, p, t, m in (("ours_", ours, t_ours, maps_ours),
                                    ("", peer, t_peer, maps_peer)):
                ms, wall = _device_ms(lambda: timed_work[op](p, t, m), reps)
                if op in forward_of:  # the backward alone: its forward's time taken off
                    ms0, wall0 = _device_ms(lambda: timed_work[forward_of[op]](p, t, m), reps)
                    ms, wall = ms - ms0, wall - wall0
                if ms <= 0:  # a backward within its forward's noise: no figure, rather than one
                    ms = wall = None
                row.update({f"{prefix}ms": ms, f"{prefix}wall_ms": wall,
                            f"{prefix}gb_per_s": None if ms is None
                            else family_bytes(op, s, b, c, es) / (ms * 1e6)})
            row["over_ours"] = (None if row["ms"] is None or row["ours_ms"] is None
                                else row["ms"] / row["ours_ms"])
        rows.append(row)
    return rows


def _code() -> str:
    from mhc_cg.lab.benchmarks.runner import code_version

    return code_version()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "child":
    sys.exit(child(sys.argv[2], sys.argv[3]))
