"""Megatron-LM ``main``'s own mHC as a test oracle, run in a subprocess.

No megatron-core release has mHC yet, so ``../shared/third_party/megatron-lm-main-*.tar.gz`` (a
source snapshot of Megatron-LM ``main``'s ``megatron/core``) is extracted into a scratch directory
and imported by a *separate* Python process whose ``PYTHONPATH`` puts it first: in that process
``import megatron.core`` is ``main``'s, while the pinned megatron-core of the test process is
untouched.

The parent side (``snapshot_archive``, ``extract_snapshot``, ``run_job``) is imported by the tests.
The child side is this file run as a script: ``python megatron_main_oracle.py JOB OUT.json``
installs the CPU shims, runs one job (a function of this module named in ``JOBS``) and writes
its JSON result to ``OUT.json``. The jobs measure; the tests assert.

CPU shims the child installs before importing ``main`` (``main`` is written for CUDA):

* ``TORCH_COMPILE_DISABLE=1``: several ``HyperConnectionModule`` methods carry ``torch.compile``;
* ``torch.cuda.nvtx.range`` -> a null context (CPU torch raises);
* ``torch.cuda.current_device`` -> ``"cpu"``: ``DotProductAttention`` takes its score buffer from
  ``GlobalMemoryBuffer``, which allocates on the current CUDA device (the buffer is ``baddbmm``'s
  ``beta=0`` input, so its device is all that matters);
* ``fused_softmax.get_default_causal_mask`` (the causal mask when none is passed) -> the same
  mask on CPU (main builds it on ``"cuda"``);
* megatron's CUDA RNG state getters/setters -> empty state / no-op: its
  ``CheckpointWithoutOutput`` saves and restores CPU *and* CUDA RNG states; on CPU only the CPU
  generator exists (and it is still saved and restored);
* without TransformerEngine: ``CheckpointWithoutOutput`` always enters its TE path
  (``activation_recompute_forward``, ``FP8GlobalStateManager``, ``fp8_autocast``), whose names
  are then undefined; with FP8 off each is a no-op, so the shims are null contexts and "FP8 off".
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHIVE_GLOB = "megatron-lm-main-*.tar.gz"
# ``../shared/third_party`` beside the repository (one level up again for a git worktree kept in
# a sub-folder), or the folder named by MHC_CG_THIRD_PARTY
SEARCH_DIRS = tuple([Path(os.environ["MHC_CG_THIRD_PARTY"])] if "MHC_CG_THIRD_PARTY" in os.environ
                    else []) + (REPO.parent / "shared" / "third_party",
                                REPO.parent.parent / "shared" / "third_party")
CHILD_TIMEOUT_S = 300


# ------------------------------------------------------------------------------ parent side
def snapshot_archive() -> Path | None:
    """The newest ``megatron-lm-main-*.tar.gz`` next to the repository (``../shared/third_party``)."""
    for directory in SEARCH_DIRS:
        found = sorted(glob.glob(str(directory / ARCHIVE_GLOB)))
        if found:
            return Path(found[-1])
    return None


def skip_reason() -> str:
    return (f"no Megatron-LM main snapshot ({ARCHIVE_GLOB}) in "
            f"{' or '.join(str(d) for d in SEARCH_DIRS)}")


def extract_snapshot(archive: Path, into: Path) -> Path:
    """Extract ``archive`` under ``into`` (once); return the directory to put on ``PYTHONPATH``."""
    root = into / archive.name.removesuffix(".tar.gz")
    if not (root / "megatron" / "core" / "__init__.py").exists():
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return root


def run_job(snapshot_root: Path, job: str, **kwargs) -> dict:
    """Run ``job(**kwargs)`` in a fresh process that imports ``main``'s megatron.core; its result."""
    out = snapshot_root.parent / f"{job}-{os.getpid()}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(snapshot_root), str(REPO)])
    env["TORCH_COMPILE_DISABLE"] = "1"
    env["PYTHONWARNINGS"] = "ignore"  # main warns about missing TE/Apex on every import
    cmd = [sys.executable, str(Path(__file__).resolve()), job, str(out), json.dumps(kwargs)]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise AssertionError(f"oracle job {job!r} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


# ------------------------------------------------------------------------------- child side
def install_cpu_shims() -> None:
    """Let ``main``'s CUDA-first code run on CPU torch; see the module docstring."""
    import contextlib
    import types

    import torch

    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        torch.cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
        torch.cuda.current_device = lambda: "cpu"
        from megatron.core.tensor_parallel import random as mrandom

        mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
        mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
        from megatron.core.fusions import fused_softmax

        fused_softmax.get_default_causal_mask = _causal_mask_on_cpu
    from megatron.core.tensor_parallel import random as mrandom

    if not mrandom.HAVE_TE:
        # CheckpointWithoutOutput always takes its TE path (``self.fp8 = fp8 is not None``)
        mrandom.FP8GlobalStateManager = types.SimpleNamespace(
            is_fp8_enabled=lambda: False, get_fp8_recipe=lambda: None)
        mrandom.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
        mrandom.fp8_autocast = lambda enabled, fp8_recipe=None: _no_fp8(enabled)


def _causal_mask_on_cpu(sq: int):
    import torch

    return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)


