"""The tape replays collectives, as a CUDA graph holds NCCL kernels: two gloo ranks capture an
all-gather, a reduce-scatter (async, waited later, as megatron's sequence-parallel backward does)
and an all-reduce on tape graphs, then replay them on new inputs and must equal the eager
collectives. Without this, a tensor-parallel layer graphed on the tape would replay its matmuls
on the capture's stale buffers: the CPU tests would pass where a GPU run differs, or the reverse.
"""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.pipeline.driver import free_port


def _collectives(x, gathered, scattered, summed):
    dist.all_gather_into_tensor(gathered, x)
    handle = dist.reduce_scatter_tensor(scattered, gathered * 2, async_op=True)
    summed.copy_(x + 1)
    handle.wait()
    dist.all_reduce(summed)


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    x = torch.zeros(3)
    gathered, scattered, summed = torch.empty(6), torch.empty(3), torch.empty(3)
    graph = get_backend("tape").new_graph()
    with graph.capture():
        _collectives(x, gathered, scattered, summed)
    kinds = {op.func.name(): op.kind for op in graph.ops if op.func.namespace == "c10d"}
    replayed = []
    for step in range(2):
        x.copy_(torch.arange(3.0) + 10 * rank + step)
        graph.replay()
        replayed.append([t.clone() for t in (gathered, scattered, summed)])
    eager = []
    for step in range(2):
        x.copy_(torch.arange(3.0) + 10 * rank + step)
        _collectives(x, gathered, scattered, summed)
        eager.append([t.clone() for t in (gathered, scattered, summed)])
    results[rank] = {"kinds": kinds, "equal": all(torch.equal(a, b) for r, e in zip(replayed, eager)
                                                  for a, b in zip(r, e)),
                     "moved": not torch.equal(replayed[0][2], replayed[1][2])}
    dist.destroy_process_group()


def test_tape_replays_collectives_like_the_eager_ones():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        assert set(results[rank]["kinds"]) == {"c10d::_allgather_base_",
                                               "c10d::_reduce_scatter_base_", "c10d::allreduce_"}
        assert all(kind == "run" for kind in results[rank]["kinds"].values())
        assert results[rank]["equal"] and results[rank]["moved"]
