"""mhc_cg's transposed H_res layout against Megatron-LM ``dev``'s own mHC (a source snapshot, run
in a subprocess): ``dev``'s ``HyperConnectionModule`` applies ``H_res^T`` to the streams where
``main``'s applies ``H_res`` (in ``apply_h_res`` and in its dropout-free ``h_post_bda``).

* ``HyperConnection(h_res_transposed=True)``, non-fused and fused (the torch reference), equals
  ``dev``'s module on the same ``state_dict`` and input: values, input and parameter gradients;
* ``HyperConnection()`` (main's layout) does not, by orders of magnitude more than the bound;
* the reference's dev arithmetic Sinkhorn (``arithmetic="dev"``) equals dev's own, forward and
  backward, and main's arithmetic does not.

n = 3 and 4 only: every doubly stochastic 2 x 2 matrix is symmetric, where the layouts agree. The
snapshot is ``../shared/third_party/megatron-lm-dev-*.tar.gz``; the job is
``dev_hyper_connection_job`` of ``tests/megatron_main_oracle.py``.
"""

import pytest

from megatron_main_oracle import assert_fused_block, extracted_snapshot, run_job

STREAMS = (3, 4)
DTYPES = ("float64", "float32")
# Largest |ours - dev| allowed, relative to the largest |value| or |gradient|:
# * the layout's step alone (dev's own h_res and h_post given to both): rounding of the adds'
#   order only (measured <= 3e-16 in fp64, 1.4e-7 in fp32);
STEP_TOLERANCE = {"float64": 1e-14, "float32": 1e-6}
# * the whole sublayer with dev's projection and norm in the input's dtype: the Sinkhorn's and
#   the aggregate's rounding, as against main (measured <= 2e-15 in fp64, 7e-7 in fp32);
IN_DTYPE_TOLERANCE = {"float64": 1e-13, "float32": 2e-6}
# * dev's module as it is: it runs its projection and norm in fp32 for every dtype, so its fp64
#   mappings carry fp32 rounding (measured <= 4e-7 in fp64, 7e-7 in fp32).
AS_IS_TOLERANCE = 2e-6
# main's layout misses dev by at least this many times the as-is bound (measured >= 10000 times,
# on the output and on x's gradient)
LAYOUT_GAP = 1000


# dev's Sinkhorn (Note [dev's Sinkhorn]) against its own SinkhornKnopp, relative to the largest
# value or gradient: the values are dev's ops in dev's order (measured 0), the gradients the
# explicit backward's rounding (measured <= 4.3e-16 in fp64, 2.5e-7 in fp32)
SINKHORN_TOLERANCE = {"float64": 1e-14, "float32": 2e-6}
# main's Sinkhorn misses dev's by its eps terms (measured >= 2.3e-5 in values, 1.4e-5 in
# gradients, either dtype): the comparison tells the arithmetics apart
SINKHORN_GAP = 5e-6


@pytest.fixture(scope="module")
def dev_snapshot(tmp_path_factory):
    return extracted_snapshot("dev", tmp_path_factory)


@pytest.fixture(scope="module")
def dev_result(dev_snapshot):
    result = run_job(dev_snapshot, "dev_hyper_connection", streams=list(STREAMS),
                     dtypes=list(DTYPES))
    assert "megatron-lm-dev" in result["megatron_core"]
    return result


@pytest.fixture(scope="module")
def dev_cases(dev_result):
    return {(c["n"], c["dtype"]): c for c in dev_result["cases"]}


