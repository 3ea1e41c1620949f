"""``fast_hadamard_transform.hadamard_transform`` (a CUDA extension) in torch: Megatron's DSA
indexer rotates its activations with it (``dsa.py``'s ``rotate_activation``), and DeepSeek-V4's
compressed attention calls that unconditionally."""

import torch


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x @ H.T * scale`` over the last dimension, ``H`` Sylvester's Hadamard matrix of the
    next power of two (the input zero-padded to it, the output cut back), as the extension;
    computed in fp32, returned in ``x``'s dtype."""
    dim = x.shape[-1]
    width = 1 << max(dim - 1, 0).bit_length()
    y = torch.nn.functional.pad(x.float(), (0, width - dim)) if width != dim else x.float()
    shape = y.shape
    h = 1
    while h < width:  # one butterfly stage per bit: pairs (a, b) -> (a + b, a - b)
        y = y.reshape(*shape[:-1], width // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return (y.reshape(shape)[..., :dim] * scale).to(x.dtype)
