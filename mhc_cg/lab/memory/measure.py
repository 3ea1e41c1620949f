"""Measured activation memory: the bytes a forward leaves saved for backward, beside the model.

``measure_saved_bytes`` runs one training forward of the mHC GPT under
``torch.autograd.graph.saved_tensors_hooks`` and keeps a reference to every tensor autograd
saves. After the forward (and, with ``recompute="block"``, after each block freed its
checkpointed outputs) it sums the bytes of the distinct storages those tensors still hold.
That is what stays alive from forward to backward: a discarded output that a consumer saved
counts zero, a tensor saved by several ops counts once, a view counts its whole storage.

Storages are told apart by :func:`mhc_cg.core.storage.storage_id`, not by
``data_ptr``: on the ``meta`` device every data pointer is 0, and ``meta`` is what lets a
configuration far larger than this machine be measured (nothing is allocated; shapes and
``nbytes`` are exact). Parameters that ops save (weights of a matmul) are not activations and
are left out; so are tensors saved by the embedding and the head (reported separately).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import Tensor

from mhc_cg.core.dtypes import TORCH_DTYPES
from mhc_cg.lab.memory.analytical import (block_persistent_elements, mlp_activation_elements,
                           no_recompute_elements_per_layer, saved_elements_per_layer)
from mhc_cg.model import MHCGPT, MHCGPTConfig
from mhc_cg.core.storage import storage_bytes, storage_id
from mhc_cg.recompute.block_recompute import (recompute_activation_eagerly,
                                                      run_recompute_blocks)



def _unique_storage_bytes(tensors: list[Tensor], exclude: set[int]) -> tuple[int, set[int]]:
    found = storage_bytes(tensors, exclude)
    return sum(found.values()), set(found)


def _forward_saved(model_cfg: MHCGPTConfig, micro_batch_size: int, device: str,
                   dtype: torch.dtype) -> dict:
    gelu_checkpoints: list = []  # what each eager activation recompute keeps
    with torch.device(device):
        model = MHCGPT(model_cfg, functools.partial(recompute_activation_eagerly,
                                                    made=gelu_checkpoints))
    model.to(dtype).train()
    ids = torch.zeros(micro_batch_size, model_cfg.seq_length, dtype=torch.long, device=device)
    seed = torch.tensor(1234, dtype=torch.int64, device=device)
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = model.embed(ids)
        after_embed = len(saved)
        managers: list = []
        if model_cfg.recompute == "block":
            x = run_recompute_blocks(model.layers, x, seed, model_cfg.resolved_recompute_layers,
                                     managers)
        else:
            x = model.run_layers(x, seed)
        after_layers = len(saved)
        model.logits(x)
    params = {storage_id(p) for p in model.parameters()}
    embed_bytes, embed_keys = _unique_storage_bytes(saved[:after_embed], params)
    layer_bytes, layer_keys = _unique_storage_bytes(saved[after_embed:after_layers], params | embed_keys)
    head_bytes, _ = _unique_storage_bytes(saved[after_layers:], params | embed_keys | layer_keys)
    manager_bytes = sum(m.held_bytes() for m in managers)
    # each gelu checkpoint (activation recompute) holds an RNG state until its backward
    manager_bytes += sum(c.rng_state.nbytes() for c in gelu_checkpoints
                         if c.rng_state is not None)
    return {"layers_saved_bytes": layer_bytes, "manager_bytes": manager_bytes,
            "embedding_saved_bytes": embed_bytes, "head_saved_bytes": head_bytes,
            "num_blocks": len(managers)}


def recompute_blocks(model_cfg: MHCGPTConfig) -> list[int]:
    """Layers per recompute block, as the model splits them."""
    size, layers = model_cfg.resolved_recompute_layers, model_cfg.num_layers
    return [min(size, layers - start) for start in range(0, layers, size)]


def analytical_bytes_per_layer(model_cfg: MHCGPTConfig, micro_batch_size: int,
                               dtype: torch.dtype) -> dict:
    """The memory model (:mod:`mhc_cg.lab.memory.analytical`) in bytes per layer.

    ``none`` is what autograd saves of the mHC ops, op by op (``saved_elements_per_layer``);
    ``design_none`` is the design's list of intermediates (docs/design.md), which counts tensors autograd never
    keeps (the outputs of additions) and misses x, which it does. ``block``
    is the paper's persistent state: x_l0 per block and each F output.
    """
    n, c, layers = model_cfg.num_streams, model_cfg.hidden_size, model_cfg.num_layers
    item = torch.empty((), dtype=dtype).element_size()
    scale = model_cfg.seq_length * micro_batch_size * item
    block = sum(block_persistent_elements(n, c, size) for size in recompute_blocks(model_cfg))
    return {"none": saved_elements_per_layer(n, c, item) * scale,
            "design_none": no_recompute_elements_per_layer(n, c) * scale,
            "block": block * scale / layers,
            "activation": mlp_activation_elements(model_cfg.ffn_hidden_size) * scale}


def measure_saved_bytes(model_cfg: MHCGPTConfig, micro_batch_size: int, device: str = "meta",
                        dtype: torch.dtype | str = torch.float32) -> dict:
    """Bytes saved for backward per layer, for ``recompute="none"`` and ``"block"``.

    Returns ``{"none": {...}, "block": {...}, "model": {...}, "difference": {...}, ...}`` where
    each mode holds ``per_layer_bytes`` (saved activations of all layers plus what the block
    managers hold, divided by the number of layers) and the raw parts; ``model`` is the
    analytical mHC state per layer; ``difference`` compares ``none - block`` measured with the
    same difference in the model (attention and MLP internals are saved in both modes and cancel).
    ``activation`` repeats both modes with ``recompute_activation`` on every layer:
    ``saved_per_layer`` (none - this, block - this) is what dropping the gelu output saves per
    layer, to compare with ``model["activation"]`` (ffn per token) less an RNG state per layer.
    """
    if isinstance(dtype, str):
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype: must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
        dtype = TORCH_DTYPES[dtype]
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: must be a positive integer, got {micro_batch_size!r}")
    layers = model_cfg.num_layers
    result: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
                    "micro_batch_size": micro_batch_size,
                    "recompute_layers": model_cfg.resolved_recompute_layers,
                    "blocks": recompute_blocks(model_cfg)}
    for mode in ("none", "block"):
        raw = _forward_saved(replace(model_cfg, recompute=mode), micro_batch_size, device, dtype)
        raw["per_layer_bytes"] = (raw["layers_saved_bytes"] + raw["manager_bytes"]) / layers
        result[mode] = raw
    model = analytical_bytes_per_layer(model_cfg, micro_batch_size, dtype)
    result["model"] = model
    measured_diff = result["none"]["per_layer_bytes"] - result["block"]["per_layer_bytes"]
    model_diff = model["none"] - model["block"]
    design_diff = model["design_none"] - model["block"]
    result["difference"] = {"measured": measured_diff, "model": model_diff,
                            "relative_error": (measured_diff - model_diff) / model_diff,
                            "design_model": design_diff,
                            "design_relative_error": (measured_diff - design_diff) / design_diff}
    result["block_over_none"] = result["block"]["per_layer_bytes"] / result["none"]["per_layer_bytes"]
    if not model_cfg.is_moe:  # activation recompute is for the dense MLP's gelu
        act_cfg = replace(model_cfg, recompute_activation=True, recompute_activation_layers=None)
        activation: dict = {"saved_per_layer": {}}
        for mode in ("none", "block"):
            raw = _forward_saved(replace(act_cfg, recompute=mode), micro_batch_size, device, dtype)
            raw["per_layer_bytes"] = (raw["layers_saved_bytes"] + raw["manager_bytes"]) / layers
            activation[mode] = raw
            activation["saved_per_layer"][mode] = (result[mode]["per_layer_bytes"]
                                                   - raw["per_layer_bytes"])
        result["activation"] = activation
    return result
