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


def _imported(args: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime ARGS``: the process, and the modules importtime saw imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                          text=True)
    names = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
    return proc, names


def _torch(names) -> list[str]:
    return sorted(n for n in names if n == "torch" or n.startswith("torch."))


def test_help_imports_no_torch_and_the_package_still_exports_the_model():
    """``mhc-cg --help`` reads each command's HELP only: no torch module is imported (a command's
    arguments, and what it runs, import it when that command is parsed). The package's names
    load on first use: ``from mhc_cg import MHCGPT`` imports the model then."""
    proc, names = _imported(["-m", "mhc_cg.cli", "--help"])
    assert proc.returncode == 0 and "usage: mhc-cg" in proc.stdout, proc.stderr[-2000:]
    assert "mhc_cg.core.errors" in names  # importtime's lines were read
    assert not _torch(names), _torch(names)[:10]
    # importlib.import_module is not timed: sys.modules says what the command modules brought in
    listed = subprocess.run([sys.executable, "-c", "import sys\nfrom mhc_cg.cli import main\n"
                             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
                             "print(*sys.modules, file=sys.stderr)"],
                            capture_output=True, text=True)
    modules = set(listed.stderr.split())
    assert "mhc_cg.commands.train" in modules and not _torch(modules), _torch(modules)[:10]
    proc, names = _imported(["-c", "import sys\nimport mhc_cg\nassert 'torch' not in sys.modules\n"
                                   "from mhc_cg import MHCGPT, MHCGPTConfig, HyperConnection\n"
                                   "print(mhc_cg.__version__, MHCGPT.__name__, *mhc_cg.__all__)"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch" in names and proc.stdout.split()[1:3] == ["MHCGPT", "HyperConnection"]


def test_a_command_adds_its_arguments_when_it_is_parsed():
    from mhc_cg.cli import build_parser

    args = build_parser().parse_args(["schedule", "--pp", "2", "--dtype", "fp32"])
    assert (args.command, args.pp_size, args.dtype) == ("schedule", 2, "fp32")
    assert args._run.__module__ == "mhc_cg.commands.schedule"


def test_the_cpu_memory_probe_prints_nothing_of_torchs_profiler(capfd):
    """``held_bytes`` on the CPU runs torch's profiler, whose Kineto logs its start and stop on
    file descriptor 2 (``USDT: ... profiler_start``) whatever its log level: none reaches the
    user, and the probe still counts what the function left allocated."""
    import torch

    from mhc_cg.lab.compare.watch import held_bytes

    kept = []
    out, held = held_bytes(lambda: kept.append(torch.ones(1 << 16)) or kept[0],
                           torch.device("cpu"))
    captured = capfd.readouterr()
    assert "USDT" not in captured.err and "profiler" not in captured.err
    assert held is not None and held >= (1 << 16) * 4 and out is kept[0]
