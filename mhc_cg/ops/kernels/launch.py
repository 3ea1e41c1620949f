"""How the Triton kernels launch: built-in defaults, and the configurations a GPU sweep chose.

Three kernels expose a small set of launch configurations (:data:`TUNABLE`); the rest are fixed,
because two modes compare their bits (the pre backward's passes, fused or not, must sum as the
post's backward does). ``mhc-cg kernels --bench --sweep`` times every configuration on a GPU and
writes the best per (device, hidden size) as rows of the table :func:`launch_config` reads:
``launch_configs.json`` beside this file (committed), or the file ``MHC_CG_LAUNCH_CONFIGS``
names (a sweep's output before it is committed). Where the table has no row for the device and
hidden size, the built-in defaults (:data:`DEFAULTS`) apply.

Note [one configuration per process]: a configuration can change bits (the state's splits sum
the projection in another order), so every op of a process reads the same row for a device and
hidden size: the forward, its recompute and every mode compared with it agree.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

TABLE = Path(__file__).with_name("launch_configs.json")
ENV = "MHC_CG_LAUNCH_CONFIGS"

# kernel -> option -> the values a sweep tries; None: derived from the shape (fill the GPU)
TUNABLE: dict[str, dict[str, tuple]] = {
    # the pre's first pass, and the post's; rows None: 64 or 128 tokens (Note [wide token tiles])
    # pdl: programmatic dependent launch (Note [programmatic dependent launch], triton_kernels)
    "state": {"splits": (None, 2, 8), "warps": (1, 2, 4, 8), "rows": (None, 16),
              "pdl": (False, True)},
    # F's input, the post, the recompute
    "chain": {"features": (None, 64, 256), "warps": (1, 2, 4, 8), "rows": (4, 8),
              "pdl": (False, True)},
    "post_maps": {"rows": (4, 8, 16), "warps": (1, 2, 4)},  # Sinkhorn once per token
}
DEFAULTS: dict[str, dict] = {"state": {"splits": None, "warps": 4, "stages": 4, "rows": None,
                                       "pdl": False},
                             "chain": {"features": None, "warps": 4, "rows": 4, "pdl": False},
                             "post_maps": {"rows": 4, "warps": 4}}


def device_name(device: torch.device) -> str:
    """The name a table row is keyed by: the GPU's (``NVIDIA H100 80GB HBM3``), else the type."""
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    return device.type


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table_path() -> Path:
    return Path(os.environ.get(ENV) or TABLE)


def read_table(path: Path) -> list[dict]:
    """The rows of a table file (``{"rows": [{device, hidden, kernel, config, ...}]}``); none
    where there is no file. Read once per path and process
    (Note [one configuration per process]; a launch reads no file)."""
    return _rows(str(path))


@functools.cache
def _rows(path: str) -> list[dict]:
    try:
        return json.loads(Path(path).read_text())["rows"]
    except FileNotFoundError:
        return []


def launch_config(kernel: str, hidden: int, device: torch.device) -> dict:
    """``kernel``'s configuration for ``hidden`` on ``device``: the table's row, over the
    defaults (Note [one configuration per process])."""
    name = device_name(device)
    for row in read_table(table_path()):
        if row["kernel"] == kernel and row["device"] == name and row["hidden"] == hidden:
            return {**DEFAULTS[kernel], **row["config"]}
    return dict(DEFAULTS[kernel])


def candidates(kernel: str) -> list[dict]:
    """The configurations a sweep tries for ``kernel``: the defaults, then each option's other
    values one at a time (the options' values crossed would be too many for one GPU run)."""
    configs = [dict(DEFAULTS[kernel])]
    for option, values in TUNABLE[kernel].items():
        configs += [{**DEFAULTS[kernel], option: v} for v in values
                    if v != DEFAULTS[kernel][option]]
    return configs


def merged(rows: list[dict], new: list[dict]) -> list[dict]:
    """``rows`` with ``new`` in place of the rows of the same (device, hidden, kernel)."""
    key = lambda r: (r["device"], r["hidden"], r["kernel"])  # noqa: E731
    replaced = {key(r) for r in new}
    return [r for r in rows if key(r) not in replaced] + new


def merge(new: list[dict], path: Path = TABLE) -> list[dict]:
    """``new`` rows into the table file at ``path`` (:func:`merged`); returns its rows."""
    rows = merged(read_table(path), new)
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m mhc_cg.ops.kernels.launch merge SWEPT.json``: a sweep's rows into the
    committed table (replacing those of the same device, hidden size and kernel)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "merge":
        print("usage: python -m mhc_cg.ops.kernels.launch merge SWEPT.json", file=sys.stderr)
        return 2
    new = json.loads(Path(args[1]).read_text())["rows"]
    print(f"{TABLE}: {len(merge(new))} rows ({len(new)} merged)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
