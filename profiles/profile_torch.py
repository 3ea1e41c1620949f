"""Profile ``mhc-cg train`` in-process under torch.profiler and write a Chrome trace.

Usage (from the repository root)::

    python profiles/profile_torch.py --out profiles/cpu/eager_block.json.gz -- \\
        --config configs/tiny_cpu.yaml --steps 5 --no-progress [other mhc-cg train flags]

Everything after ``--`` is parsed by ``mhc-cg train`` itself (so any flag it gains works here) and
run by the same command function, which calls :func:`mhc_cg.training.session.train`, while torch.profiler
records CPU operators (and CUDA kernels when a GPU is visible). NVTX ranges are switched on, so the
``record_function`` ranges of :mod:`mhc_cg.core.nvtx` (``step``, ``forward``, ``fwd/...``) are in
the trace as ``user_annotation`` events. A ``.gz`` output is gzipped. Next to the trace,
``<name>.command.txt`` records the exact command and the versions used.

Use this where nsys is missing; ``profiles/profile_nsys.sh`` is the GPU-side equivalent.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mhc_cg.core import nvtx
from mhc_cg.cli import build_parser
from mhc_cg.core.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(
        description="profile `mhc-cg train` under torch.profiler (Chrome trace)",
        epilog="arguments after -- go to `mhc-cg train` unchanged")
    parser.add_argument("--out", required=True, help="trace path (.json or .json.gz)")
    parser.add_argument("--cuda", choices=("auto", "on", "off"), default="auto",
                        help="record CUDA kernels too (auto: when torch sees a GPU)")
    return parser.parse_args(own), train_args


def command_file(out: Path) -> Path:
    name = out.name
    for suffix in (".json.gz", ".json", ".gz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return out.with_name(f"{name}.command.txt")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing distribution is reported, not fatal
        return "not installed"


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def write_command_file(out: Path, argv: list[str], train_args: list[str], cuda: bool) -> Path:
    script = Path(__file__).resolve()
    try:
        script_text = str(script.relative_to(Path.cwd()))
    except ValueError:
        script_text = str(script)
    device = torch.cuda.get_device_name(0) if cuda else "none (CPU only)"
    lines = [
        "# regenerate (from the directory it was run in):",
        shlex.join(["python", script_text, *argv]),
        "# the profiled command, run in-process:",
        shlex.join(["mhc-cg", "train", *train_args]),
        f"# recorded {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} "
        f"on {platform.node() or 'unknown host'}",
        f"python {platform.python_version()}, torch {torch.__version__}, nvtx {_version('nvtx')}, "
        f"mhc_cg {_version('mhc_cg')} at git {_git_revision()}",
        f"platform {platform.platform()}; GPU {device}; "
        f"torch.profiler activities: CPU{' + CUDA' if cuda else ''}",
    ]
    path = command_file(out)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, train_args = parse_args(argv)
    train_ns = build_parser().parse_args(["train", *train_args])  # exits 2 on a bad train flag
    cuda = torch.cuda.is_available() if args.cuda == "auto" else args.cuda == "on"
    if cuda and not torch.cuda.is_available():
        print("profile_torch: --cuda on, but this torch build sees no CUDA GPU", file=sys.stderr)
        return 2
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    nvtx.enable(True)  # the ranges are what the comparison aggregates by
    try:
        with profile(activities=activities) as prof:
            status = int(train_ns._run(train_ns) or 0)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"profile_torch: mhc-cg train: error: {line}", file=sys.stderr)
        return 2
    prof.export_chrome_trace(str(out))
    meta = write_command_file(out, argv, train_args, cuda)
    print(f"wrote {out} and {meta}")
    return status


if __name__ == "__main__":
    sys.exit(main())
