"""The cost model against a GPU run: does it predict the memory and the time the GPU measured?

``python -m mhc_cg.lab.cost.backtest [--measured A_BENCH.json]`` costs every mode of a ``mhc-cg
bench`` JSON on ``meta`` at the run's own config, on the step model of the GPU that ran
(:func:`~mhc_cg.lab.cost.gpus.gpu_named`), and prints per mode the modelled and measured peaks and
step, and their ratios (the tables in ``docs/cost.md``).

Two kinds of run. The first H100 run (b48c0ff, the default ``--measured``) built every mode side
by side in one process and trained with another step than training runs now: it is costed with
that step (:class:`PerTensorCopyAdamW`, not a user option) and its "resident" bytes and peaks.
Runs of ``mhc-cg bench`` since measure each mode in a process of its own, with the session's
optimizer: ``torch.cuda.max_memory_allocated`` (the model's pools counted by what is allocated in
them after the step, ``pool_live_bytes``) and ``max_memory_reserved`` (pools at their high-water
mark, the model's peak).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from mhc_cg.config import RunConfig
from mhc_cg.lab.cost.gpus import gpu_named
from mhc_cg.lab.cost.measured import RESULTS
from mhc_cg.lab.cost.report import cost_mode, mode_configs, step_band
from mhc_cg.lab.cost.step_model import Band, step_model
from mhc_cg.training.optimizer import StepResult
from mhc_cg.training.session import optimizer_for

MEASURED = RESULTS / "nvidia-h100-80gb-hbm3.json"
# the same run's profiles: GPU ms per range name, graphed_static (A) against eager_none (B)
TIMELINE = RESULTS / "gpu_check_h100" / "timeline" / "graphed_static_vs_eager_none.txt"
MODES = ("eager_none", "eager_block", "graphed_none", "graphed_static", "attn_split")
# the ranges the measured profiles attribute (autograd's thread: not the backward)
MEASURED_PHASES = ("forward", "optimizer")


class PerTensorCopyAdamW:
    """The step the H100 run (code of b48c0ff) trained with: fp32 main copies per parameter, the
    bf16 gradients cast to new fp32 tensors one by one, ``isfinite().all()`` per gradient,
    ``clip_grad_norm_`` and ``torch.optim.AdamW`` (foreach, as on CUDA), each main parameter
    copied back; gradients set to ``None`` before each step. The interface is the one
    :class:`~mhc_cg.training.session.TrainSession` drives; the host reads (the inf flag, the
    norm) are left out, as meta tensors have no values."""

    def __init__(self, cfg: RunConfig, params):
        self.model_params = [p for p in params if p.requires_grad]
        self.main_params = [nn.Parameter(p.detach().to(torch.float32).clone())
                            for p in self.model_params]
        self.optimizer = torch.optim.AdamW(self.main_params, lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay, foreach=True)
        self.zero = torch.zeros((), device=self.model_params[0].device)
        for p in self.model_params:  # as that run's first step found them
            p.grad = None

    def state_tensors(self) -> list[Tensor]:
        state = [t for s in self.optimizer.state.values() for t in s.values()
                 if isinstance(t, Tensor) and t.device.type != "cpu"]
        return [*self.model_params, *self.main_params, *state, self.zero]

    def reserve_staging(self, workspace: Tensor | None = None) -> None:
        for p in self.main_params:  # AdamW makes its moments at the first step: before it here
            state = self.optimizer.state[p]
            state["step"] = torch.tensor(0.0, device="cpu")  # where torch keeps it
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)

    def zero_grad(self) -> None:
        for p in (*self.model_params, *self.main_params):
            p.grad = None

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def step(self, workspace: Tensor | None = None) -> StepResult:
        for main, p in zip(self.main_params, self.model_params):
            main.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        grads = [m.grad for m in self.main_params if m.grad is not None]
        torch.stack([torch.isfinite(g).all() for g in grads]).all()
        # clip_grad_norm_(main_params, inf) as on CUDA (its foreach path, which meta refuses)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, float("inf"))),
                                        float("inf"))
        torch._foreach_mul_(grads, torch.clamp(float("inf") / (norm + 1e-6), max=1.0))
        self.optimizer.step()
        for main, p in zip(self.main_params, self.model_params):
            p.copy_(main)
        return StepResult(norm, self.zero)

    def update(self, found_inf: bool) -> None:
        pass


def is_side_by_side(measured: dict) -> bool:
    """A run of the first bench (every mode in one process; per mode its resident bytes)."""
    return any("resident_bytes" in e for e in measured["modes"].values())


def backtest(measured_path: Path = MEASURED, modes: tuple[str, ...] | None = None,
             rows: list[dict] | None = None) -> dict:
    """Per mode of the run (of ``modes``; default every mode it measured): peak and step,
    modelled (a band for the step) and measured, on the model of the GPU that ran (from the
    measurement rows ``rows``, default the committed ones)."""
    measured = json.loads(Path(measured_path).read_text())
    gpu = gpu_named(measured["device"])
    if gpu is None:
        raise ValueError(f"{measured_path}: measured on {measured['device']!r}, a device the "
                         f"step model does not know (mhc_cg/lab/cost/gpus.py)")
    model = step_model(gpu.key, rows)
    side_by_side = is_side_by_side(measured)
    # mode_configs keeps a TE run on TE's function and costs every other on the recording backend
    configs = dict(mode_configs(RunConfig.from_dict(measured["config"]), "meta")[0])
    profiled = profiled_phases() if side_by_side else {}
    rows = {}
    for mode, got in measured["modes"].items():
        if (modes is not None and mode not in modes) or mode not in configs \
                or got.get("step_ms_median") is None:
            continue
        cost = cost_mode(configs[mode], optimizer=PerTensorCopyAdamW if side_by_side
                         else optimizer_for, model=model)
        memory = cost["peak_memory"]
        allocated = memory["model_state"] + memory["static"] + cost["pool_live_bytes"]
        step_peak = max(cost["step_peak_by_phase"].values())
        row = {"peak_phase": cost["peak_phase"], "pool_reserved": cost["pool_reserved_bytes"],
               "pool_live": cost["pool_live_bytes"],
               "modelled_step_ms": step_band(cost).scaled(1e3).as_dict(),
               "measured_step_ms": got["step_ms_median"],
               # kernel time alone: the profiles measured kernel intervals
               "modelled_ms_by_phase": {p: Band(**s).scaled(1e3).as_dict()
                                        for p, s in cost["kernel_s_by_phase"].items()},
               "measured_ms_by_phase": profiled.get(mode, {}),
               "optimizer_kernels": cost["kernels_by_phase"].get("optimizer", 0),
               "modelled_peak": allocated + step_peak}
        if side_by_side:  # its peaks: max allocated less the other modes' resident bytes
            row.update(modelled_resident=allocated, measured_resident=got["resident_bytes"],
                       measured_peak=got["peak_mem_bytes"])
        else:
            row.update(measured_peak=got.get("peak_allocated_bytes"),
                       modelled_reserved=cost["peak_bytes"],
                       measured_reserved=got.get("peak_reserved_bytes"))
        rows[mode] = row
    return {"measured": str(measured_path), "device": measured["device"], "gpu": gpu.key,
            "code": measured.get("code"), "side_by_side": side_by_side, "modes": rows}


def profiled_phases(timeline: Path = TIMELINE) -> dict[str, dict[str, float]]:
    """GPU ms per step of each phase in :data:`MEASURED_PHASES`, per mode, from a ``mhc-cg timeline
    compare`` table (``range n_A n_B gpu_ms_A gpu_ms_B ...``); {} without the file."""
    if not timeline.exists():
        return {}
    lines = timeline.read_text().splitlines()
    modes = [line[4:].split(":")[0] for line in lines if line[:4] in ("A = ", "B = ")]
    out: dict[str, dict[str, float]] = {mode: {} for mode in modes}
    for line in lines:
        cells = line.split()
        if cells and cells[0] in MEASURED_PHASES:
            for mode, n, ms in zip(modes, cells[1:3], cells[3:5]):
                out[mode][cells[0]] = float(ms) / int(n)
    return out


def errors(result: dict) -> list[str]:
    """Per mode, the model's error against the run: peak and step, modelled / measured - 1."""
    lines = [f"{'mode':20} {'peak error':>11} {'step error (low to high)':>26}"]
    for mode, r in result["modes"].items():
        peak = "-" if not r["measured_peak"] else f"{r['modelled_peak'] / r['measured_peak'] - 1:+.1%}"
        step = Band(**r["modelled_step_ms"]).scaled(1 / r["measured_step_ms"]) + -1.0
        lines.append(f"{mode:20} {peak:>11} {f'{step.low:+.1%} to {step.high:+.1%}':>26}")
    return lines


