"""The `mhc-cg` entry point: bad input is one clear line and exit status 2."""

import subprocess
import sys

from mhc_cg.cli import main


def test_train_runs_and_prints_losses(capsys):
    assert main(["train", "--steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "first loss" in out and "last loss" in out and "step time" in out


def test_bad_config_fields_exit_2_with_one_line_each(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hidden_sise: 8\ntrain:\n  lr: fast\nmodle: {}\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("model.hidden_sise: unknown field (did you mean 'hidden_size'?)" in line for line in err)
    assert any("train.lr: must be a number, got 'fast'" in line for line in err)
    assert any("modle: unknown section (did you mean 'model'?)" in line for line in err)


def test_missing_config_and_bad_steps(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err
    assert main(["train", "--steps", "0"]) == 2
    assert "--steps: must be a positive integer" in capsys.readouterr().err


def test_console_script_module_entry():
    proc = subprocess.run([sys.executable, "-m", "mhc_cg.cli", "train", "--device", "gpu"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_help_opens_with_what_mhc_cg_does_for_its_user():
    from mhc_cg.cli import build_parser

    text = build_parser().format_help()
    assert "mHC activation recompute inside CUDA graphs" in text and "``" not in text
    assert "mhc_cg/commands" not in text


def test_the_cpu_memory_probe_prints_nothing_of_torchs_profiler(capfd):
    """``held_bytes`` on the CPU runs torch's profiler, whose Kineto logs its start and stop on
    file descriptor 2 (``USDT: ... profiler_start``) whatever its log level: none reaches the
    user, and the probe still counts what the function left allocated."""
    import torch

    from mhc_cg.training.session import held_bytes

    kept = []
    out, held = held_bytes(lambda: kept.append(torch.ones(1 << 16)) or kept[0],
                           torch.device("cpu"))
    captured = capfd.readouterr()
    assert "USDT" not in captured.err and "profiler" not in captured.err
    assert held is not None and held >= (1 << 16) * 4 and out is kept[0]
