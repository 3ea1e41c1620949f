"""``mhc-cg kernels --peers``'s own parts, without the peers: the layout conversions, the
comparison and where the TE wheel is looked for. The peers themselves run in the GPU checklist's
dry run (tests/test_gpu_check.py)."""

from __future__ import annotations

import zipfile

import pytest
import torch

from mhc_cg.ops.kernels import reference as R
from mhc_cg.lab.benchmarks import kernel_peers as kp


def test_te_layout_round_trips_and_matches_its_feature_order():
    """TE's ``(s, b, C, n)``: feature ``c * n + i`` of x and of the weight's columns; what comes
    back in our layout is what went in."""
    inp = kp.make_inputs(3, 2, 8, torch.float32, "cpu")
    te = kp.TE(wrappers=None, tf32=False)
    t = te.prepare(inp)
    x = inp.x.view(3, 2, kp.N, 8)
    assert torch.equal(t["x"][1, 0, 5, 2], x[1, 0, 2, 5])
    assert torch.equal(t["weight"][7, 5 * kp.N + 2], inp.weight[7, 2 * 8 + 5])
    assert torch.equal(te.ours_layout("x", t["x"]), inp.x)
    assert torch.equal(te.ours_layout("weight", t["weight"]), inp.weight)
    assert torch.equal(t["alpha"], torch.cat([inp.a_pre, inp.a_post, inp.a_res]))


def test_the_comparison_catches_a_transposed_h_res():
    """A peer that applied H_res the other way is not ok at either dtype's tolerance: the check
    has teeth."""
    inp = kp.make_inputs(4, 2, 16, torch.float32, "cpu")
    t, width = 8, kp.N * 16
    state = R.mapping_state(inp.x.view(t, width), inp.weight, inp.a_pre, inp.a_post, inp.a_res,
                            inp.bias, kp.N, 1e-6, False)
    outs = [R.post(inp.x.view(t, width), state, inp.a_pre, inp.a_post, inp.a_res, inp.bias,
                   inp.y.view(t, 16), None, 0.0, 0, kp.N, kp.ITERATIONS, h_res_transposed=ht)
            for ht in (False, True)]
    for dtype in kp.DRY_DTYPES:
        assert kp._compare({"out": outs[0]}, {"out": outs[0].clone()}, kp.tolerance(dtype))[1]
        diff, ok, note = kp._compare({"out": outs[0]}, {"out": outs[1]}, kp.tolerance(dtype))
        assert not ok and diff > 0 and note.startswith("out:")


def test_the_te_wheel_is_found_and_read_without_installing(tmp_path, monkeypatch):
    """``$MHC_CG_TE_WHEEL`` (a wheel or a folder), else the repository's places; the two mHC
    files are extracted from the wheel into a folder of their own."""
    from mhc_cg.lab.emulation.te_wheel import TE_ENV, TE_WHEEL

    wheel = tmp_path / "w" / TE_WHEEL
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        for name in kp.TE_FILES:
            z.writestr(name, "# stand-in\n")
    monkeypatch.setenv(TE_ENV, str(wheel.parent))
    assert kp.find_te_wheel(tmp_path) == wheel
    folder = kp.te_folder(wheel, tmp_path / "scratch")
    assert all((folder / name).read_text() == "# stand-in\n" for name in kp.TE_FILES)
    monkeypatch.setenv(TE_ENV, str(tmp_path / "nowhere"))
    assert kp.find_te_wheel(tmp_path) is None
    assert "pip download --no-deps transformer-engine==" in kp.te_missing_reason(tmp_path)


def test_family_bytes_count_each_tensor_once():
    s, b, c, es = 2, 3, 8, 2
    x, y, w = s * b * kp.N * c * es, s * b * c * es, 24 * kp.N * c * es
    assert kp.family_bytes("post.backward", s, b, c, es) == 2 * x + y + s * b * 20 * 4
    assert kp.family_bytes("sublayer", s, b, c, es) > kp.family_bytes("pre", s, b, c, es) + \
        kp.family_bytes("post", s, b, c, es)


@pytest.mark.parametrize("argv", [["--peers", "--bench"], ["--peers"]])
def test_cli_refuses_in_one_line(argv, capsys):
    """``--peers`` with ``--bench``, or on a machine without a GPU and no ``--dry-run``: one line
    naming the flag, exit 2."""
    from mhc_cg.cli import main

    if argv == ["--peers"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["kernels", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhc-cg kernels: error: --peers"), err


def test_a_timed_report_reads_as_a_table_and_a_markdown_file(tmp_path):
    """What a GPU run writes (``--out``): each row with ours and the peer's device time, the
    ratio and GB/s, in the printed table and in ``peers.md``."""
    row = {"shape": "bench_h100", "tokens": 4096, "hidden": 2048, "dtype": "bfloat16",
           "op": "post", "peer": "te", "h_res_transposed": True, "arithmetic": "main",
           "max_abs_diff": 0.0,
           "rtol": kp.RTOL["bfloat16"], "ok": True, "worst": "out: 0 of 1", "ours_ms": 0.05,
           "ours_wall_ms": 0.07, "ours_gb_per_s": 2600.0, "ms": 0.1, "wall_ms": 0.12,
           "gb_per_s": 1300.0, "over_ours": 2.0}
    report = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "code": "abc1234",
              "skipped": {"torch": "no Megatron-LM main snapshot"}, "not_run": [],
              "peers": {"te": "TransformerEngine 2.20.2"}, "rows": [row]}
    text = kp.format_report(report)
    assert "torch: not run: no Megatron-LM main snapshot" in text
    assert "0.0500" in text and "0.1000" in text and "2.00" in text
    md = kp.markdown(report)
    assert "| bench_h100 | bfloat16 | post | te | main | 0.0500 | 0.1000 | 2.00 | 2600 | 1300 |" in md
    assert kp.family_bytes("post", 2048, 2, 2048, 2) / (row["ours_ms"] * 1e6) > 0


def test_a_backward_lost_in_its_forwards_noise_reads_as_no_figure():
    """A backward's time is its forward-and-backward less its forward: where that is not
    positive the row says ``-``, never a negative time or a ratio of one."""
    row = {"shape": "bench_h100", "tokens": 4096, "hidden": 2048, "dtype": "bfloat16",
           "op": "post.backward", "peer": "dev", "h_res_transposed": True, "arithmetic": "dev",
           "max_abs_diff": 0.0,
           "rtol": kp.RTOL["bfloat16"], "ok": True, "worst": "", "ours_ms": None,
           "ours_wall_ms": None, "ours_gb_per_s": None, "ms": 0.2, "wall_ms": 0.3,
           "gb_per_s": 900.0, "over_ours": None}
    report = {"device": "gpu", "torch": "2.11.0", "code": "abc", "skipped": {}, "not_run": [],
              "peers": {}, "rows": [row]}
    assert "| bench_h100 | bfloat16 | post.backward | dev | dev | - | 0.2000 | - | - | 900 |" in \
        kp.markdown(report)
    assert " - " in kp.format_report(report)
