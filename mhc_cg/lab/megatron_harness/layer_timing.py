"""One step of Megatron-LM's own mHC layer timed three ways in one process:
``mhc-cg megatron --config F --layer-time``.

* ``native``: the layer's own forward on Megatron's native mHC ops, their ``torch.compile`` on
  (as a user runs them; on a CPU eager: the child runs with compile off, and Inductor on a CPU
  times nothing a GPU user sees);
* ``mhc_cg_fused``: the same layer through mhc_cg's fused step adapters (Triton on CUDA, the
  torch reference on a CPU), in the branch's arithmetic;
* ``dev_fused_module`` (dev only): a second layer with the same weights and dev's own
  ``use_fused_mhc`` (its Triton/cuTile kernels, torch where it has none), its own forward; not
  run on a CPU, where its Triton kernels have no device.

Each: ``warmup`` steps (compilation happens there; their wall time is reported), then ``steps``
forward-and-backward steps, timed with CUDA events on a GPU (host time on a CPU), dropout 0.
"""

from __future__ import annotations

import time

import torch


def _run(forward, x: torch.Tensor) -> None:
    out = forward(x)
    out.backward(torch.ones_like(out))


def _timed(forward, x: torch.Tensor, steps: int, warmup: int) -> dict:
    cuda = x.is_cuda
    began = time.perf_counter()
    for _ in range(warmup):
        _run(forward, x)
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - began
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            _run(forward, x)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / steps
    else:
        began = time.perf_counter()
        for _ in range(steps):
            _run(forward, x)
        ms = (time.perf_counter() - began) * 1e3 / steps
    return {"ms_per_step": ms, "warmup_s": warm_s, "steps": steps,
            "clock": "cuda events" if cuda else "host"}


def layer_timing(config, spec, seq: int, micro_batch: int, fused_steps, *, steps: int,
                 warmup: int, dev_fused_config=None) -> dict:
    """``{variant: {ms_per_step, warmup_s, steps, clock}}`` (see the module docstring);
    ``dev_fused_config``: the same config with dev's ``use_fused_mhc`` (None: no such run)."""
    from mhc_cg.lab.megatron_harness.layer_cost import OneLayer, build_layer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    one = OneLayer(config, build_layer(config, spec, device), seq, micro_batch, fused_steps,
                   make=torch.randn)
    x = one.x
    result = {}
    with torch._dynamo.config.patch(disable=device.type != "cuda"):  # compiled where a user runs it
        result["native"] = {**_timed(one.native, x, steps, warmup),
                            "compiled": device.type == "cuda"}
    result["mhc_cg_fused"] = _timed(one.fused, x, steps, warmup)
    if dev_fused_config is not None:
        if device.type != "cuda":
            result["dev_fused_module"] = {"not_run": "dev's fused mHC kernels are Triton/cuTile "
                                                     "on CUDA; this machine has no GPU"}
        else:
            theirs = build_layer(dev_fused_config, spec, device)
            theirs.load_state_dict(one.layer.state_dict())
            with torch._dynamo.config.patch(disable=False):
                result["dev_fused_module"] = _timed(lambda h: one.native(h, theirs), x, steps,
                                                    warmup)
    base = result["mhc_cg_fused"]["ms_per_step"]
    for name, r in result.items():
        if "ms_per_step" in r:
            r["over_mhc_cg_fused"] = r["ms_per_step"] / base if base > 0 else None
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "shape": one.shape,
            "runs": result}
