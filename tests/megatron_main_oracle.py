"""Megatron-LM ``main``'s own mHC as a test oracle, run in a subprocess (and ``dev``'s, whose
``HyperConnectionModule`` applies H_res transposed: the ``dev_hyper_connection`` job).

No megatron-core release has mHC yet, so ``../shared/third_party/megatron-lm-main-*.tar.gz`` (a
source snapshot of Megatron-LM ``main``'s ``megatron/core``) is extracted into a scratch directory
and imported by a *separate* Python process whose ``PYTHONPATH`` puts it first: in that process
``import megatron.core`` is ``main``'s, while the pinned megatron-core of the test process is
untouched (``../shared/third_party/megatron-lm-dev-*.tar.gz`` likewise for ``dev``, through
``snapshot_archive("dev")``). Finding the snapshot and running the child are the shipped
:mod:`mhc_cg.lab.megatron_harness.child_process`'s (``mhc-cg megatron`` uses the same).

The parent side (``snapshot_archive``, ``extract_snapshot``, ``run_job``) is imported by the tests.
The child side is this file run as a script: ``python megatron_main_oracle.py JOB OUT.json ARGS``
installs the CPU shims (:mod:`mhc_cg.lab.megatron_harness.megatron_on_cpu`), runs one job (a function of this
module named in ``JOBS``) and writes its JSON result to ``OUT.json``. The jobs measure; the tests
assert. ``run_job(None, ...)`` runs a job on the pinned megatron-core instead of ``main``; jobs
that use megatron's TE graph helper load the TransformerEngine stand-in (``mhc_cg/lab/megatron_harness/te_on_tape``)
after megatron.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mhc_cg.lab.megatron_harness.child_process import (ARCHIVE_GLOB, archive_glob,  # noqa: F401
                                               extract_snapshot, load_te_standin, run_child,
                                               snapshot_archive, third_party_dirs)

HERE = Path(__file__).resolve().parent
STANDIN = HERE.parent / "mhc_cg" / "lab" / "megatron_harness" / "te_on_tape"
CHILD_TIMEOUT_S = 300
HELPER_JOBS = ("main_helper", "core_helper")  # jobs that run megatron's TE graph helper


# ------------------------------------------------------------------------------ parent side
def skip_reason(branch: str = "main") -> str:
    return (f"no Megatron-LM {branch} snapshot ({archive_glob(branch)}) in "
            f"{' or '.join(str(d) for d in third_party_dirs())}")


def require_snapshot(branch: str = "main") -> Path:
    """The branch's snapshot archive; the calling test is skipped without one."""
    import pytest

    archive = snapshot_archive(branch)
    if archive is None:
        pytest.skip(skip_reason(branch))
    return archive


def extracted_snapshot(branch: str, tmp_path_factory) -> Path:
    """The branch's snapshot extracted into a scratch folder (skipped without one; a failure
    when triton, which the branch's megatron.core imports, is missing)."""
    import importlib.util

    import pytest

    archive = require_snapshot(branch)
    if importlib.util.find_spec("triton") is None:
        pytest.fail(f"Megatron-LM {branch}'s megatron.core imports triton: pip install triton "
                    f"(it is in the test extras)")
    return extract_snapshot(archive, tmp_path_factory.mktemp(f"megatron_{branch}"))


# fused_block_job, judged: per parameter kind (the name less its layer), mhc_cg's fused error
# against the fp64 truth, relative to the kind's largest truth, is at most FUSED_FACTOR times
# Megatron's own error there (same dtype), or FUSED_FLOOR. Megatron's native fp32 path itself is
# up to 3e-3 off the truth on alpha_res, a sum over tokens with cancellation (measured, both
# branches); the fused path's worst is 2.1e-4 (dev, alpha_pre), 5.8 times native's worst ratio.
# In bf16 native is up to 42 times its alpha_res gradient off (main's, its mHC parameters in
# bf16), the fused path at most 20 times (dev's, 1.8 times native's there).
FUSED_FACTOR = 8.0
FUSED_FLOOR = 1e-4