def _no_fp8(enabled: bool):
    import contextlib

    if enabled:
        raise RuntimeError("FP8 needs TransformerEngine, which is not installed")
    return contextlib.nullcontext()


def max_abs_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def hyper_connection_job(streams: list[int], dtypes: list[str], seq: int = 5, batch: int = 3,
                         hidden: int = 16) -> dict:
    """``mhc_cg.ops.hyper_connection.HyperConnection`` beside ``main``'s ``HyperConnectionModule``.

    For each (n, dtype): build main's module, load its ``state_dict`` into ours (strict), run the
    mappings, aggregate, H_res, H_post and a whole sublayer ``H_res x + H_post^T F(H_pre x) (+ bias)``
    with the same F in both, backpropagate one loss that touches every output, and report the
    largest absolute difference of every forward value and every gradient (input and parameters).
    Main's sublayer is its own ``fused_h_res_h_post_bda`` (training, dropout 0, unfused).
    """
    import torch

    from megatron.core.transformer.hyper_connection import HyperConnectionModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mhc_cg.ops.hyper_connection import HyperConnection

    cases = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for n in streams:
            torch.manual_seed(1000 + n)
            config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                                       enable_mhc_connections=True, mhc_num_residual_streams=n,
                                       mhc_sinkhorn_iterations=20, mhc_init_gating_factor=0.01,
                                       params_dtype=dtype, use_cpu_initialization=True)
            theirs = HyperConnectionModule(config, layer_number=1).to(dtype)
            with torch.no_grad():  # move off the init so every mapping matters
                for p in theirs.parameters():
                    p.add_(0.3 * torch.randn_like(p))
            ours = HyperConnection(hidden, n, config.mhc_sinkhorn_iterations,
                                   config.mhc_init_gating_factor).to(dtype)
            missing = ours.load_state_dict(theirs.state_dict(), strict=True)
            f_weight = torch.randn(hidden, hidden, dtype=dtype) / hidden ** 0.5
            f_bias = torch.randn(hidden, dtype=dtype).requires_grad_()
            x0 = torch.randn(seq, batch, n * hidden, dtype=dtype)
            probes = {k: torch.randn(shape, dtype=dtype) for k, shape in
                      (("out", (seq, batch, n * hidden)), ("h_pre", (seq, batch, n)),
                       ("h_post", (seq, batch, n)), ("h_res", (seq, batch, n, n)),
                       ("agg", (seq, batch, hidden)))}

            def sublayer_f(agg):
                return torch.tanh(agg @ f_weight)

            def loss_of(values):
                return sum((values[k] * probes[k]).sum() for k in probes)

            def run(module, main: bool):
                x = x0.clone().requires_grad_()
                bias = f_bias.detach().clone().requires_grad_()
                if main:
                    agg, h_res, h_post = module(x)
                    h_pre, _, _ = module.compute_mappings(x)
                    y = sublayer_f(agg)
                    out = module.fused_h_res_h_post_bda(h_res, x, h_post, (y, bias), 0.0,
                                                        True, False)
                    parts = {"apply_h_res": module.apply_h_res(h_res, x),
                             "apply_h_post": module._apply_h_post(y, h_post)}
                else:
                    h_pre, h_post, h_res = module.compute_mappings(x)
                    agg = module.aggregate(x, h_pre)
                    y = sublayer_f(agg)
                    post = (module.apply_h_post(y, h_post)
                            + module.apply_h_post(bias.expand(seq, batch, hidden), h_post))
                    out = module.apply_h_res(h_res, x) + post
                    parts = {"apply_h_res": module.apply_h_res(h_res, x),
                             "apply_h_post": module.apply_h_post(y, h_post)}
                values = {"out": out, "h_pre": h_pre, "h_post": h_post, "h_res": h_res, "agg": agg}
                loss_of(values).backward()
                grads = {"x": x.grad, "f_bias": bias.grad,
                         **{name: p.grad for name, p in module.named_parameters()}}
                return {**values, **parts}, grads

            values_m, grads_m = run(theirs, main=True)
            values_o, grads_o = run(ours, main=False)
            cases.append({
                "n": n, "dtype": dtype_name,
                "state_dict_keys": sorted(theirs.state_dict()),
                "load_missing": list(missing.missing_keys),
                "load_unexpected": list(missing.unexpected_keys),
                "forward": {k: max_abs_diff(values_m[k], values_o[k]) for k in values_m},
                "grad": {k: max_abs_diff(grads_m[k], grads_o[k]) for k in grads_m},
                "grad_keys_main": sorted(grads_m), "grad_keys_ours": sorted(grads_o),
                "value_scale": max(v.abs().max().item() for v in values_m.values()),
                "grad_scale": max(g.abs().max().item() for g in grads_m.values()),
                "doubly_stochastic_err": max_abs_diff(values_o["h_res"].sum(-1),
                                                      torch.ones(seq, batch, n)),
            })
    return {"cases": cases}


