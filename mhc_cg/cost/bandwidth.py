"""How much of the HBM bandwidth each fused mHC kernel can draw, for the step model.

``mhc-cg kernels`` compiles every fused Triton kernel for sm_90a and applies Little's law: the
bytes an SM keeps in flight (resident warps x the loads each keeps outstanding) against the
bandwidth-latency product per SM. A kernel below it cannot reach the bandwidth; its ``share`` is
the fraction it can. :func:`kernel_shares` reads those shares for one shape, per fused op (the
lowest share among the kernels its launcher makes in any of its cases, capped at 1), and
:func:`charging` makes the cost model time each fused op's bytes at ``share x`` the bandwidth.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# the fused op -> the ``mhc-cg kernels`` case (or cases, for an op whose arguments choose what it
# launches) that launches what it launches
OP_CASES: dict[str, str | tuple[str, ...]] = {
    "mhc_cg::pre": "pre", "mhc_cg::pre_into": "pre",
    # in a chain a pre's backward takes its posts' halves (in place or not); alone it does not
    "mhc_cg::pre_backward": ("pre_backward", "pre_backward[no norm]", "pre_backward[fused]"),
    "mhc_cg::pre_backward_into": ("pre_backward[in place]", "pre_backward[fused]"),
    "mhc_cg::post_grad_y": "post_grad_y",
    "mhc_cg::post_maps": "post_maps", "mhc_cg::post": "post", "mhc_cg::post_into": "post",
    "mhc_cg::post_state": "post_state", "mhc_cg::post_state_into": "post_state",
    "mhc_cg::pre_from_state": "fn_input", "mhc_cg::pre_from_state_into": "fn_input",
    "mhc_cg::post_backward": "post_backward",
    "mhc_cg::recompute": "recompute", "mhc_cg::rms_norm": "rms_norm",
    "mhc_cg::rms_norm_backward": "rms_norm_backward", "mhc_cg::cross_entropy": "cross_entropy",
    "mhc_cg::cross_entropy_backward": "cross_entropy_backward",
}

_CHARGED: dict[str, float] = {}
_COPY_SHARE: list[float] = [1.0]


def kernel_shares(hidden: int, tokens: int, target: str = "sm_90a") -> dict[str, float]:
    """``{fused op: share of the bandwidth}`` at ``hidden`` and ``tokens`` for ``target``
    (compiles the kernels ahead of time: needs Triton, not a GPU)."""
    from mhc_cg.benchmarks.kernel_compile import kernel_report

    report = kernel_report(hidden=(hidden,), tokens=tokens, target=target)
    lowest: dict[str, float] = {}
    for kernel in report["shapes"][0]["kernels"]:
        share = kernel["bandwidth_share"]
        if share is not None:
            lowest[kernel["case"]] = min(lowest.get(kernel["case"], share), share)
    shares = {}
    for op, cases in OP_CASES.items():
        found = [lowest[case] for case in ((cases,) if isinstance(cases, str) else cases)
                 if case in lowest]
        if found:
            shares[op] = min(1.0, *found)
    return shares


@contextlib.contextmanager
def charging(shares: dict[str, float] | None, copy_share: float | None = None) -> Iterator[None]:
    """Inside, the cost model times every kernel's bytes at ``copy_share`` of the peak bandwidth
    (the measured copy bandwidth; ``None``: the peak) and each fused op's at its share of that."""
    previous, previous_copy = dict(_CHARGED), _COPY_SHARE[0]
    _CHARGED.clear()
    _CHARGED.update(shares or {})
    _COPY_SHARE[0] = copy_share or 1.0
    try:
        yield
    finally:
        _CHARGED.clear()
        _CHARGED.update(previous)
        _COPY_SHARE[0] = previous_copy


def share_of(func: torch._ops.OpOverload) -> float:
    """The share of the peak bandwidth ``func``'s kernels draw (1 unless charged)."""
    return _COPY_SHARE[0] * _CHARGED.get(func._schema.name, 1.0)