def fused_block_verdict(result: dict) -> tuple[list[str], dict]:
    """``(kinds off the bound, {kind: (fused, native) relative errors})`` of a fused_block
    result (see the comment above)."""
    import re

    worst: dict[str, list[float]] = {}
    for name, e in result["errors"].items():
        kind = re.sub(r"layers\.\d+\.", "", name)
        w = worst.setdefault(kind, [0.0, 0.0, 0.0])
        w[0] = max(w[0], e["fused_error"])
        w[1] = max(w[1], e["native_error"])
        w[2] = max(w[2], e["truth_max"])
    figures = {k: (f / s, n / s) for k, (f, n, s) in worst.items() if s > 0}
    off = [f"{k}: fused {f:.2g}, native {n:.2g}" for k, (f, n) in figures.items()
           if f > max(FUSED_FACTOR * n, FUSED_FLOOR)]
    return off, figures


# output and input gradient: |fused - native| at most this of the largest value (fp32: the
# kernels' rounding, measured <= 2e-7; bf16: the peers' comparison's bound, measured <= 0.8 %)
FUSED_OUTPUT_TOLERANCE = {"float32": 1e-6, "bfloat16": 2.0 ** -5}


def assert_fused_block(results: dict, branch: str) -> None:
    """What ``fused_block_job`` must show for ``branch``'s block, at every dtype it ran."""
    assert results["cases"]
    for dtype, result in results["cases"].items():
        _assert_fused_case(result, branch, FUSED_OUTPUT_TOLERANCE[dtype])


def _assert_fused_case(result: dict, branch: str, tolerance: float) -> None:
    """Fused kernels in every sublayer, in the branch's arithmetic, every parameter's gradient,
    the errors against fp64 within the bound (:func:`fused_block_verdict`), output and input
    gradient within ``tolerance`` of native, and the recompute runs equal to the fused eager run
    bit for bit."""
    assert result["fused_sublayers"] == 8
    assert result["arithmetic"] == branch
    assert result["missing_grads"] == []
    off, _ = fused_block_verdict(result)
    assert not off, off
    for name in ("output", "input_grad"):
        e = result["errors"][name]
        assert e["fused_vs_native"] <= tolerance * e["truth_max"], (name, e)
    for run, compared in result["recompute_vs_eager"].items():
        assert compared["out_equal"] and compared["dx_equal"], run
        assert compared["grad_names_equal"] and compared["grads_not_equal"] == [], (run, compared)


