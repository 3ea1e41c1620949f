"""TE's utilities that megatron-core imports; only its local CUDA-graph path calls them."""


def make_weak_ref(x):
    raise NotImplementedError("transformer_engine.pytorch.utils.make_weak_ref: megatron-core calls it "
                              "for cuda_graph_impl='local', which the stand-in does not cover; use "
                              "cuda_graph_impl='transformer_engine'")
