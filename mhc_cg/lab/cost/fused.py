"""What a fused mHC op's Triton kernels do beyond one pass over each tensor, for the cost model.

Per op (``mhc_cg::*``): the launches it makes (the pre: its state's two stages, then its F-input
pass; a post that makes the next state: the post with the state's first stage, then its second;
the pre's backward: a pass per token, then one per feature chunk and group of tokens), the
arguments a second pass reads again (the pre reads x twice; its backward reads x and g_out in
both of its passes) and the bytes its kernels hand each other through memory (the buffers
:mod:`mhc_cg.ops.kernels.tiling` sizes); and which fused ops are no mHC work.
"""

from __future__ import annotations

import math

from mhc_cg.ops.kernels.tiling import (post_backward_scratch, pre_backward_scratch, state_rows,
                                       state_scratch)

LAUNCHES = {"mhc_cg::pre": 3, "mhc_cg::pre_into": 3, "mhc_cg::post_state": 2,
            "mhc_cg::post_state_into": 2, "mhc_cg::pre_backward": 2,
            "mhc_cg::pre_backward_into": 2}
READ_TWICE = {"mhc_cg::pre": ("x",), "mhc_cg::pre_into": ("x",),
              "mhc_cg::pre_backward": ("x", "g_out"),
              "mhc_cg::pre_backward_into": ("x", "g_out")}


def read_twice(name: str, args: dict) -> tuple[str, ...]:
    """The arguments op ``name``'s kernels read twice in this call: the pre's backward with its
    post's reductions (``y`` given) reads g_post in its first pass as well."""
    twice = READ_TWICE.get(name, ())
    if name.startswith("mhc_cg::pre_backward") and args.get("y") is not None:
        twice += ("g_post",)
    return twice


_SCRATCH = {"mhc_cg::post_backward": post_backward_scratch,
            "mhc_cg::pre_backward": pre_backward_scratch,
            "mhc_cg::pre_backward_into": pre_backward_scratch,
            **{name: state_scratch for name in ("mhc_cg::pre", "mhc_cg::pre_into",
                                                "mhc_cg::post_state", "mhc_cg::post_state_into")}}


def scratch_bytes(name: str, args: dict) -> int:
    """Bytes the Triton kernels of op ``name`` write and read back internally, beyond its
    arguments and results (its ``*_scratch`` buffers, fp32)."""
    shapes_of = _SCRATCH.get(name)
    if shapes_of is None:
        return 0
    t, width = args["x"].shape
    n = args["n"]
    m = args["weight"].shape[0] if "weight" in args else args["bias"].shape[0]
    if shapes_of is pre_backward_scratch:
        extra = {"post": args.get("y") is not None, "prev": args.get("prev_state") is not None}
    elif shapes_of is state_scratch:
        extra = {"rows": state_rows(args["x"].element_size(), args["weight"].element_size())}
    else:
        extra = {}
    return 2 * 4 * sum(math.prod(shape) for shape in shapes_of(t, width // n, n, m,
                                                               **extra).values())


# The fused ops that are no mHC work, which the cost model's mHC traffic leaves out: the model's
# final norm and its loss.
NOT_MHC = frozenset({"mhc_cg::rms_norm", "mhc_cg::rms_norm_backward", "mhc_cg::cross_entropy",
                     "mhc_cg::cross_entropy_backward", "mhc_cg::cross_entropy_backward_"})
