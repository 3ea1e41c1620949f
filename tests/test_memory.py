"""Measured saved-for-backward bytes: what block recompute frees, on meta and on real tensors."""

import json

import pytest
from mhc_cg.cli import main
from mhc_cg.lab.memory.measure import measure_saved_bytes
from mhc_cg.model import MHCGPTConfig

SMALL = dict(vocab_size=32, seq_length=16, hidden_size=32, num_heads=2, num_layers=4, num_streams=4,
             hidden_dropout=0.1)


def test_meta_and_cpu_agree_on_what_block_recompute_frees():
    cfg = MHCGPTConfig(**SMALL, recompute_layers=2)
    meta = measure_saved_bytes(cfg, 2, device="meta")
    cpu = measure_saved_bytes(cfg, 2, device="cpu")
    # attention may save different internals on the two devices; they cancel in the difference
    assert meta["difference"]["measured"] == cpu["difference"]["measured"] > 0
    assert meta["block"]["per_layer_bytes"] < meta["none"]["per_layer_bytes"]


def test_each_extra_block_keeps_exactly_one_block_input():
    n, c, layers, mbs = SMALL["num_streams"], SMALL["hidden_size"], SMALL["num_layers"], 3
    one_block = measure_saved_bytes(MHCGPTConfig(**SMALL, recompute_layers=layers), mbs)["block"]
    per_layer = measure_saved_bytes(MHCGPTConfig(**SMALL, recompute_layers=1), mbs)["block"]
    x_l0_bytes = SMALL["seq_length"] * mbs * n * c * 4  # one [s, b, n*C] fp32 block input
    extra = per_layer["layers_saved_bytes"] - one_block["layers_saved_bytes"]
    assert extra == (layers - 1) * x_l0_bytes
    assert per_layer["num_blocks"] == layers and one_block["num_blocks"] == 1


def test_bad_arguments_name_the_argument():
    cfg = MHCGPTConfig(**SMALL)
    with pytest.raises(ValueError, match="dtype: must be one of"):
        measure_saved_bytes(cfg, 1, dtype="fp8")
    with pytest.raises(ValueError, match="micro_batch_size: must be a positive integer"):
        measure_saved_bytes(cfg, 0)


def test_memory_command_table_and_json(capsys):
    args = ["memory", "--hidden", "32", "--heads", "2", "--seq", "16", "--layers", "4", "--mbs", "2",
            "--recompute-layers", "2"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "recompute=none" in table and "saved-tensor model" in table and "L_r=2" in table
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recompute_layers"] == 2 and data["blocks"] == [2, 2]
    assert data["block"]["per_layer_bytes"] < data["none"]["per_layer_bytes"]
    assert main(["memory", "--mbs", "0"]) == 2
    assert "--mbs: must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_what_block_recompute_frees_matches_the_saved_tensor_model(dropout):
    """The op-by-op model of memory_model.sublayer_saved_elements, against the measurement."""
    cfg = MHCGPTConfig(**{**SMALL, "hidden_size": 256, "num_heads": 4, "hidden_dropout": dropout},
                       recompute_layers=2)
    diff = measure_saved_bytes(cfg, 2, device="meta")["difference"]
    assert abs(diff["relative_error"]) < 0.02, diff