def run_job(snapshot_root: Path | None, job: str, **kwargs) -> dict:
    """Run ``job(**kwargs)`` in a fresh process that imports the snapshot's megatron.core (the
    pinned megatron-core when ``snapshot_root`` is ``None``); its result."""
    scratch = snapshot_root.parent if snapshot_root is not None else Path(os.environ.get(
        "TMPDIR", "/tmp"))
    out = scratch / f"{job}-{os.getpid()}.json"
    first = [snapshot_root] if snapshot_root is not None else []
    status, output = run_child([str(Path(__file__).resolve()), job, str(out), json.dumps(kwargs),
                                str(snapshot_root or "")], first, timeout=CHILD_TIMEOUT_S)
    if status != 0:
        raise AssertionError(f"oracle job {job!r} failed (exit {status}):\n{output[-8000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


# ------------------------------------------------------------------------------- child side
def max_abs_diff(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def _their_modules(dtypes: list[str], streams: list[int], hidden: int, seed: int,
                   **mhc_fields):
    """``(dtype name, dtype, n, the branch's HyperConnectionModule)`` for each case, built from
    the branch's own config (``mhc_fields``: its names for mHC on, ``"{n}"`` standing for the
    case's stream count), seeded per n, its parameters moved off the init so every mapping
    matters."""
    import torch

    from megatron.core.transformer.hyper_connection import HyperConnectionModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for n in streams:
            torch.manual_seed(seed + n)
            fields = {k: (n if v == "{n}" else v) for k, v in mhc_fields.items()}
            config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                                       mhc_sinkhorn_iterations=20, mhc_init_gating_factor=0.01,
                                       params_dtype=dtype, use_cpu_initialization=True, **fields)
            theirs = HyperConnectionModule(config, layer_number=1).to(dtype)
            with torch.no_grad():
                for p in theirs.parameters():
                    p.add_(0.3 * torch.randn_like(p))
            yield dtype_name, dtype, n, theirs


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

    from mhc_cg.ops.hyper_connection import HyperConnection

    cases = []
    modules = _their_modules(dtypes, streams, hidden, 1000, enable_mhc_connections=True,
                             mhc_num_residual_streams="{n}")
    for dtype_name, dtype, n, theirs in modules:
        config = theirs.config
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


def dev_hyper_connection_job(streams: list[int], dtypes: list[str], seq: int = 5, batch: int = 3,
                             hidden: int = 16) -> dict:
    """Megatron-LM ``dev``'s ``HyperConnectionModule`` (which applies ``H_res^T``) beside
    ``HyperConnection(h_res_transposed=True)``, non-fused and fused (the torch reference), and
    beside ``HyperConnection()`` (main's layout), on the same ``state_dict`` and input.

    Dev's module differs from main's in more than the layout: an additive eps (1e-6) in its
    Sinkhorn and in H_pre, zeroed here on the instance (``sinkhorn_eps``, ``compute_h_eps``) so
    that what remains is the layout; and its projection and norm run in fp32 whatever the dtype
    (its fp64 mappings carry fp32 rounding). Compared: the whole sublayer (mappings, aggregate,
    dev's ``fused_h_res_h_post_bda`` at dropout 0, its ``h_post_bda``) with dev's module as it
    is (``as_is``) and with its ``_projection_and_get_norm`` alone replaced by the same math in
    the input's dtype (``projection_in_dtype``); and the layout's step alone, dev's
    ``apply_h_res`` and ``fused_h_res_h_post_bda`` given dev's own ``h_res`` and ``h_post``.
    Largest absolute differences of values and gradients (input, F's bias, parameters; for the
    step, its every input).
    """
    import math

    import torch

    from mhc_cg.ops.hyper_connection import HyperConnection

    cases = []
    modules = _their_modules(dtypes, streams, hidden, 2000, enable_hyper_connections=True,
                             num_residual_streams="{n}")
    for dtype_name, dtype, n, theirs in modules:
        config = theirs.config
        theirs.sinkhorn_eps = 0.0
        theirs.compute_h_eps = 0.0
        with torch.no_grad():  # res logits spread: H_res far from symmetric
            theirs.bias[2 * n:].add_(1.5 * torch.randn(n * n, dtype=dtype))
        ours = {}
        for name, transposed in (("dev_layout", True), ("main_layout", False)):
            ours[name] = HyperConnection(hidden, n, config.mhc_sinkhorn_iterations,
                                         config.mhc_init_gating_factor, kernels="torch",
                                         h_res_transposed=transposed).to(dtype)
            ours[name].load_state_dict(theirs.state_dict(), strict=True)
        f_weight = torch.randn(hidden, hidden, dtype=dtype) / hidden ** 0.5
        f_bias = torch.randn(hidden, dtype=dtype)
        x0 = torch.randn(seq, batch, n * hidden, dtype=dtype)
        probe = torch.randn(seq, batch, n * hidden, dtype=dtype)

        def sublayer_f(agg):
            return torch.tanh(agg @ f_weight)

        def run(module, how: str):
            module.zero_grad(set_to_none=True)  # ours["dev_layout"] runs twice
            x = x0.clone().requires_grad_()
            bias = f_bias.clone().requires_grad_()
            if how == "dev":
                agg, h_res, h_post, residual = module(x)
                out = module.fused_h_res_h_post_bda(h_res, residual, h_post,
                                                    (sublayer_f(agg), bias), 0.0, True, False)
            elif how == "fused":
                fn_input, state, x_on = module.pre(x, None, 0.0)
                out = module.post(x_on, state, sublayer_f(fn_input) + bias, None, 0.0, 0)
            else:
                h_pre, h_post, h_res = module.compute_mappings(x)
                y = sublayer_f(module.aggregate(x, h_pre))
                out = module.apply_h_res(h_res, x) + module.apply_h_post(
                    y + bias.expand_as(y), h_post)
            (out * probe).sum().backward()
            grads = {"x": x.grad, "f_bias": bias.grad,
                     **{name: p.grad for name, p in module.named_parameters()}}
            return out.detach(), grads

        def projection_in_dtype(x):
            r = 1.0 / (x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
                       + theirs.norm_eps)
            return theirs.mapping_proj(x), r

        ran = {name: run(module, how) for name, module, how in (
            ("ours_dev_layout", ours["dev_layout"], "composed"),
            ("ours_dev_layout_fused", ours["dev_layout"], "fused"),
            ("ours_main_layout", ours["main_layout"], "composed"))}
        compared, scales = {}, {}
        for variant in ("as_is", "projection_in_dtype"):
            if variant == "projection_in_dtype":
                theirs._projection_and_get_norm = projection_in_dtype
            out_d, grads_d = run(theirs, "dev")
            scales[variant] = {"value": out_d.abs().max().item(),
                               "grad": max(g.abs().max().item() for g in grads_d.values())}
            compared[variant] = {
                name: {"out": max_abs_diff(out_d, out_o),
                       "grad": {k: max_abs_diff(grads_d[k], grads_o[k]) for k in grads_d},
                       "grad_keys_equal": sorted(grads_d) == sorted(grads_o)}
                for name, (out_o, grads_o) in ran.items()}

        # the layout's step alone, from dev's own mappings
        with torch.no_grad():
            _, h_res0, h_post0, _ = theirs(x0)
        y0 = sublayer_f(torch.randn(seq, batch, hidden, dtype=dtype))

        def step(module, dev: bool):
            leaves = {"h_res": h_res0.clone(), "x": x0.clone(), "h_post": h_post0.clone(),
                      "y": y0.clone(), "f_bias": f_bias.clone()}
            for t in leaves.values():
                t.requires_grad_()
            h_res, x, h_post, y, bias = leaves.values()
            if dev:
                mixed = module.apply_h_res(h_res, x)
                out = module.fused_h_res_h_post_bda(h_res, x, h_post, (y, bias), 0.0, True,
                                                    False)
            else:
                mixed = module.apply_h_res(h_res, x)
                out = mixed + module.apply_h_post(y + bias.expand_as(y), h_post)
            (out * probe + mixed * probe.flip(-1)).sum().backward()
            return {"out": out.detach(), "mixed": mixed.detach()}, \
                {k: t.grad for k, t in leaves.items()}

        values_d, step_grads_d = step(theirs, True)
        step_diffs = {}
        for name in ("dev_layout", "main_layout"):
            values_o, step_grads_o = step(ours[name], False)
            step_diffs[name] = {
                "values": {k: max_abs_diff(values_d[k], values_o[k]) for k in values_d},
                "grad": {k: max_abs_diff(step_grads_d[k], step_grads_o[k])
                         for k in step_grads_d}}
        cases.append({
            "n": n, "dtype": dtype_name,
            "h_res_asymmetry": (h_res0 - h_res0.transpose(-1, -2)).abs().max().item(),
            "scale": scales,
            "step_value_scale": max(v.abs().max().item() for v in values_d.values()),
            "step_grad_scale": max(g.abs().max().item() for g in step_grads_d.values()),
            "sublayer": compared, "step": step_diffs,
        })
    return {"cases": cases, "sinkhorn": _dev_sinkhorn_cases(dtypes, streams)}


def _dev_sinkhorn_cases(dtypes: list[str], streams: list[int], tokens: int = 7) -> list[dict]:
    """Dev's own Sinkhorn (``native_sinkhorn``: its ``SinkhornKnopp`` Function, eps as dev sets
    it) beside the reference's explicit forward and backward in either arithmetic, on logits
    spread as trained ones get; largest absolute differences, and the scales."""
    import torch
    from megatron.core.transformer.hyper_connection import native_sinkhorn

    from mhc_cg.ops.kernels import reference

    cases = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for n in streams:
            for iterations in (1, 2, 20):
                generator = torch.Generator().manual_seed(n * 100 + iterations)
                logits = 3.0 * torch.randn(tokens, n, n, dtype=dtype, generator=generator)
                grad = torch.randn(tokens, n, n, dtype=dtype, generator=generator)
                leaf = logits.clone().requires_grad_()
                theirs = native_sinkhorn(leaf, iterations)
                theirs.backward(grad)
                diffs = {}
                for arithmetic in ("dev", "main"):
                    out = reference.sinkhorn(logits, iterations, arithmetic)
                    back = reference.sinkhorn_backward(logits, grad, iterations, arithmetic)
                    diffs[arithmetic] = {"out": max_abs_diff(theirs.detach(), out),
                                         "grad": max_abs_diff(leaf.grad, back)}
                cases.append({"dtype": dtype_name, "n": n, "iterations": iterations,
                              "out_scale": theirs.abs().max().item(),
                              "grad_scale": leaf.grad.abs().max().item(), **diffs})
    return cases


# ------------------------------------------------------------- main's layer on our runtimes
LAYER_SHAPE = dict(num_layers=4, num_attention_heads=4, use_cpu_initialization=True, attention_dropout=0.0, bias_dropout_fusion=False,
                   normalization="RMSNorm", gradient_accumulation_fusion=False,
                   masked_softmax_fusion=False, enable_mhc_connections=True,
                   mhc_num_residual_streams=4)


def _init_model_parallel() -> None:
    """One gloo process, tensor/pipeline sizes 1: megatron's parallel state on CPU."""
    from mhc_cg.lab.megatron_harness.training import init_ranks

    init_ranks(cpu=True, seed=0)


def _main_blocks(hidden: int, hidden_dropout: float, block_size: int):
    """``main``'s TransformerBlock twice with the same weights: no recompute, and the peer
    (``recompute_granularity: selective``, ``recompute_modules: [mhc]``, ``mhc_recompute_layer_num``)."""
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_integration.layers.main_layer import main_mhc_layer_spec

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


def _saved_bytes(block, saved, exclude=frozenset()) -> int:
    """Bytes of the distinct storages autograd keeps from this forward to its backward, parameters
    and the storages in ``exclude`` left out (a storage the recompute freed counts zero)."""
    from mhc_cg.core.storage import distinct_storage_bytes, storage_id

    return distinct_storage_bytes(saved, {storage_id(p) for p in block.parameters()} | set(exclude))


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

    from megatron_integration.capture.static_block import StaticMainBlock
    from megatron_integration.layers.main_layer import MainBlock
    from mhc_cg.core.errors import StaticRecomputeError
    from mhc_cg.lab.emulation.backends import get_backend
    from mhc_cg.core.storage import storage_id

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
            static_storages = {storage_id(t) for s in runtime.sets.all_sets() for t in s.tensors()}
            static_storages.add(storage_id(runtime.arena.buffer))
            other = []

            def measure(block, saved):
                entry["saved_in_static_buffers"] = sum(
                    runtime.arena.contains(t) or t.untyped_storage().data_ptr() in pset_ptrs
                    for t in saved)
                nbytes = _saved_bytes(block, saved, exclude=static_storages)
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


def _branch_block(branch: str, hidden: int, dtype, block_size: int):
    """The branch's own TransformerBlock of mHC layers (its spec, its config names), dropout 0,
    its mHC parameters moved off their init and the res logits spread (H_res far from
    symmetric)."""
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(LAYER_SHAPE, hidden_size=hidden, ffn_hidden_size=2 * hidden, hidden_dropout=0.0,
                 params_dtype=dtype, mhc_recompute_layer_num=block_size,
                 bf16=dtype == torch.bfloat16)
    if branch == "dev":
        from megatron_integration.layers.dev_layer import dev_mhc_layer_spec

        del shape["enable_mhc_connections"], shape["mhc_num_residual_streams"]
        shape.update(enable_hyper_connections=True, num_residual_streams=4)
        spec = dev_mhc_layer_spec(cpu=True)
    else:
        from megatron_integration.layers.main_layer import main_mhc_layer_spec

        spec = main_mhc_layer_spec()
    torch.manual_seed(0)
    config = TransformerConfig(**shape)
    block = TransformerBlock(config, spec).train()
    if config.bf16:  # as training holds the parameters (dev keeps its mHC ones in fp32)
        from megatron.core.transformer.module import Float16Module

        Float16Module(config, block)
    else:
        block = block.to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "hyper_connection" in name:
                p.add_(0.3 * torch.randn_like(p))
                if name.endswith(".bias") and p.numel() == 24:
                    p[8:].add_(1.5 * torch.randn_like(p[8:]))
    return block


def _in_fp64_projection(block) -> None:
    """Dev's mapping projection in the stream's own dtype (dev casts it to fp32 whatever the
    dtype): dev's arithmetic, all in fp64, as the truth fp32 runs are measured against."""
    import math

    for name, module in block.named_modules():
        if name.endswith("hyper_connection") and hasattr(module, "_projection_and_get_norm"):
            def projection(x, module=module):
                r = 1.0 / (x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1]) + module.norm_eps)
                return module.mapping_proj(x), r

            module._projection_and_get_norm = projection


