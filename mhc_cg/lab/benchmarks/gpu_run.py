"""A GPU run brought back: what ``bench/gpu_check.sh`` leaves, unpacked where the results live.

A device call returns at most 8 files from its output folder (two folders down at most, 16 MiB
each), so the checklist leaves ``env.txt``, ``summary.tsv`` and one ``<part>.tar.gz`` per part.

``python -m mhc_cg.lab.benchmarks.gpu_run unpack DIR [--to DEST]``: every part's files under
``bench/results/gpu_check_<device>/`` (``<device>``: the GPU's name as a file name, ``cpu`` for a
dry run), beside ``env.txt`` and ``summary.tsv``.

``python -m mhc_cg.lab.benchmarks.gpu_run fold DIR``: the run folded back in, in one go: unpacked;
the kernels' device times and copy bandwidth merged into what the step model charges
(``bench/results/kernel_efficiency.json``) and the sweep's fastest configurations into what the
launchers read (``mhc_cg/ops/kernels/launch_configs.json``); each bench JSON back-tested on the
model of the GPU that ran, the model's error on peak and step printed per mode; and the README's
and docs' generated figures made again from the committed results
(:mod:`mhc_cg.lab.cost.doc_tables`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
from pathlib import Path

from mhc_cg.lab.cost.gpus import name_slug

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
TOP_FILES = ("env.txt", "summary.tsv")


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
        results / f"gpu_check_{name_slug(device)}"
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOP_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    for archive in sorted(src.glob("*.tar.gz")):
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")  # no absolute paths, nothing outside dest
    return dest


def fold(src: Path, results: Path = RESULTS, launch_table: Path | None = None,
         docs: bool = True) -> list[str]:
    """:func:`unpack`, then every step the module docstring lists; returns what it did, a line
    each. ``docs``: make the generated blocks of README.md and docs/ again (only when
    ``results`` is the checkout's own)."""
    from mhc_cg.lab.cost.gpus import gpu_named
    from mhc_cg.lab.cost.backtest import backtest, errors
    from mhc_cg.lab.cost.measured import efficiency_rows, gpu_runs, merge
    from mhc_cg.ops.kernels import launch

    dest = unpack(src, results=results)
    device = device_of((dest / "env.txt").read_text())
    said = [f"unpacked into {dest}"]
    timed = dest / "kernels" / "kernel_efficiency.json"
    efficiency = results / "kernel_efficiency.json"
    if timed.is_file():
        new = json.loads(timed.read_text())["rows"]
        rows = merge(new, efficiency)
        said.append(f"{efficiency}: {len(rows)} rows ({len(new)} merged)")
    else:
        rows = efficiency_rows(efficiency)
    swept = dest / "kernels" / "launch_configs.json"
    if swept.is_file():
        table = launch_table or launch.TABLE
        new = json.loads(swept.read_text())["rows"]
        said.append(f"{table}: {len(launch.merge(new, table))} rows ({len(new)} merged)")
    gpu = gpu_named(device)
    if gpu is None:
        said.append(f"back-test: none ({device} is not a GPU of the step model, "
                    f"mhc_cg/lab/cost/gpus.py)")
    for run in gpu_runs(dest / "bench") if gpu is not None else ():
        result = backtest(run["path"], rows=rows)
        said += [f"back-test of {run['path'].name} on the {gpu.name} model:", *errors(result)]
    if docs and results == RESULTS:
        from mhc_cg.lab.cost.doc_tables import main as doc_tables

        doc_tables(["write"])
        said.append("README.md and docs/: generated figures made again (python -m "
                    "mhc_cg.lab.cost.doc_tables write)")
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.lab.benchmarks.gpu_run",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    unpacking = sub.add_parser("unpack", help="the parts' files under bench/results/")
    unpacking.add_argument("src", help="the folder bench/gpu_check.sh wrote (the device's $OUT)")
    unpacking.add_argument("--to", default=None, help="default: bench/results/gpu_check_<device>")
    folding = sub.add_parser("fold", help="unpack, merge the measurements, back-test, make the "
                                          "docs' figures again")
    folding.add_argument("src", help="the folder bench/gpu_check.sh wrote (the device's $OUT)")
    args = parser.parse_args(argv)
    try:
        if args.action == "unpack":
            said = [f"unpacked into {unpack(Path(args.src), None if args.to is None else Path(args.to))}"]
        else:
            said = fold(Path(args.src))
    except (FileNotFoundError, tarfile.TarError) as exc:
        parser.exit(2, f"gpu_run: error: {exc}\n")
    print("\n".join(said))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
