"""mhc_cg against Megatron-LM ``main``'s own mHC (a source snapshot, run in a subprocess).

* ``HyperConnection`` equals ``main``'s ``HyperConnectionModule`` on the same ``state_dict``:
  forward and gradients, n = 2, 3, 4, fp64 and fp32.
* ``main``'s ``HyperConnectionTransformerLayer`` (its layer spec, its ``TransformerBlock``) on
  mhc_cg's block recompute, eager and on static buffers with tape recompute graphs: gradients
  bit-identical to ``main`` without recompute and to ``main``'s ``recompute_modules: [mhc]``.

The snapshot is ``../shared/third_party/megatron-lm-main-*.tar.gz``; see
``tests/megatron_main_oracle.py`` for how it is imported and the CPU shims it needs.
"""

import pytest

from megatron_main_oracle import assert_fused_block, extracted_snapshot, run_job

STREAMS = (2, 3, 4)
DTYPES = ("float64", "float32")
# Largest |ours - main| allowed, relative to the largest |value| (forward) or |gradient|: the
# two Sinkhorn backwards differ in rounding only (main scales by its saved exp(logits); ours
# differentiates the exp), and aggregate is a matmul in ours, a multiply-and-sum in main.
TOLERANCE = {"float64": 1e-13, "float32": 1e-6}


@pytest.fixture(scope="module")
def main_snapshot(tmp_path_factory):
    return extracted_snapshot("main", tmp_path_factory)


@pytest.fixture(scope="module")
def hyper_connection_cases(main_snapshot):
    result = run_job(main_snapshot, "hyper_connection", streams=list(STREAMS), dtypes=list(DTYPES))
    assert "megatron-lm-main" in result["megatron_core"]
    return {(c["n"], c["dtype"]): c for c in result["cases"]}


@pytest.fixture(scope="module")
def main_layer(main_snapshot):
    result = run_job(main_snapshot, "main_layer")
    assert "megatron-lm-main" in result["megatron_core"]
    return result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
def test_hyper_connection_equals_megatron_main(hyper_connection_cases, n, dtype):
    case = hyper_connection_cases[(n, dtype)]
    assert case["state_dict_keys"] == ["alpha_post", "alpha_pre", "alpha_res", "bias",
                                       "mapping_proj.weight"]
    assert case["load_missing"] == [] and case["load_unexpected"] == []
    assert case["grad_keys_main"] == case["grad_keys_ours"]
    forward_bound = TOLERANCE[dtype] * case["value_scale"]
    grad_bound = TOLERANCE[dtype] * case["grad_scale"]
    print(f"\nn={n} {dtype}: max |ours - main| forward {max(case['forward'].values()):.3g} "
          f"(bound {forward_bound:.3g}), gradients {max(case['grad'].values()):.3g} "
          f"(bound {grad_bound:.3g})")
    for name, diff in case["forward"].items():
        assert diff <= forward_bound, f"forward {name}: {diff}"
    for name, diff in case["grad"].items():
        assert diff <= grad_bound, f"gradient of {name}: {diff}"
    assert case["doubly_stochastic_err"] <= 1e3 * TOLERANCE[dtype]


def _assert_bit_identical(comparison, what):
    assert comparison["grad_names_equal"], what
    assert comparison["out_equal"] and comparison["dx_equal"], what
    assert comparison["grads_not_equal"] == [], f"{what}: {comparison['grads_not_equal']}"
    assert comparison["max_abs_grad_diff"] == 0.0, what


def test_megatron_main_layer_on_eager_block_recompute_is_bit_identical(main_layer):
    """Dropout 0.1 (torch's generator, reseeded per step), 4 layers, blocks of 2."""
    eager = main_layer["eager"]
    _assert_bit_identical(eager["peer_vs_none"], "main [mhc] recompute vs main without")
    _assert_bit_identical(eager["ours_vs_none"], "ours vs main without recompute")
    _assert_bit_identical(eager["ours_vs_peer"], "ours vs main [mhc] recompute")
    assert eager["managers"] == 2 and eager["freed_outputs"] > 0
    assert eager["biases_seen"] == 8  # F's skipped bias, every sublayer of the 4 layers
    assert "hidden_dropout: 0.1" in eager["static_with_torch_dropout"]
    assert "set hidden_dropout: 0" in eager["static_with_torch_dropout"]


def test_megatron_main_layer_on_static_buffers_with_recompute_graphs_is_bit_identical(main_layer):
    """Dropout 0, tape recompute graphs, two microbatches in flight."""
    static = main_layer["static"]
    _assert_bit_identical(static["peer_vs_none"], "main [mhc] recompute vs main without")
    _assert_bit_identical(static["ours_vs_none"], "ours vs main without recompute")
    _assert_bit_identical(static["ours_vs_peer"], "ours vs main [mhc] recompute")
    assert static["trace"] == [f"recompute block {b} set {s} (graph)" for s in (0, 1) for b in (1, 0)]
    assert static["sets_in_use_in_flight"] == 2
    assert (static["sets_in_use_after_first_backward"], static["sets_in_use_after_both"]) == (1, 0)
    assert static["saved_in_static_buffers"] > 0  # F saves its input as a slot view


def test_megatron_main_saved_bytes_per_layer(main_layer):
    """Bytes autograd keeps per layer from forward to backward (unique storages, parameters and
    RNG states left out), ours beside main's; under static buffers the mHC state is in the
    persistent set (per microbatch) and the arena (once per rank), listed apart."""
    rows = []
    for mode in ("eager", "static"):
        table = main_layer[mode]["bytes_per_layer"]
        rows += [(mode, name, value) for name, value in table.items()]
        assert table["main_mhc_recompute"] < table["main_none"]
        per_microbatch = table["ours_saved"] + table.get("ours_persistent_set_per_microbatch", 0)
        assert per_microbatch < table["main_none"]
    print("\nmode    bytes per layer                       value")
    for mode, name, value in rows:
        print(f"{mode:<7} {name:<36} {value:>8.0f}")


def test_megatron_main_layer_module_imports_without_main():
    """The adapter module imports with the pinned megatron-core; using it says what it needs."""
    pytest.importorskip("megatron.core")
    from megatron_integration.layers import main_layer

    try:
        import megatron.core.transformer.hyper_connection  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs Megatron-LM main's megatron.core"):
            main_layer.main_mhc_layer_spec()
    else:
        pytest.skip("this megatron.core has mHC itself")


@pytest.fixture(scope="module")
def fused_block(main_snapshot):
    result = run_job(main_snapshot, "fused_block", branch="main",
                     dtypes=["float32", "bfloat16"])
    assert "megatron-lm-main" in result["megatron_core"]
    return result


def test_mains_layers_on_mhc_cgs_fused_kernels_match_mains_and_recompute_bit_for_bit(
        fused_block):
    """main's own block with ``use_fused_mhc`` (mhc_cg's fused pre and post in every sublayer,
    main's arithmetic) against main's native ops, fp32 and bf16, each against the fp64 truth: within the
    bound of Megatron's own fp32 error; mhc_cg's eager block recompute and the static runtime with
    tape recompute graphs equal the fused layers run eagerly, bit for bit
    (``assert_fused_block``)."""
    assert_fused_block(fused_block, "main")