def fused_block_job(branch: str, seq: int = 8, batch: int = 2, hidden: int = 32,
                    block_size: int = 2, dtypes: tuple = ("float32",)) -> dict:
    """The branch's own mHC block with mhc_cg's fused kernels (the torch reference here) beside
    its native ops, on the same weights and input, in each of ``dtypes`` (``{"cases": {dtype:
    result}}``).

    Runs: ``native`` (the block's own forward, no recompute); ``fused_eager`` (each layer's
    sublayers through the fused step adapters, no recompute); ``fused_block_recompute`` (mhc_cg's
    eager block recompute of those adapters) and ``fused_static`` (the static runtime with tape
    recompute graphs); and ``truth``, the native block in fp64 (dev's projection in fp64 too).
    Measured per tensor (output, input gradient, every parameter gradient): the largest
    difference of ``native`` and of ``fused_eager`` from the truth, the truth's largest
    magnitude, and the difference between the two fp32 runs; whether the recompute runs equal
    ``fused_eager`` bit for bit.
    """
    import torch

    _init_model_parallel()
    return {"cases": {name: _fused_block_case(branch, getattr(torch, name), seq, batch, hidden,
                                              block_size) for name in dtypes}}


def _fused_block_case(branch: str, dtype, seq: int, batch: int, hidden: int,
                      block_size: int) -> dict:
    """:func:`fused_block_job` at one dtype."""
    import torch

    from mhc_cg.lab.emulation.backends import get_backend
    from mhc_cg.model.sublayer import sublayer_forward
    from mhc_cg.recompute.block_recompute import run_recompute_blocks
    from megatron_integration.capture.static_block import StaticDevBlock, StaticMainBlock
    from megatron_integration.layers.dev_layer import layer_steps_of
    from megatron_integration.layers.main_layer import MainBlock

    block = _branch_block(branch, hidden, dtype, block_size)
    truth_block = _branch_block(branch, hidden, torch.float64, block_size)
    truth_block.load_state_dict(block.state_dict(), strict=True)
    _in_fp64_projection(truth_block)
    steps_type = layer_steps_of(block.config, True)
    if branch == "dev":
        streams_in, streams_out = block.preprocess_for_layer_schedule, block.postprocess_for_layer_schedule
    else:
        main = MainBlock(block)
        streams_in, streams_out = main.streams_in, main.streams_out
    torch.manual_seed(1)
    x0 = torch.randn(seq, batch, hidden).to(dtype)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)

    def fused_eager(x):
        x = streams_in(x)
        for layer in block.layers:
            steps = steps_type(layer, mask)
            x = sublayer_forward(steps.mlp, sublayer_forward(steps.attention, x, None), None)
        return streams_out(x)

    def fused_block_recompute(x):
        steps = [steps_type(layer, mask) for layer in block.layers]
        return streams_out(run_recompute_blocks(steps, streams_in(x), None, block_size, []))

    static_type = StaticDevBlock if branch == "dev" else StaticMainBlock
    static = static_type(block, seq_length=seq, micro_batch_size=batch, fused_mhc=True)
    static.capture_recompute_graphs(get_backend("tape"))
    truth = _train_step(truth_block, lambda x: truth_block(x, attention_mask=mask), x0.double(),
                        seed=7)
    runs = {"native": _train_step(block, lambda x: block(x, attention_mask=mask), x0, seed=7),
            "fused_eager": _train_step(block, fused_eager, x0, seed=7),
            "fused_block_recompute": _train_step(block, fused_block_recompute, x0, seed=7),
            "fused_static": _train_step(block, lambda x: static(x, attention_mask=mask), x0,
                                        seed=7)}

    def tensors(run):
        out, dx, grads, _ = run
        return {"output": out, "input_grad": dx, **grads}

    exact, native, fused = (tensors(r) for r in (truth, runs["native"], runs["fused_eager"]))
    errors = {name: {"truth_max": t.abs().max().item(),
                     "native_error": max_abs_diff(native[name], t),
                     "fused_error": max_abs_diff(fused[name], t),
                     "fused_vs_native": max_abs_diff(fused[name], native[name])}
              for name, t in exact.items() if name in fused}
    return {"errors": errors, "missing_grads": sorted(set(exact) - set(fused)),
            "fused_sublayers": sum(s.fused is True for st in static.steps
                                   for s in (st.attention, st.mlp)),
            "arithmetic": static.steps[0].attention.hc.arithmetic,
            "recompute_vs_eager": {name: _compare(runs["fused_eager"], runs[name])
                                   for name in ("fused_block_recompute", "fused_static")}}


