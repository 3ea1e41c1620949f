"""The cost model against the one H100 run: configured with the optimizer that run trained with,
does it predict the memory and the time the GPU measured?

``python -m mhc_cg.cost.backtest [--measured bench/results/nvidia-h100-80gb-hbm3.json]``
costs every mode of that run on ``meta`` at the run's own config, with the step that run took
(:class:`PerTensorCopyAdamW`, not a user option: training runs
:class:`~mhc_cg.training.optimizer.MainParamAdamW`), and prints per mode the modelled and measured
resident bytes and peaks, and step and phase times, with their ratios (the tables in
``docs/cost.md``).

The bench measured ``torch.cuda.max_memory_allocated``: allocated bytes, so the model's figure
beside it counts of each graph pool what is allocated in it after the step
(``pool_live_bytes``: static outputs, kept activations), not what the pool reserves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from mhc_cg.config import RunConfig
from mhc_cg.cost.bandwidth import charging
from mhc_cg.cost.measured import RESULTS, copy_share, fused_charges
from mhc_cg.cost.report import cost_mode, mode_configs
from mhc_cg.training.optimizer import StepResult

MEASURED = RESULTS / "nvidia-h100-80gb-hbm3.json"
# the same run's profiles: GPU ms per range name, graphed_static (A) against eager_none (B)
TIMELINE = RESULTS / "gpu_check_h100" / "timeline" / "graphed_static_vs_eager_none.txt"
MODES = ("eager_none", "eager_block", "graphed_none", "graphed_static", "attn_split")
PHASES = ("forward", "optimizer")  # the ranges the profiles attribute (autograd's thread: not the
                                   # backward)


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


def backtest(measured_path: Path = MEASURED, modes: tuple[str, ...] = MODES) -> dict:
    """Per mode of the run (of ``modes``): ``resident`` and ``peak``, modelled and measured, in
    bytes."""
    measured = json.loads(Path(measured_path).read_text())
    cfg = RunConfig.from_dict(measured["config"]).replace(graph={"backend": "auto"})
    configs = dict(mode_configs(cfg, "meta")[0])
    profiled = profiled_phases()
    # the fused kernels at the shares the H100 measured for their kinds (at 8b1b9b9, the kernels
    # closest to that run's)
    shares, copy = {op: c["share"] for op, c in fused_charges().items()}, copy_share()
    rows = {}
    for mode in modes:
        if mode not in measured["modes"]:
            continue
        with charging(shares, copy):
            cost = cost_mode(configs[mode], optimizer=PerTensorCopyAdamW)
        memory = cost["peak_memory"]
        resident = memory["model_state"] + memory["static"] + cost["pool_live_bytes"]
        step_peak = max(cost["step_peak_by_phase"].values())
        got = measured["modes"][mode]
        rows[mode] = {"modelled_resident": resident, "measured_resident": got["resident_bytes"],
                      "modelled_peak": resident + step_peak,
                      "measured_peak": got["peak_mem_bytes"], "peak_phase": cost["peak_phase"],
                      "pool_reserved": cost["pool_reserved_bytes"],
                      "pool_live": cost["pool_live_bytes"],
                      "modelled_step_ms": 1e3 * cost["predicted_h100_step_s"],
                      "measured_step_ms": got["step_ms_median"],
                      # kernel time alone: the profiles measured kernel intervals
                      "modelled_ms_by_phase": {p: 1e3 * s for p, s in
                                               cost["kernel_s_by_phase"].items()},
                      "measured_ms_by_phase": profiled.get(mode, {}),
                      "optimizer_kernels": cost["kernels_by_phase"].get("optimizer", 0)}
    return {"measured": str(measured_path), "device": measured["device"], "modes": rows}


def profiled_phases(timeline: Path = TIMELINE) -> dict[str, dict[str, float]]:
    """GPU ms per step of each phase in :data:`PHASES`, per mode, from a ``mhc-cg timeline
    compare`` table (``range n_A n_B gpu_ms_A gpu_ms_B ...``); {} without the file."""
    if not timeline.exists():
        return {}
    lines = timeline.read_text().splitlines()
    modes = [line[4:].split(":")[0] for line in lines if line[:4] in ("A = ", "B = ")]
    out: dict[str, dict[str, float]] = {mode: {} for mode in modes}
    for line in lines:
        cells = line.split()
        if cells and cells[0] in PHASES:
            for mode, n, ms in zip(modes, cells[1:3], cells[3:5]):
                out[mode][cells[0]] = float(ms) / int(n)
    return out


def markdown(result: dict) -> str:
    mib = 2 ** 20
    lines = ["| mode | resident, modelled | measured | ratio | peak, modelled (at) | measured "
             "| ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, r in result["modes"].items():
        lines.append(
            f"| `{mode}` | {r['modelled_resident'] / mib:.1f} MiB | "
            f"{r['measured_resident'] / mib:.1f} MiB | "
            f"{r['modelled_resident'] / r['measured_resident']:.3f} | "
            f"{r['modelled_peak'] / mib:.1f} MiB ({r['peak_phase']}) | "
            f"{r['measured_peak'] / mib:.1f} MiB | {r['modelled_peak'] / r['measured_peak']:.3f} |")
    lines += ["", "| mode | time | modelled ms | measured ms | ratio |", "|---|---|---:|---:|---:|"]
    for mode, r in result["modes"].items():
        timed = [("step (wall)", r["modelled_step_ms"], r["measured_step_ms"])]
        timed += [(f"{phase} (GPU kernels)", r["modelled_ms_by_phase"].get(phase, 0.0), ms)
                  for phase, ms in r["measured_ms_by_phase"].items()]
        lines += [f"| `{mode}` | {phase} | {model:.2f} | {got:.2f} | {model / got:.3f} |"
                  for phase, model, got in timed]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_cg.cost.backtest",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", default=str(MEASURED), help="a `mhc-cg bench` JSON")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = backtest(Path(args.measured))
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