def test_the_dev_arithmetic_sinkhorn_equals_megatron_devs_forward_and_backward(dev_result):
    """The reference's dev Sinkhorn, an explicit forward and backward, equals dev's own
    ``native_sinkhorn`` (autograd through its iterations) at 1, 2 and 20 iterations; main's
    arithmetic does not, by more than the bound in either dtype."""
    cases = dev_result["sinkhorn"]
    assert {(c["dtype"], c["n"], c["iterations"]) for c in cases} == {
        (d, n, t) for d in DTYPES for n in STREAMS for t in (1, 2, 20)}
    for case in cases:
        bound = SINKHORN_TOLERANCE[case["dtype"]]
        what = f"n={case['n']} {case['dtype']} T={case['iterations']}"
        assert case["dev"]["out"] <= bound * case["out_scale"], (what, case)
        assert case["dev"]["grad"] <= bound * case["grad_scale"], (what, case)
        assert case["main"]["out"] >= SINKHORN_GAP * case["out_scale"] > bound * case["out_scale"]
        assert case["main"]["grad"] >= SINKHORN_GAP * case["grad_scale"], (what, case)


def _assert_within(diffs: dict, bound: float, what: str) -> None:
    for name, diff in diffs.items():
        assert diff <= bound, f"{what} {name}: {diff} > {bound}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
def test_transposed_hyper_connection_equals_megatron_dev(dev_cases, n, dtype):
    case = dev_cases[(n, dtype)]
    assert case["h_res_asymmetry"] > 0.1, "H_res nearly symmetric: the layouts would agree"
    step = case["step"]["dev_layout"]
    _assert_within(step["values"], STEP_TOLERANCE[dtype] * case["step_value_scale"], "step")
    _assert_within(step["grad"], STEP_TOLERANCE[dtype] * case["step_grad_scale"], "step grad")
    for variant, tolerance in (("projection_in_dtype", IN_DTYPE_TOLERANCE[dtype]),
                               ("as_is", AS_IS_TOLERANCE)):
        scale = case["scale"][variant]
        for name in ("ours_dev_layout", "ours_dev_layout_fused"):
            got = case["sublayer"][variant][name]
            print(f"\nn={n} {dtype} {variant} {name}: out {got['out']:.3g} "
                  f"(bound {tolerance * scale['value']:.3g}), gradients "
                  f"{max(got['grad'].values()):.3g} (bound {tolerance * scale['grad']:.3g})")
            assert got["grad_keys_equal"]
            assert got["grad"].keys() >= {"x", "f_bias", "mapping_proj.weight", "alpha_pre",
                                          "alpha_post", "alpha_res", "bias"}
            _assert_within({"out": got["out"]}, tolerance * scale["value"], f"{variant} {name}")
            _assert_within(got["grad"], tolerance * scale["grad"], f"{variant} {name} grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", STREAMS)
def test_main_layout_does_not_equal_megatron_dev(dev_cases, n, dtype):
    """The comparison above tells the layouts apart: with main's layout it fails by far."""
    case = dev_cases[(n, dtype)]
    scale = case["scale"]["as_is"]
    got = case["sublayer"]["as_is"]["ours_main_layout"]
    assert got["out"] > LAYOUT_GAP * AS_IS_TOLERANCE * scale["value"]
    assert got["grad"]["x"] > LAYOUT_GAP * AS_IS_TOLERANCE * scale["grad"]
    step = case["step"]["main_layout"]
    assert step["values"]["mixed"] > LAYOUT_GAP * STEP_TOLERANCE[dtype] * case["step_value_scale"]


@pytest.fixture(scope="module")
def fused_block(dev_snapshot):
    result = run_job(dev_snapshot, "fused_block", branch="dev",
                     dtypes=["float32", "bfloat16"])
    assert "megatron-lm-dev" in result["megatron_core"]
    return result


def test_devs_layers_on_mhc_cgs_fused_kernels_match_devs_and_recompute_bit_for_bit(
        fused_block):
    """dev's own block with ``use_fused_mhc`` (mhc_cg's fused pre and post in every sublayer,
    dev's arithmetic) against dev's native ops, fp32 and bf16, each against the fp64 truth: within the
    bound of Megatron's own fp32 error; mhc_cg's eager block recompute and the static runtime with
    tape recompute graphs equal the fused layers run eagerly, bit for bit
    (``assert_fused_block``)."""
    assert_fused_block(fused_block, "dev")