# ------------------------------------------------------------- main's layer on our runtimes
LAYER_SHAPE = dict(num_layers=4, num_attention_heads=4, use_cpu_initialization=True, attention_dropout=0.0, bias_dropout_fusion=False,
                   normalization="RMSNorm", gradient_accumulation_fusion=False,
                   masked_softmax_fusion=False, enable_mhc_connections=True,
                   mhc_num_residual_streams=4)


def _init_model_parallel() -> None:
    """One gloo process, tensor/pipeline sizes 1: megatron's parallel state on CPU."""
    import torch
    from megatron.core import parallel_state

    from mhc_cg.training.pipeline.driver import free_port

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    # what model_parallel_cuda_manual_seed registers; its CUDA state is empty under the CPU shims
    # (attention dropout is 0, so no draw reads it)
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = \
        torch.empty(0, dtype=torch.uint8)


def _main_blocks(hidden: int, hidden_dropout: float, block_size: int):
    """``main``'s TransformerBlock twice with the same weights: no recompute, and the peer
    (``recompute_granularity: selective``, ``recompute_modules: [mhc]``, ``mhc_recompute_layer_num``)."""
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_integration.main_branch import main_mhc_layer_spec

    shape = dict(LAYER_SHAPE, hidden_size=hidden, ffn_hidden_size=2 * hidden)
    plain_cfg = TransformerConfig(**shape, hidden_dropout=hidden_dropout)
    peer_cfg = TransformerConfig(**shape, hidden_dropout=hidden_dropout,
                                 recompute_granularity="selective", recompute_modules=["mhc"],
                                 mhc_recompute_layer_num=block_size)
    torch.manual_seed(0)
    plain = TransformerBlock(plain_cfg, main_mhc_layer_spec()).train()
    peer = TransformerBlock(peer_cfg, main_mhc_layer_spec()).train()
    peer.load_state_dict(plain.state_dict(), strict=True)
    with torch.no_grad():  # move the mHC parameters off their init so every mapping matters
        for name, p in plain.named_parameters():
            if "hyper_connection" in name:
                p.add_(0.3 * torch.randn_like(p))
    peer.load_state_dict(plain.state_dict(), strict=True)
    return plain, peer


def _train_step(block, forward, x0, seed: int, measure=None):
    """One forward/backward from fresh grads; (output, input grad, param grads, saved bytes)."""
    import torch

    block.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    saved: list = []
    torch.manual_seed(seed)  # the same dropout masks in every mode
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = forward(x)
    nbytes = (measure or _saved_bytes)(block, saved)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    return out.detach(), x.grad.clone(), grads, nbytes


def _saved_bytes(block, saved, exclude=()) -> int:
    """Bytes of the distinct storages autograd keeps from this forward to its backward, parameters
    excluded (a storage the recompute freed counts zero)."""
    params = {p.untyped_storage()._cdata for p in block.parameters()}
    seen, total = set(), 0
    for t in saved:
        storage = t.untyped_storage()
        if storage._cdata in params or storage._cdata in seen or storage.data_ptr() in exclude:
            continue
        seen.add(storage._cdata)
        total += storage.nbytes()
    return total


def _compare(reference, other) -> dict:
    """Bit-for-bit comparison of two ``_train_step`` results (and the largest difference)."""
    import torch

    out0, dx0, grads0, _ = reference
    out1, dx1, grads1, _ = other
    common = [k for k in grads0 if k in grads1]
    return {"out_equal": torch.equal(out0, out1), "dx_equal": torch.equal(dx0, dx1),
            "grad_names_equal": sorted(grads0) == sorted(grads1),
            "grads_not_equal": [k for k in common if not torch.equal(grads0[k], grads1[k])],
            "max_abs_grad_diff": max([max_abs_diff(dx0, dx1)]
                                     + [max_abs_diff(grads0[k], grads1[k]) for k in common])}


