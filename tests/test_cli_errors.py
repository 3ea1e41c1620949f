"""Every bad config or command-line input ends in exit status 2 and one line naming the field and
the fix, never a traceback; sizes that would take minutes or gigabytes are refused up front."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import run_cli, write_config
from mhc_cg.cli import main

TINY = "model: {vocab_size: 16, seq_length: 8, hidden_size: 16, num_heads: 2, num_layers: 2}\n"


def one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("text, field, fix", [
    (b"model:\n  hidden_size: 8\n# caf\xe9\n", "is not UTF-8 text", "save it as UTF-8"),
    ("model:\n  1: 2\n", "key 1 is a int", "write section and field names as text"),
    ("model:\n  hidden_size: 8\n  hidden_size: 16\n", "'hidden_size' is given twice", "keep one"),
    ("", "is empty", "leave out --config"),
    ("# only a comment\n", "is empty", "leave out --config"),
    (TINY.replace("16, seq", "4, seq"), "model.vocab_size: 4 is too small", "use at least 8"),
    ("model: {num_experts: 2, moe_ffn_hidden_size: -5}\n", "model.moe_ffn_hidden_size",
     "positive integer"),
    ("train: {lr: .nan}\n", "train.lr: must be a finite number > 0", "3e-3"),
    ("train: {lr: .inf}\n", "train.lr: must be a finite number > 0", "3e-3"),
    ("train: {weight_decay: -1}\n", "train.weight_decay: must be a finite number >= 0",
     "0 turns it off"),
    ("model: {hidden_size: 100000000000000000000, num_heads: 1}\n", "model: training this model",
     "reduce model.hidden_size"),
    ("model: {hidden_size: 1e20}\n", "model.hidden_size: must be an integer", "1e20"),
    ("train: {eval_interval: -1}\n", "train.eval_interval", ">= 0"),
    ("train: {eval_batches: 0}\n", "train.eval_batches", "positive integer"),
])
@pytest.mark.parametrize("command", ["config", "train"])
def test_bad_config_is_one_line_naming_the_field_and_exit_2(tmp_path, capsys, text, field, fix,
                                                             command):
    path = write_config(tmp_path, text)
    argv = ["config", "check", str(path)] if command == "config" else \
        ["train", "--config", str(path), "--steps", "1", "--no-progress"]
    line = one_error_line(capsys, argv)
    assert line.startswith(f"mhc-cg {command}: error: ") and field in line and fix in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_cuda_backend_on_a_machine_without_cuda(tmp_path, capsys):
    """``cuda`` is refused off a GPU (``te``, TE's function, runs there over the tape:
    tests/test_te_graphs.py)."""
    path = write_config(tmp_path, TINY + "train: {device: auto}\ngraph: {backend: cuda}\n")
    line = one_error_line(capsys, ["train", "--config", str(path), "--steps", "1",
                                   "--no-progress", "--mode", "graphed_static"])
    assert "graph.backend: '" in line and "captures CUDA graphs" in line and "use 'tape'" in line
    # a config meant for a GPU machine still passes `config check` here
    assert main(["config", "check", str(path)]) == 0


@pytest.mark.parametrize("flag", ["--trace", "--png"])
def test_schedule_output_into_a_missing_folder(tmp_path, capsys, flag):
    target = tmp_path / "missing" / "out.file"
    line = one_error_line(capsys, ["schedule", "--pp", "2", "--microbatches", "4", "--layers",
                                   "4", flag, str(target)])
    assert f"{flag}: folder" in line and "does not exist" in line and "mkdir -p" in line
    assert not target.parent.exists()


def test_schedule_too_large_is_refused_at_once_with_the_limit(capsys):
    start = time.perf_counter()
    line = one_error_line(capsys, ["schedule", "--pp", "5000", "--microbatches", "5000"])
    assert time.perf_counter() - start < 5
    assert "50000000 passes" in line and "limit of 65536" in line and "lower --microbatches" in line


def test_train_refuses_a_model_larger_than_the_device(tmp_path, capsys):
    # fits under the absolute limit (config check passes), not in this machine's memory
    path = write_config(tmp_path, "model: {hidden_size: 4096, num_heads: 1, num_layers: 16, "
                                  "vocab_size: 64}\n")
    from mhc_cg.training.device import device_memory_bytes
    from mhc_cg.config import load_config
    from mhc_cg.config.rules import estimated_train_bytes

    need = estimated_train_bytes(load_config(path))
    if need <= device_memory_bytes(torch.device("cpu")):
        pytest.skip("this machine holds the model")
    assert main(["config", "check", str(path)]) == 0
    capsys.readouterr()
    line = one_error_line(capsys, ["train", "--config", str(path), "--no-progress"])
    assert "GiB of cpu memory (the limit)" in line and "reduce model.hidden_size" in line


def test_errors_from_a_fresh_process_have_no_traceback(tmp_path):
    path = write_config(tmp_path, b"\xff\xfe garbage")
    proc = run_cli("config", "check", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "not UTF-8" in proc.stderr
