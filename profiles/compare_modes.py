"""Compare one mode's trace against every other mode's: ``mhc-cg timeline compare`` in one process.

Usage (from the repository root)::

    python profiles/compare_modes.py --traces DIR --base graphed_static --out OUT_DIR

reads ``DIR/<mode>.json.gz`` (as ``profiles/profile_torch.py`` writes them) and writes, for every
other mode, ``OUT_DIR/<base>_vs_<mode>.txt`` (the table) and ``.json``: what
``mhc-cg timeline compare DIR/<base>.json.gz DIR/<mode>.json.gz --labels <base> <mode>`` prints,
with the base trace parsed once. Exits 1 if the base trace or any other is missing or unreadable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mhc_cg.lab.profiling.traces import compare, comparison_json, format_comparison, read_timeline

SUFFIX = ".json.gz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", required=True, help=f"folder of <mode>{SUFFIX} traces")
    parser.add_argument("--base", default="graphed_static", help="the mode compared against the others")
    parser.add_argument("--out", required=True, help="folder for <base>_vs_<mode>.{txt,json}")
    args = parser.parse_args(argv)
    traces, out = Path(args.traces), Path(args.out)
    base_path = traces / f"{args.base}{SUFFIX}"
    if not base_path.exists():
        print(f"compare_modes: no {args.base} trace at {base_path}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    base = read_timeline(base_path)
    status = 0
    for path in sorted(traces.glob(f"*{SUFFIX}")):
        mode = path.name[:-len(SUFFIX)]
        if mode == args.base:
            continue
        try:
            comparison = compare(base, read_timeline(path), (args.base, mode))
        except Exception as exc:  # noqa: BLE001 - one unreadable trace does not stop the others
            print(f"compare_modes: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
            continue
        stem = out / f"{args.base}_vs_{mode}"
        stem.with_suffix(".txt").write_text(format_comparison(comparison) + "\n")
        stem.with_suffix(".json").write_text(json.dumps(comparison_json(comparison), indent=1) + "\n")
        print(f"wrote {stem}.txt and .json")
    return status


if __name__ == "__main__":
    sys.exit(main())
