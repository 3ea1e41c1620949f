"""The figures the README and docs/ quote, made by the commands that produce them.

A generated block in a markdown file sits between ``<!-- generated: python -m
mhc_cg.lab.cost.doc_tables KEY -->`` and ``<!-- end generated -->``; :data:`BLOCKS` makes each KEY.

``python -m mhc_cg.lab.cost.doc_tables write``: every block of README.md and docs/*.md made again;
``... check``: exit 1, naming the stale blocks, where one differs from what the code makes now
(``tests/test_docs.py`` runs the README's); ``... show KEY``: one block on stdout.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

from mhc_cg.config import load_config
from mhc_cg.lab.cost.gpus import gpu_named
from mhc_cg.lab.cost.measured import RESULTS, gpu_runs
from mhc_cg.lab.registry import MODES, PLAIN

ROOT = Path(__file__).resolve().parents[3]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
BENCH, MEMORY, WIDE = "configs/bench_h100.yaml", "configs/bench_h100_memory.yaml", \
    "configs/frontier_h100_7168.yaml"
DEMO = "configs/tiny_cpu.yaml"
BLOCK = re.compile(r"(<!-- generated: python -m mhc_cg\.lab\.cost\.doc_tables (?P<key>[\w-]+) -->\n)"
                   r"(?P<body>.*?)(<!-- end generated -->)", re.S)
GIB = 2 ** 30


class Reports:
    """``mhc-cg cost`` reports, each made once per process, config and device."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, str], dict] = {}

    def __call__(self, config: str, device: str = "meta") -> dict:
        if (config, device) not in self._made:
            from mhc_cg.lab.cost.report import cost_report

            self._made[config, device] = cost_report(load_config(ROOT / config), device, config)
        return self._made[config, device]


def _step(mode: dict) -> str:
    from mhc_cg.lab.cost.report import step_band

    return step_band(mode).scaled(1e3).format(".1f", " ms")


def _peak(mode: dict, at: bool = False) -> str:
    return f"{mode['peak_bytes'] / GIB:.2f} GiB" + (f" ({mode['peak_phase']})" if at else "")