def _ratio(model: float | None, got: float | None) -> str:
    return "-" if not model or not got else f"{model / got:.3f}"


def markdown(result: dict) -> str:
    """The back-test as two tables: memory, then time (modelled over measured; a band's ratio
    from its low to its high end)."""
    mib = 2 ** 20
    size = lambda b: "-" if b is None else f"{b / mib:.1f} MiB"  # noqa: E731
    lines = [f"{result['device']} ({result['gpu']} in the model), code {result['code']}: "
             f"{result['measured']}", ""]
    # (the column's title, the figure: modelled_<key> and measured_<key>, at the peak's phase)
    pairs = ([("resident, modelled", "resident", False), ("peak, modelled (at)", "peak", True)]
             if result["side_by_side"] else
             [("max allocated, modelled (at)", "peak", True), ("max reserved, modelled", "reserved",
                                                              False)])
    lines += ["| mode | " + " | ".join(f"{title} | measured | ratio" for title, _, _ in pairs)
              + " |", "|---|" + "---:|" * 3 * len(pairs)]
    for mode, r in result["modes"].items():
        cells = []
        for _, key, at in pairs:
            model, got = r[f"modelled_{key}"], r[f"measured_{key}"]
            cells += [size(model) + (f" ({r['peak_phase']})" if at else ""), size(got),
                      _ratio(model, got)]
        lines.append(f"| `{mode}` | " + " | ".join(cells) + " |")
    lines += ["", "| mode | time | modelled ms (low-high) | measured ms | modelled / measured |",
              "|---|---|---:|---:|---:|"]
    for mode, r in result["modes"].items():
        timed = [("step (wall)", r["modelled_step_ms"], r["measured_step_ms"])]
        timed += [(f"{phase} (GPU kernels)", r["modelled_ms_by_phase"].get(
                   phase, {"low": 0.0, "high": 0.0}), ms)
                  for phase, ms in r["measured_ms_by_phase"].items()]
        for phase, model, got in timed:
            band = Band(**model)
            lines.append(f"| `{mode}` | {phase} | {band.format('.2f')} | {got:.2f} | "
                         f"{band.scaled(1 / got).format('.3f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.lab.cost.backtest",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", default=str(MEASURED),
                        help="a `mhc-cg bench` JSON (default: the first H100 run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = backtest(Path(args.measured))
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
