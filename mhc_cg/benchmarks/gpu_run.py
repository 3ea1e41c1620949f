"""A GPU run brought back: what ``bench/gpu_check.sh`` leaves, unpacked where the results live.

A device call returns at most 8 files from its output folder (two folders down at most, 16 MiB
each), so the checklist leaves ``env.txt``, ``summary.tsv`` and one ``<part>.tar.gz`` per part.

``python -m mhc_cg.benchmarks.gpu_run unpack DIR [--to DEST]``: every part's files under
``bench/results/gpu_check_<device>/`` (``<device>``: the GPU's name as a file name, ``cpu`` for a
dry run), beside ``env.txt`` and ``summary.tsv``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
TOP_FILES = ("env.txt", "summary.tsv")


def name_slug(name: str) -> str:
    """A device name as a file name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def device_of(env_text: str) -> str:
    """The GPU ``env.txt`` names (its ``gpu NAME`` line), or ``cpu`` where it names none."""
    for line in env_text.splitlines():
        if line.startswith("gpu "):
            name = line[4:].strip()
            return "cpu" if name in ("", "none") else name
    return "cpu"


def unpack(src: Path, dest: Path | None = None, results: Path = RESULTS) -> Path:
    """``src``'s archives extracted into ``dest`` (default ``results/gpu_check_<device>``), with
    its ``env.txt`` and ``summary.tsv``; returns ``dest``."""
    src = Path(src)
    if not (src / "env.txt").is_file():
        raise FileNotFoundError(f"{src}/env.txt: not a bench/gpu_check.sh output folder")
    device = device_of((src / "env.txt").read_text())
    dest = Path(dest) if dest is not None else \
        results / f"gpu_check_{'cpu' if device == 'cpu' else name_slug(device)}"
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOP_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    for archive in sorted(src.glob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")  # no absolute paths, nothing outside dest
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.benchmarks.gpu_run",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    unpacking = sub.add_parser("unpack", help="the parts' files under bench/results/")
    unpacking.add_argument("src", help="the folder bench/gpu_check.sh wrote (the device's $OUT)")
    unpacking.add_argument("--to", default=None, help="default: bench/results/gpu_check_<device>")
    args = parser.parse_args(argv)
    try:
        dest = unpack(Path(args.src), None if args.to is None else Path(args.to))
    except (FileNotFoundError, tarfile.TarError) as exc:
        parser.exit(2, f"gpu_run: error: {exc}\n")
    print(f"unpacked {args.src} into {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