def modelled(reports: Reports) -> str:
    """README: every mode at the bench shape and the memory shape, the step as its band."""
    from mhc_cg.lab.cost.report import overhead_text

    bench, memory = reports(BENCH), reports(MEMORY)
    lines = ["| mode | what runs | bench peak | bench step | mHC overhead | memory-shape peak | "
             "memory-shape step |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, m in bench["modes"].items():
        wide = memory["modes"][name]
        overhead = "-" if name == PLAIN else overhead_text(m["mhc_overhead"])
        lines.append(f"| `{name}` | {MODES[name].summary} | {_peak(m)} | {_step(m)} | "
                     f"{overhead} | {_peak(wide)} | {_step(wide)} |")
    return "\n".join(lines + ["", model_line(bench["gpu"])])


def model_line(gpu: dict) -> str:
    """One sentence of what the step model charged (``mhc-cg cost`` prints it whole)."""
    copy, bf16 = gpu["copy_charged"], gpu["figures"]["dense bf16"]
    highs = [c["high"] for c in gpu["fused"].values() if c["low"] != c["high"]]
    fused = ("the fused mHC kernels as measured at this code" if not highs else
             f"the fused mHC kernels from that (low) to {min(highs):.1%}-{max(highs):.1%} of it "
             f"(high: their kind's share, timed as eager calls)")
    return (f"Modelled on the {gpu['name']}: bytes at {copy['value'] / 1e12:.2f} TB/s "
            f"({copy['source'].split(':')[0]} copy bandwidth), GEMMs at "
            f"{bf16['value'] / 1e12:.0f} TFLOP/s ({bf16['source'].split(':')[0]}), {fused}; "
            f"+ {gpu['eager_launch_s'] * 1e6:.0f} us per eager launch, "
            f"+ {gpu['graph_launch_s'] * 1e6:.0f} us per graph replay.")


def frontier(reports: Reports) -> str:
    """docs/cost.md: every mode's peak and step at the three frontier shapes."""
    shapes = [("bench", reports(BENCH)), ("memory shape", reports(MEMORY)), ("7168", reports(WIDE))]
    lines = ["| mode | " + " | ".join(f"{s} peak (at) | {s} step (model)" for s, _ in shapes) + " |",
             "|---|" + "---:|---:|" * len(shapes)]
    for name in shapes[0][1]["modes"]:
        cells = [f"{_peak(r['modes'][name], at=True)} | {_step(r['modes'][name])}"
                 for _, r in shapes]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_summary(reports: Reports, config: str = BENCH, device: str = "meta") -> str:
    """docs/cost.md: ``mhc-cg cost --config configs/bench_h100.yaml --device meta --summary``."""
    from mhc_cg.lab.cost.report import format_report

    return "\n".join(["```", f"$ mhc-cg cost --config {config} --device {device} --summary",
                      format_report(reports(config, device), per_graph=False), "```"])


def cost_demo(reports: Reports) -> str:
    """docs/cost.md: the same at the demo shape, on the CPU."""
    return cost_summary(reports, DEMO, "cpu")


def backtest_tables(reports: Reports) -> str:
    """docs/cost.md: the back-test of the first H100 run."""
    from mhc_cg.lab.cost.backtest import backtest, markdown

    return "\n".join(["```", "$ python -m mhc_cg.lab.cost.backtest", "```", "",
                      markdown(backtest()).replace(str(ROOT) + "/", "")])


def measured(reports: Reports, results: Path = RESULTS) -> str:
    """README: each committed GPU run's peak and step per mode, as the bench recorded them."""
    runs = gpu_runs(results)
    if not runs:
        return "No GPU run is committed (bench/results/)."
    heads, rows = [], {}
    for run in runs:
        gpu = gpu_named(run["device"])
        label = f"{gpu.key.upper() if gpu else run['device']}, {run.get('code')}"
        heads.append(label)
        for name, entry in run["modes"].items():
            peak = entry.get("peak_allocated_bytes", entry.get("peak_mem_bytes"))
            step = entry.get("step_ms_median")
            rows.setdefault(name, {})[label] = (
                "-" if peak is None else f"{peak / 2 ** 20:.1f}",
                "-" if step is None else f"{step:.2f}")
    lines = ["| mode | " + " | ".join(f"peak MiB ({h}) | step ms ({h})" for h in heads) + " |",
             "|---|" + "---:|---:|" * len(heads)]
    for name in [m for m in MODES if m in rows]:
        cells = [" | ".join(rows[name].get(h, ("-", "-"))) for h in heads]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {run['device']}, code {run.get('code')}, {run.get('date', '')[:10]}, "
                     f"torch {run.get('torch')}: `{run['path'].relative_to(ROOT)}`"
                     for run in runs]
    return "\n".join(lines)


BLOCKS: dict[str, Callable[[Reports], str]] = {
    "modelled": modelled, "measured": measured, "frontier": frontier,
    "cost-summary": cost_summary, "cost-demo": cost_demo, "backtest": backtest_tables}


def regenerate(text: str, reports: Reports) -> str:
    """``text`` with every generated block made again."""
    return BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group("key")](reports) + "\n" + m.group(4),
                     text)


def blocks_of(text: str) -> dict[str, str]:
    return {m.group("key"): m.group("body") for m in BLOCK.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.lab.cost.doc_tables",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("write", "check", "show"))
    parser.add_argument("key", nargs="?", choices=sorted(BLOCKS))
    args = parser.parse_args(argv)
    reports = Reports()
    if args.action == "show":
        if args.key is None:
            parser.error("show: name the block (one of " + ", ".join(sorted(BLOCKS)) + ")")
        print(BLOCKS[args.key](reports))
        return 0
    stale = []
    for path in DOCS:
        text = path.read_text()
        if not BLOCK.search(text):
            continue
        made = regenerate(text, reports)
        if made != text:
            now = blocks_of(made)
            stale += [f"{path.relative_to(ROOT)}: {key}" for key, body in blocks_of(text).items()
                      if now[key] != body]
            if args.action == "write":
                path.write_text(made)
    verb = "made again" if args.action == "write" else "stale"
    for line in stale:
        print(f"{verb}: {line}", file=sys.stderr)
    return 1 if stale and args.action == "check" else 0


if __name__ == "__main__":
    raise SystemExit(main())
