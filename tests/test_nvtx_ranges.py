"""NVTX / record_function ranges: names, the off switch, balanced stacks, and the train loop's ranges."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mhc_cg.core import nvtx as nvtx_ranges
from mhc_cg.config import RunConfig
from mhc_cg.core.nvtx import (NO_RANGE, enable, enabled_parts, nvtx_range, profiler_recording,
                                 range_name)
from mhc_cg.lab.resolve import train_config


@pytest.fixture(autouse=True)
def _restore_switches():
    parts = enabled_parts()
    yield
    enable(parts["nvtx"], record_function=parts["record_function"])


class _RecordingDomain:
    """Stands in for an nvtx domain with a tool attached: logs pushes and pops."""

    def __init__(self):
        self.log: list[str] = []
        self.attribute_calls = 0

    def get_event_attributes(self, message, color):
        self.attribute_calls += 1
        return ("attrs", message, color)

    def push_range(self, attributes):
        self.log.append(f"push {attributes[1]}")

    def pop_range(self):
        self.log.append("pop")


@pytest.fixture
def domain(monkeypatch):
    recording = _RecordingDomain()
    monkeypatch.setattr(nvtx_ranges, "_domain", recording)
    monkeypatch.setattr(nvtx_ranges, "_attributes", {})
    return recording


def _annotation_names(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name in {"fwd/0/1/2", "step", "forward", "backward",
                                                          "optimizer", "recompute/1/0/3"}]


def test_names_are_phase_chunk_microbatch_layer():
    assert range_name("fwd", 0, 3, 5) == "fwd/0/3/5"
    assert range_name("step") == "step"
    assert range_name("bwd", None, 2) == "bwd/-/2"
    assert range_name("recompute", 1, None, "block0") == "recompute/1/-/block0"


def test_off_returns_the_shared_no_op_without_formatting_the_name():
    class Unprintable:
        def __str__(self):
            raise AssertionError("the name must not be formatted while ranges are off")

    enable(False)
    assert nvtx_range("fwd", Unprintable()) is NO_RANGE
    with nvtx_range("fwd", Unprintable()) as entered:
        assert entered is None


def test_nvtx_push_pop_balanced_even_when_the_body_raises(domain):
    enable(True, record_function=False)
    with nvtx_range("fwd", 0, 0, 1):
        with nvtx_range("recompute", 0, 0, 1):
            pass
    with pytest.raises(RuntimeError):
        with nvtx_range("fwd", 0, 0, 1):
            raise RuntimeError("boom")
    assert domain.log == ["push fwd/0/0/1", "push recompute/0/0/1", "pop", "pop",
                          "push fwd/0/0/1", "pop"]
    assert domain.attribute_calls == 2  # attributes (registered string + colour) are cached per name


def test_switching_off_inside_an_open_range_still_pops_it(domain):
    enable(True, record_function=False)
    outer = nvtx_range("step")
    outer.__enter__()
    enable(False)
    with nvtx_range("fwd"):  # off: not pushed
        pass
    outer.__exit__(None, None, None)
    assert domain.log == ["push step", "pop"]


def test_record_function_names_reach_torch_profiler_only_while_on():
    enable(True)
    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with nvtx_range("fwd", 0, 1, 2):
            x @ x
    assert _annotation_names(prof) == ["fwd/0/1/2"]

    enable(True, record_function=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with nvtx_range("fwd", 0, 1, 2):
            x @ x
    assert _annotation_names(prof) == []


def test_profiler_recording_tells_code_not_to_nest_a_profiler():
    assert not profiler_recording()
    with profile(activities=[ProfilerActivity.CPU]):
        assert profiler_recording()
    assert not profiler_recording()


def test_no_record_function_outside_a_profiler(monkeypatch):
    enable(True)
    monkeypatch.setattr(torch.autograd.profiler, "record_function",
                        lambda name: pytest.fail("record_function used with no profiler recording"))
    with nvtx_range("recompute", 1, 0, 3):
        pass


def test_train_loop_names_step_forward_backward_optimizer():
    enable(True)
    cfg = RunConfig.from_dict({"model": {"num_layers": 1, "hidden_size": 16, "num_heads": 2,
                                         "seq_length": 8, "vocab_size": 16},
                               "train": {"micro_batch_size": 2, "num_microbatches": 2}})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_config(cfg, steps=2, device="cpu", progress=False)
    names = _annotation_names(prof)
    assert {n: names.count(n) for n in set(names)} == {"step": 2, "forward": 4, "backward": 4,
                                                        "optimizer": 2}


def test_a_region_is_named_once_for_the_profilers_and_the_cost_model():
    """``region`` is the one way to name work: the name torch's profiler records is the label the
    cost model reads (its phase, what a runtime copy is for, whether it is mHC work), and no
    other module opens profiler ranges or keeps labels of its own."""
    from pathlib import Path

    from mhc_cg.core.regions import current_copy, current_phase, in_mhc, region

    enable(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with region("fwd", 0, None, "3.attn"):
            assert current_phase() == "forward"
            with region("copy", "static inputs"):
                assert current_copy() == "static inputs" and current_phase() == "forward"
                torch.ones(2) + 1
            with region("eager", 0, None, "3.moe_tail"), region("mhc"):
                assert in_mhc() and current_phase() == "forward"
    assert {"fwd/0/-/3.attn", "copy/static inputs", "eager/0/-/3.moe_tail", "mhc"} <= \
        {e.name for e in prof.events()}
    assert (current_phase(), current_copy(), in_mhc()) == (None, None, False)
    root = Path(__file__).resolve().parents[1] / "mhc_cg"
    openers = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                     if "nvtx_range(" in p.read_text() or "record_function(" in p.read_text())
    assert openers == ["core/nvtx.py", "core/regions.py"]
