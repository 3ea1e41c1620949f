"""Nothing grows over a long run: after warm-up, a hundred training steps in every graphed mode
leave the Python heap exactly as they found it.

Three figures, taken after a full collection: the objects the garbage collector tracks, the tensors
among them, and the references those objects hold. The last one sees what the first two cannot:
strings and numbers are not tracked, so a list that gains a line of text per step (a trace) grows
only there. A leak of even one object per step shows as 100 after 100 steps; the figures must not
grow at all.
"""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest
import torch

from helpers import small_config

from mhc_cg.lab.registry import MODES
from mhc_cg.lab.resolve import resolve
from mhc_cg.training.session import TrainSession

GRAPHED_MODES = [name for name, mode in MODES.items() if mode.graphed]
WARMUP_STEPS = 10
SOAK_STEPS = 100


def _soak_config(mode: str):
    """The tests' small config, cut until a step takes a few tens of milliseconds on the tape (the
    tape's cost is per op, not per element): one layer, attention and MLP each a graph, one
    recompute block, one microbatch per step."""
    cfg = small_config(["attn", "mlp", "mhc_recompute"])
    cfg.model = dataclasses.replace(cfg.model, num_layers=1, hidden_size=16, num_heads=2,
                                    seq_length=8, recompute_layers=1, sinkhorn_iterations=2)
    cfg.train = dataclasses.replace(cfg.train, micro_batch_size=2, num_microbatches=1)
    return cfg


def _census() -> str:
    """JSON of ``{"figures": [objects, tensors, references], "types": {type name: objects}}``.

    A string: the garbage collector never tracks one, so a census is invisible to the next (tuples
    of numbers would be tracked until a collection noticed they hold nothing tracked). Counted by
    hand rather than by ``Counter``, whose ``isinstance(..., Mapping)`` would fill abc's caches.
    """
    gc.collect()
    objects = gc.get_objects()
    try:
        types: dict[str, int] = {}
        for o in objects:
            name = type(o).__qualname__
            types[name] = types.get(name, 0) + 1
        figures = [len(objects), sum([issubclass(type(o), torch.Tensor) for o in objects]),
                   len(gc.get_referents(*objects))]
        return json.dumps({"figures": figures, "types": types})
    finally:
        del objects


@pytest.mark.slow
def test_nothing_grows_over_a_long_run_in_any_graphed_mode():
    grown = {}
    before = after = session = None  # the census sees the same locals twice
    for mode in GRAPHED_MODES:
        cfg = _soak_config(mode)
        session = TrainSession.build(resolve(cfg, mode, "cpu"))
        for _ in range(WARMUP_STEPS):
            session.step()
        # Gradients are data (an expert no token reached has none); each step drops them first
        session.optimizer.zero_grad()
        before = _census()
        for _ in range(SOAK_STEPS):
            session.step()
        session.optimizer.zero_grad()
        after = _census()
        was, now = json.loads(before), json.loads(after)
        if any(a > b for a, b in zip(now["figures"], was["figures"])):
            more = {t: n - was["types"].get(t, 0) for t, n in now["types"].items()
                    if n > was["types"].get(t, 0)}
            grown[mode] = (f"(objects, tensors, references) {was['figures']} -> "
                           f"{now['figures']}; more of: {more}")
        session = was = now = None
    assert not grown, f"after {WARMUP_STEPS} warm-up steps, {SOAK_STEPS} steps grew: {grown}"