# ------------------------------------------- megatron's TE graph helper drives the runtime
MAIN_CONFIG = HERE.parent / "configs" / "megatron_main_mhc.yaml"


def _shaped(base, shape: dict):
    """``base`` (a RunConfig) with ``shape``'s model and train fields."""
    model = {k: v for k, v in shape.items() if k in ("num_layers", "recompute_layers")}
    train = {k: v for k, v in shape.items() if k in ("num_microbatches", "steps")}
    return base.replace(model=model, train=train)


def main_helper_job(shapes: list[dict]) -> dict:
    """Megatron-LM main's GPT under its TE graph helper, for each shape: main's three runs and
    mhc_cg's (``mhc_cg.lab.megatron_harness.runs.rank_runs``, what ``mhc-cg megatron --compare``
    runs), from the shipped config with the shape's layers, block size and microbatches: per run,
    the one rank's measurements."""
    from mhc_cg.config import load_config
    from mhc_cg.lab.megatron_harness.runs import compare_ranks, rank_runs, runs_of

    _init_model_parallel()
    base = load_config(MAIN_CONFIG).replace(train={"device": "cpu"})
    cases = []
    for shape in shapes:
        per_rank = rank_runs(_shaped(base, shape), list(runs_of("main")), "main", cpu=True)
        verdict = compare_ranks([per_rank], "main")
        cases.append(dict(shape=shape, runs=per_rank, bit_identical=verdict["bit_identical"],
                          mismatches=verdict["mismatches"]))
    return {"cases": cases}


