"""A CPU run chooses torch's thread count from the config (one thread for a small model, a few for
a large one, ``OMP_NUM_THREADS`` when the user set it) and leaves a CUDA run's alone; the step
times of a CPU run say they are the host's."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.lab.compare.modes import CPU_STEP_NOTE, Compared, format_table
from mhc_cg.config import RunConfig
from mhc_cg.training import device
from mhc_cg.training.device import cpu_threads, use_cpu_threads


@pytest.mark.parametrize("hidden, omp, cores, threads", [
    (64, None, 16, 1),  # small matrices: one thread
    (1023, None, 16, 1),
    (1024, None, 16, 4),  # from 1024 a few threads pay, at most four
    (4096, None, 2, 2),  # never more than the cores
    (4096, None, 1, 1),
    (64, "3", 16, 3),  # the user's OMP_NUM_THREADS wins either way
    (4096, "1", 16, 1),
    (64, "0", 16, 1),  # not a usable count: the rule
    (4096, "many", 16, 4),
])
def test_cpu_threads_rule(hidden, omp, cores, threads):
    assert cpu_threads(hidden, omp, cores) == threads


@pytest.fixture
def set_threads(monkeypatch):
    """The counts ``torch.set_num_threads`` is called with (not applied)."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return calls


def test_a_cpu_run_sets_the_threads_a_cuda_run_does_not(set_threads, monkeypatch):
    cfg = RunConfig()
    assert use_cpu_threads(cfg, "cpu") and set_threads == [1]
    assert not use_cpu_threads(cfg, "cuda") and set_threads == [1]
    big = cfg.replace(model={"hidden_size": 2048, "num_heads": 16})
    monkeypatch.setattr(device, "_visible_gpus", lambda: 1)
    assert not use_cpu_threads(big, "auto") and set_threads == [1]  # auto: the GPU
    monkeypatch.setattr(device, "_visible_gpus", lambda: 0)
    monkeypatch.setattr(device, "_usable_cores", lambda: 8)
    assert use_cpu_threads(big, "auto") and set_threads == [1, 4]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice
    assert use_cpu_threads(big, "cpu") and use_cpu_threads(cfg, "cpu") and set_threads == [1, 4, 2, 2]


def test_a_pipeline_on_auto_is_a_cpu_run_without_a_gpu_per_rank(set_threads, monkeypatch):
    cfg = RunConfig().replace(parallel={"pp_size": 2})
    monkeypatch.setattr(device, "_visible_gpus", lambda: 1)
    assert use_cpu_threads(cfg, "auto") and set_threads == [1]


def test_the_compare_table_says_cpu_step_times_are_the_hosts():
    results = {"eager_none": Compared("eager_none", losses=[4.0, 3.0], grad_norms=[1.0, 1.0],
                                         step_times=[0.1, 0.1])}
    cpu = format_table(results, cpu=True).splitlines()
    assert cpu[0].rstrip().endswith("step ms (CPU host)") and cpu[-1] == CPU_STEP_NOTE
    assert "says nothing about a GPU" in CPU_STEP_NOTE
    gpu = format_table(results)
    assert "CPU" not in gpu and gpu.splitlines()[0].rstrip().endswith("step ms")
