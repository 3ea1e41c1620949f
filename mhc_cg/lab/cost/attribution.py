"""Where a step's bytes go, in the units the mHC literature uses.

A recorded step's bytes are split by ``(phase, part)`` (:func:`mhc_cg.lab.cost.op_counters.part_of`):
phases ``forward``, ``recompute``, ``backward``, ``optimizer``; parts the fused mHC ops, other ops
on n-stream tensors (GEMMs, adds, the rest), F and the rest (GEMMs, attention, embedding, head,
loss), the optimizer, and each copy the runtime adds, by name. The mHC traffic is reported per
token and sublayer in units of C, one ``C``-wide row of the model's dtype: the paper's unit
(Table 2), independent of the shape. What a step takes in time: :mod:`mhc_cg.lab.cost.step_model`.
"""

from __future__ import annotations

from collections import Counter

from mhc_cg.config import RunConfig
from mhc_cg.core.dtypes import DTYPE_BYTES
from mhc_cg.lab.cost.op_counters import MHC_PARTS

# Per token and sublayer, in C (n = 4, C large): the mHC paper's Table 2 forward, unfused, and
# with H_res, H_post and the merge fused into one kernel; an estimated lower bound for forward and
# backward with post(l) and pre(l+1) fused at each boundary, and a paper-style kernel split.
REFERENCE_C = {"paper Table 2 forward, unfused": 34.0,
               "paper Table 2 forward, H_res/H_post/merge fused": 18.0,
               "bound estimate, forward and backward": 25.0,
               "paper-style split, forward and backward": 57.0}


def c_unit_bytes(cfg: RunConfig) -> int:
    """Bytes of one C-wide row for every token and sublayer of a step: 1 C of traffic."""
    m, t = cfg.model, cfg.train
    tokens = m.seq_length * t.micro_batch_size * t.num_microbatches
    return tokens * 2 * m.num_layers * m.hidden_size * DTYPE_BYTES[t.dtype]


def by_phase_and_part(by_part: Counter) -> dict[str, dict[str, int]]:
    """``{phase: {part: bytes}}`` from a ``(phase, part) -> bytes`` counter."""
    table: dict[str, dict[str, int]] = {}
    for (phase, part), nbytes in sorted(by_part.items()):
        table.setdefault(phase, {})[part] = nbytes
    return table


def mhc_traffic_c(by_part: Counter, cfg: RunConfig) -> dict[str, float]:
    """The mHC traffic per token and sublayer, in C: forward, recompute, backward and in all."""
    unit = c_unit_bytes(cfg)
    out = {phase: sum(b for (p, part), b in by_part.items() if p == phase and part in MHC_PARTS)
           / unit for phase in ("forward", "recompute", "backward")}
    out["total"] = sum(out.values())
    return out


def copies(by_part: Counter) -> dict[str, int]:
    """Bytes per step of each copy the runtime adds, by name."""
    named = Counter()
    for (_, part), nbytes in by_part.items():
        if part.startswith("copy: "):
            named[part[len("copy: "):]] += nbytes
    return dict(named.most_common())


def recompute_bound_bytes(cfg: RunConfig, layers: int, activation_layers: int) -> int:
    """What a block's recompute must move at least, per microbatch: read the block input (n C per
    token) once; per sublayer read F's output (C) and write what the backward reads, the stream
    (n C) and F's input (C); per MLP whose activation is recomputed, read fc1's output and write
    the activation (ffn each)."""
    m = cfg.model
    tokens = m.seq_length * cfg.train.micro_batch_size
    n, c = m.num_streams, m.hidden_size
    elements = n * c + 2 * layers * (n + 2) * c + activation_layers * 2 * m.ffn_hidden_size
    return tokens * elements * DTYPE_BYTES[cfg.train.dtype]