CORE_RUNS = ("core_eager_none", "core_eager_block", "mhc_cg")


def _core_gpt(run: str, shape: dict, setup):
    """megatron-core 0.16.1's GPTModel with our mHC layer and block (``MHCTransformerBlock``
    replaces the plain decoder GPTModel builds, for the stream boundaries), counter dropout 0.1,
    bf16, DDP-wrapped; under the TE graph helper for ``mhc_cg``."""
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_integration.capture.te_graph_helper import make_te_graph_helper
    from mhc_cg.lab.emulation.backends import get_backend
    from megatron_integration.layers.mhc_layer import MHCTransformerBlock, get_mhc_layer_spec
    from mhc_cg.lab.megatron_harness.training import wrap_for_training
    from megatron_integration.config.transformer_config import MHCTransformerConfig

    graphed = run == "mhc_cg"
    config = MHCTransformerConfig(
        num_layers=shape["num_layers"], hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        hidden_dropout=0.1, attention_dropout=0.0, mhc_dropout_impl="counter",
        enable_hyper_connections=True, num_residual_streams=4,
        mhc_recompute_layer_num=None if run == "core_eager_none" else shape["recompute_layers"],
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True,
        use_cpu_initialization=True, normalization="RMSNorm", bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        cuda_graph_impl="transformer_engine" if graphed else "none",
        cuda_graph_scope=["attn", "mhc_recompute"] if graphed else [], cuda_graph_warmup_steps=1)
    torch.manual_seed(setup.seed)
    spec = get_mhc_layer_spec(cpu_attention=True)
    model = GPTModel(config, spec, vocab_size=setup.vocab_size,
                     max_sequence_length=setup.seq_length)
    model.decoder = MHCTransformerBlock(config, spec, pre_process=True, post_process=True)
    chunk = wrap_for_training(model, config)
    helper = (make_te_graph_helper([chunk], config, setup.seq_length, setup.micro_batch_size,
                                   backend=get_backend("tape")) if graphed else None)
    return chunk, helper