def main_layer_job(seq: int = 8, batch: int = 2, hidden: int = 32, block_size: int = 2) -> dict:
    """``main``'s ``HyperConnectionTransformerLayer`` (its own layer spec, its own block) on
    ``mhc_cg``'s block recompute, beside ``main``'s no-recompute path and its ``[mhc]`` recompute.

    Eager (dropout 0.1, torch's generator reseeded per step) and static buffers with tape recompute
    graphs (dropout 0, two microbatches in flight): output, input gradient and every parameter
    gradient compared bit for bit; bytes autograd keeps per layer in each mode.
    """
    import torch

    from megatron_integration.main_branch import MainBlock, StaticMainBlock
    from mhc_cg.core.errors import StaticRecomputeError
    from mhc_cg.runtime.graphs import get_backend

    _init_model_parallel()
    result = {}
    layers = LAYER_SHAPE["num_layers"]
    for label, dropout in (("eager", 0.1), ("static", 0.0)):
        plain, peer = _main_blocks(hidden, dropout, block_size)
        torch.manual_seed(1)
        x0 = torch.randn(seq, batch, hidden)
        # causal, True = masked out; passed explicitly: main's default mask is built on "cuda"
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)
        none = _train_step(plain, lambda x: plain(x, attention_mask=mask), x0, seed=7)
        main_mhc = _train_step(peer, lambda x: peer(x, attention_mask=mask), x0, seed=7)
        entry = {"peer_vs_none": _compare(none, main_mhc)}
        if label == "eager":
            ours = MainBlock(plain)

            def measure(block, saved):
                entry["freed_outputs"] = sum(o.untyped_storage().nbytes() == 0
                                             for m in ours.managers for c in m.checkpoints
                                             for o in c.outputs)
                return _saved_bytes(block, saved)

            run = _train_step(plain, lambda x: ours.forward_block_recompute(x, mask, block_size),
                              x0, seed=7, measure=measure)
            entry["managers"] = len(ours.managers)
            # F's skipped biases went through H_post beside F's output (main's bias handling)
            entry["biases_seen"] = sum(sub.bias is not None for steps in ours.steps
                                       for sub in (steps.attention, steps.mlp))
            try:  # main's dropout is torch's: static buffers must refuse it
                StaticMainBlock(plain, seq_length=seq, micro_batch_size=batch)
                entry["static_with_torch_dropout"] = "accepted"
            except StaticRecomputeError as err:
                entry["static_with_torch_dropout"] = str(err)
            entry["checkpoints"] = sum(len(m.checkpoints) for m in ours.managers)
            bytes_ours = {"saved": run[3] / layers}
        else:
            plain.config.mhc_recompute_layer_num = block_size
            static = StaticMainBlock(plain, seq_length=seq, micro_batch_size=batch, capacity=2)
            static.capture_recompute_graphs(get_backend("tape"))
            runtime = static.runtime
            pset_ptrs = {p for s in runtime.sets.all_sets() for p in s.data_ptrs()}
            arena_ptr = runtime.arena.buffer.untyped_storage().data_ptr()
            other = []

            def measure(block, saved):
                entry["saved_in_static_buffers"] = sum(
                    runtime.arena.contains(t) or t.untyped_storage().data_ptr() in pset_ptrs
                    for t in saved)
                nbytes = _saved_bytes(block, saved, exclude=pset_ptrs | {arena_ptr})
                # a second microbatch in flight before the first one's backward
                other.append(static(torch.randn(seq, batch, hidden),
                                    attention_mask=mask))
                entry["sets_in_use_in_flight"] = runtime.sets.in_use
                return nbytes

            run = _train_step(plain, lambda x: static(x, attention_mask=mask), x0, seed=7,
                              measure=measure)
            entry["sets_in_use_after_first_backward"] = runtime.sets.in_use
            other[0].sum().backward()
            entry["sets_in_use_after_both"] = runtime.sets.in_use
            entry["trace"] = list(runtime.trace)
            bytes_ours = {"saved": run[3] / layers,
                          "persistent_set_per_microbatch": runtime.sets.nbytes_per_set / layers,
                          "arena_per_rank": runtime.arena.nbytes / layers}
        entry["ours_vs_none"] = _compare(none, run)
        entry["ours_vs_peer"] = _compare(main_mhc, run)
        entry["bytes_per_layer"] = {"main_none": none[3] / layers,
                                    "main_mhc_recompute": main_mhc[3] / layers,
                                    **{f"ours_{k}": v for k, v in bytes_ours.items()}}
        result[label] = entry
    return result


JOBS = {"hyper_connection": hyper_connection_job, "main_layer": main_layer_job}


def _child(argv: list[str]) -> None:
    job, out, kwargs = argv[0], Path(argv[1]), json.loads(argv[2])
    install_cpu_shims()
    import megatron.core

    snapshot = Path(megatron.core.__file__).resolve().parents[2]
    if snapshot != Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve():
        raise SystemExit(f"megatron.core resolved to {megatron.core.__file__}, not the snapshot")
    result = JOBS[job](**kwargs)
    result["megatron_core"] = megatron.core.__file__
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1:])