def core_helper_job(shapes: list[dict]) -> dict:
    """megatron-core 0.16.1 (pinned) with our own mHC layer: eager without recompute, eager block
    recompute, and mhc_cg under megatron-core's TE graph helper, for each shape."""
    from megatron_integration.capture.te_graph_helper import chunk_decoder
    from mhc_cg.lab.megatron_harness.step_probe import graph_states
    from mhc_cg.lab.megatron_harness.training import TrainSetup, train_run, use_microbatches

    _init_model_parallel()
    cases = []
    for shape in shapes:
        setup = TrainSetup(vocab_size=64, seq_length=16, micro_batch_size=2,
                           num_microbatches=shape["num_microbatches"], steps=shape["steps"],
                           lr=0.05, seed=1234)
        use_microbatches(setup)
        runs = {}
        for run in CORE_RUNS:
            chunk, helper = _core_gpt(run, shape, setup)
            runs[run] = train_run(run, [chunk], setup, helper=helper, cpu=True)
            runs[run]["recompute_graphs"] = [list(vars(key).values()) for key in
                                             getattr(helper, "mhc_recompute_graphs", {})]
            runs[run]["order"] = getattr(helper, "mhc_order", None)
            runs[run]["graph_inputs"] = [list(state.static_inputs[0].shape)
                                         for layer in chunk_decoder(chunk).layers
                                         for state in graph_states(layer)]
        cases.append({"shape": shape, "runs": runs})
    return {"cases": cases}


JOBS = {"hyper_connection": hyper_connection_job, "dev_hyper_connection": dev_hyper_connection_job,
        "main_layer": main_layer_job, "fused_block": fused_block_job,
        "main_helper": main_helper_job, "core_helper": core_helper_job}


def _child(argv: list[str]) -> None:
    job, out, kwargs, snapshot = argv[0], Path(argv[1]), json.loads(argv[2]), argv[3]
    from mhc_cg.lab.megatron_harness.megatron_on_cpu import install_cpu_shims

    install_cpu_shims()
    import megatron.core

    where = Path(megatron.core.__file__).resolve().parents[2]
    if snapshot and where != Path(snapshot).resolve():
        raise SystemExit(f"megatron.core resolved to {megatron.core.__file__}, not the snapshot")
    if job in HELPER_JOBS:
        load_te_standin(STANDIN)
    result = JOBS[job](**kwargs)
    result["megatron_core"] = megatron.core.__file__
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1:])
