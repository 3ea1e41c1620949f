"""``BlockRecomputeManager``: free every checkpoint of a recompute block, recompute them as one.

One manager per recompute block, one unified recompute hook per block. Checkpoints built with
``CheckpointWithoutOutput(manager)`` register here in forward order. At the end of the block,
:meth:`discard_all_outputs_and_register_unified_recompute` frees all their outputs and hooks one
recompute on the block's end tensor (the last layer's final bias-dropout-add output, which is
*not* checkpointed). When backward reaches that tensor, the hook re-runs every checkpoint in
forward order, before any backward node of the block runs.

Refillable inputs: a checkpoint may declare ``refill={arg_index: "source" | "source.key"}``. The
input is not saved; at recompute time it is filled with ``source``'s recomputed output (or the
output named ``key``). The dependency graph is checked when the block is finalised: a source
that is unknown, or registered after its consumer, is an error naming both checkpoints.

Exception safety: run the block's forward inside :meth:`forward_scope`. If anything unwinds it
(an error, or Megatron's ``MoECudaGraphPartialCaptureSignal``), every registered checkpoint is
abandoned, no hook stays registered and no output storage stays freed; the manager is empty and
can be reused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from mhc_cg.core.regions import region
from mhc_cg.model.delayed_pre import DelayedStreams
from mhc_cg.model.layers import MLP
from mhc_cg.recompute.checkpoint import CheckpointWithoutOutput, RNGState
from mhc_cg.recompute.gradient_order import order_gradient_sums
from mhc_cg.recompute.seam import Relay, handing_post, taking_pre
from mhc_cg.core.storage import storage_id

IDLE, ARMED, RECOMPUTED = "idle", "armed", "recomputed"


class BlockRecomputeManager:
    """Owns the checkpoints of one recompute block for one forward.

    ``debug=True`` makes every checkpoint compare recomputed values bit for bit with the
    forward's. ``trace`` lists the checkpoint names in the order the last recompute ran them.
    """

    def __init__(self, *, debug: bool = False, name: str = "block", draws_random: bool = True):
        self.debug = debug
        self.draws_random = draws_random  # the block's ops read torch's generators (torch dropout)
        self.name = name  # the profiler range of the recompute: recompute/0/-/{name}
        self.checkpoints: list[CheckpointWithoutOutput] = []
        self.trace: list[str] = []
        self.state = IDLE
        self.last_rng_state: RNGState | None = None
        self._by_name: dict[str, int] = {}
        self._hook: RemovableHandle | None = None
        self._order_hooks: list[RemovableHandle] = []
        self._first_seq: int | None = None  # sequence number of the block's first autograd node

    def __len__(self) -> int:
        return len(self.checkpoints)

    @property
    def is_empty(self) -> bool:
        """True when the manager holds no checkpoint and no hook."""
        return not self.checkpoints and self._hook is None

    def add_checkpoint(self, ckpt: CheckpointWithoutOutput) -> None:
        if self.state != IDLE:
            raise RuntimeError(f"BlockRecomputeManager: cannot add checkpoint {ckpt.name!r} after "
                               f"the block was finalised (state {self.state!r})")
        if ckpt.name in self._by_name:
            raise ValueError(f"BlockRecomputeManager: two checkpoints named {ckpt.name!r}")
        self._by_name[ckpt.name] = len(self.checkpoints)
        self.checkpoints.append(ckpt)
        node = next((o.grad_fn for o in ckpt.outputs if o.grad_fn is not None), None)
        if self._first_seq is None and node is not None:
            self._first_seq = node._sequence_nr()

    # ------------------------------------------------------------ dependencies
    def _resolve(self, consumer: CheckpointWithoutOutput, ref: str) -> tuple[int, int]:
        """``ref`` -> (index of the source checkpoint, index of its output)."""
        name, key = ref, None
        if ref not in self._by_name and "." in ref:
            name, key = ref.rsplit(".", 1)
        if name not in self._by_name:
            raise ValueError(f"checkpoint {consumer.name!r} depends on {ref!r}, but no checkpoint "
                             f"named {name!r} is registered in this block")
        source_index = self._by_name[name]
        source = self.checkpoints[source_index]
        if source_index >= self._by_name[consumer.name]:
            raise ValueError(f"checkpoint {consumer.name!r} depends on {ref!r}, but {name!r} is "
                             f"produced after it in forward order; sources must come first")
        if key is None:
            if len(source.outputs) != 1:
                raise ValueError(f"checkpoint {consumer.name!r} depends on {ref!r}, but {name!r} "
                                 f"has {len(source.outputs)} outputs; name one of "
                                 f"{list(source.output_keys)}")
            return source_index, 0
        try:
            return source_index, source.output_index(key)
        except KeyError:
            raise ValueError(f"checkpoint {consumer.name!r} depends on {ref!r}, but {name!r} has "
                             f"no output {key!r}; its outputs are {list(source.output_keys)}") from None

    def validate(self) -> dict[str, dict[int, tuple[int, int]]]:
        """Check every declared dependency; return them resolved to indices."""
        return {c.name: {i: self._resolve(c, ref) for i, ref in c.refill.items()}
                for c in self.checkpoints}

    # ---------------------------------------------------------------- finalise
    def discard_all_outputs_and_register_unified_recompute(self, hook_tensor: Tensor) -> None:
        """Validate the dependencies, free every output, and hook the recompute on ``hook_tensor``."""
        if self.state != IDLE:
            raise RuntimeError(f"BlockRecomputeManager: block already finalised (state {self.state!r})")
        if not hook_tensor.requires_grad or hook_tensor.grad_fn is None:
            raise ValueError("BlockRecomputeManager: hook_tensor must be a non-leaf tensor that "
                             "requires grad (the block's last bias-dropout-add output); otherwise "
                             "no backward would recompute the discarded outputs")
        self._resolved = self.validate()
        hook_storage = storage_id(hook_tensor)
        for ckpt in self.checkpoints:
            if any(storage_id(o) == hook_storage for o in ckpt.outputs):
                raise ValueError(f"BlockRecomputeManager: hook_tensor shares storage with the output "
                                 f"of checkpoint {ckpt.name!r}; the block-end tensor must not be "
                                 f"checkpointed")
        self._order_hooks = order_gradient_sums(self.checkpoints, hook_tensor, self._first_seq or 0)
        for ckpt in self.checkpoints:
            ckpt.discard_outputs()
        self._hook = hook_tensor.register_hook(self._unified_recompute_hook)
        self.state = ARMED

    def _unified_recompute_hook(self, grad: Tensor) -> None:
        if self.state != ARMED:
            raise RuntimeError(
                "BlockRecomputeManager: a second backward reached a recompute block whose "
                "recompute was already consumed; block recompute supports one backward per "
                "forward (retain_graph=True cannot replay it) - run the forward again")
        self.recompute_all()

    def recompute_all(self) -> None:
        """Recompute every checkpoint in forward order, refilling inputs from their sources."""
        recomputed: list[tuple[Tensor, ...]] = []
        self.trace = []
        with region("recompute", 0, None, self.name):
            for ckpt in self.checkpoints:
                fills = {i: recomputed[src][out] for i, (src, out) in self._resolved[ckpt.name].items()}
                recomputed.append(ckpt.recompute(fills))
                self.trace.append(ckpt.name)
        self.state = RECOMPUTED
        self._hook = None  # fired; autograd drops it with the graph

    # --------------------------------------------------------------- unwinding
    @contextlib.contextmanager
    def forward_scope(self) -> Iterator["BlockRecomputeManager"]:
        """Run a block's forward; if an exception unwinds it, leave nothing behind."""
        try:
            yield self
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Remove the hook, put back freed storages (unused, but never left dangling), forget all."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for handle in self._order_hooks:
            handle.remove()
        self._order_hooks.clear()
        self._first_seq = None
        for ckpt in self.checkpoints:
            ckpt.restore_discarded_storage()
            ckpt.abandon()
        self.checkpoints.clear()
        self._by_name.clear()
        self.trace = []
        self.last_rng_state = None
        self.state = IDLE

    def held_bytes(self) -> int:
        """Bytes the manager holds itself (RNG states; debug clones), beyond saved tensors."""
        states = {id(c.rng_state): c.rng_state for c in self.checkpoints if c.rng_state is not None}
        debug = sum(c.debug_bytes for c in self.checkpoints)
        return sum(s.nbytes() for s in states.values()) + debug


def checkpoint_sublayer(steps, x: Tensor, seed: Tensor | None, manager: BlockRecomputeManager,
                        name: str, x_source: str | None, block_end: bool,
                        seam: Relay | None = None, nxt=None) -> tuple[Tensor, str | None, Relay]:
    """One mHC sublayer with every step but F a checkpoint of ``manager``.

    ``steps`` is a fused or a stepwise sublayer (:mod:`mhc_cg.model.sublayer`). ``x_source`` names
    the checkpoint that produced ``x`` (``None``: ``x`` is the block input, saved); ``seam``: what
    the post before handed this pre; ``nxt``: the sublayer after. Returns the output, the
    checkpoint that produced it (``None`` for the block end, which is the manager's hook tensor and
    so not checkpointed) and the seam this post fills for ``nxt``. The steps run in the plain
    sublayer's order, so RNG draws and autograd order match the plain path.
    """
    if steps.fused:
        return _fused_checkpoints(steps, x, seed, manager, name, x_source, block_end,
                                  seam or Relay(), nxt)
    if getattr(steps, "delayed_pre", False):
        return (*_delayed_pre_checkpoints(steps, x, seed, manager, name, x_source, block_end),
                Relay())
    return (*_stepwise_checkpoints(steps, x, seed, manager, name, x_source, block_end), Relay())


def _fused_checkpoints(steps, x, seed, manager, name, x_source, block_end, seam, nxt):
    """``pre`` and ``post`` checkpoints; ``pre`` hands ``x`` on as its pass-through ``x_on``, so
    the post's input is refilled from wherever ``x`` is (its own source, or the saved block input
    itself)."""
    x_refill = {} if x_source is None else {0: x_source}
    fn_input, state, x_on = CheckpointWithoutOutput(manager, name=f"{name}/pre").checkpoint(
        taking_pre(steps.pre, seam), x, refill=x_refill,
        output_keys=("fn_input", "state", "x_on"), passthrough=(2,))
    y = steps.fn(fn_input)  # F's output is a persistent input of the post: F is never re-run
    after = Relay()
    post = handing_post(steps, nxt, after)
    if block_end:
        # The block end is the manager's hook tensor, so it is not checkpointed: it saves x_on
        # (restored by the recompute before its backward), the state (likewise), y and the seed
        return post(x_on, state, y, seed), None, after
    out = CheckpointWithoutOutput(manager, name=f"{name}/post").checkpoint(
        post, x_on, state, y, seed,
        refill={0: f"{name}/pre.x_on", 1: f"{name}/pre.state"})
    return out, f"{name}/post", after


def _stepwise_checkpoints(steps, x, seed, manager, name, x_source, block_end):
    def step(suffix: str) -> CheckpointWithoutOutput:
        return CheckpointWithoutOutput(manager, name=f"{name}/{suffix}")

    x_refill = {} if x_source is None else {0: x_source}
    h_pre, h_post, h_res = step("mappings").checkpoint(
        steps.mappings, x, refill=x_refill, output_keys=("h_pre", "h_post", "h_res"))
    agg = step("aggregate").checkpoint(
        steps.aggregate, x, h_pre, refill={**x_refill, 1: f"{name}/mappings.h_pre"})
    normed = step("norm").checkpoint(steps.norm, agg, refill={0: f"{name}/aggregate"})
    y = steps.fn(normed)
    mixed = step("h_res").checkpoint(
        steps.h_res_step, h_res, x,
        refill={0: f"{name}/mappings.h_res", **({} if x_source is None else {1: x_source})})
    if block_end:
        return steps.post_bda(y, h_post, mixed, seed), None
    out = step("post_bda").checkpoint(steps.post_bda, y, h_post, mixed, seed,
                                      refill={1: f"{name}/mappings.h_post", 2: f"{name}/h_res"})
    return out, f"{name}/post_bda"


def _delayed_pre_checkpoints(steps, x: DelayedStreams, seed, manager, name, x_source,
                             block_end):
    """The stepwise checkpoints of a delayed-pre sublayer (:mod:`mhc_cg.model.delayed_pre`):
    ``x_source`` names the checkpoints that made the streams and the pre-mix (``None``: both are
    the block's inputs, saved), and the same pair is returned for the output."""
    def step(suffix: str) -> CheckpointWithoutOutput:
        return CheckpointWithoutOutput(manager, name=f"{name}/{suffix}")

    streams_source, pre_mix_source = x_source or (None, None)
    x_refill = {} if streams_source is None else {0: streams_source}
    h_pre, h_post, h_res = step("mappings").checkpoint(
        steps.mappings, x.streams, refill=x_refill, output_keys=("h_pre", "h_post", "h_res"))
    agg = step("aggregate").checkpoint(
        steps.aggregate, x.streams, x.pre_mix,
        refill={**x_refill, **({} if pre_mix_source is None else {1: pre_mix_source})})
    normed = step("norm").checkpoint(steps.norm, agg, refill={0: f"{name}/aggregate"})
    y = steps.fn(normed)
    mixed = step("h_res").checkpoint(
        steps.h_res_step, h_res, x.streams, refill={0: f"{name}/mappings.h_res", **(
            {} if streams_source is None else {1: streams_source})})
    if block_end:
        # the pre-mix crosses into the next block, which keeps it: a copy (n per token), since
        # the block's checkpoint outputs are freed
        return DelayedStreams(steps.post_bda(y, h_post, mixed, seed), h_pre.clone()), None
    out = step("post_bda").checkpoint(steps.post_bda, y, h_post, mixed, seed,
                                      refill={1: f"{name}/mappings.h_post", 2: f"{name}/h_res"})
    return DelayedStreams(out, h_pre), (f"{name}/post_bda", f"{name}/mappings.h_pre")


def run_recompute_blocks(layers, x: Tensor, seed: Tensor | None, block_size: int,
                         managers: list[BlockRecomputeManager], *,
                         attention_sublayer=None, ranges: bool = False,
                         draws_random: bool = True) -> Tensor:
    """Eager block recompute over ``layers`` (each with ``.attention`` / ``.mlp`` steps).

    One manager per block of ``block_size`` layers, appended to ``managers`` as it starts (so the
    caller still sees it, empty, if an exception unwinds its forward): each block keeps its input
    x_l0 and every F output; its hook tensor is the block's last bias-dropout-add output.
    ``attention_sublayer(i, steps, x, seed, manager, name, x_source, seam, nxt)``: what runs layer
    ``i``'s attention sublayer instead of :func:`checkpoint_sublayer` (its return as that one's:
    Megatron-LM dev's split, the attention's core a graph, :mod:`mhc_cg.lab.references.split_attention`); ``ranges`` names each
    sublayer's NVTX range as the graphed modes do (``fwd``, ``{i}.attn`` / ``{i}.mlp``).
    ``draws_random=False``: the layers draw nothing from torch's generators, so the recompute
    saves and restores no generator state (Note [no generator state without a random op]).
    """
    layers = list(layers)
    sublayers = [sub for layer in layers for sub in (layer.attention, layer.mlp)]
    after = dict(zip(map(id, sublayers), [*sublayers[1:], None]))
    seam = Relay()  # what the last post handed on
    for start in range(0, len(layers), block_size):
        block = layers[start:start + block_size]
        manager = BlockRecomputeManager(name=f"block{start // block_size}",
                                        draws_random=draws_random)
        managers.append(manager)
        with manager.forward_scope():
            x_source = None  # the block input is persistent, not refilled
            for i, layer in enumerate(block, start):
                with _sublayer_range(ranges, f"{i}.attn"):
                    if attention_sublayer is None:
                        x, x_source, seam = checkpoint_sublayer(
                            layer.attention, x, seed, manager, f"layer{i}/attention", x_source,
                            block_end=False, seam=seam, nxt=layer.mlp)
                    else:
                        x, x_source, seam = attention_sublayer(
                            i, layer.attention, x, seed, manager, f"layer{i}/attention",
                            x_source, seam, layer.mlp)
                with _sublayer_range(ranges, f"{i}.mlp"):
                    x, x_source, seam = checkpoint_sublayer(
                        layer.mlp, x, seed, manager, f"layer{i}/mlp", x_source,
                        block_end=layer is block[-1], seam=seam, nxt=after[id(layer.mlp)])
            manager.discard_all_outputs_and_register_unified_recompute(
                x.streams if isinstance(x, DelayedStreams) else x)
    return x


def _sublayer_range(named: bool, label: str):
    return region("fwd", 0, None, label) if named else contextlib.nullcontext()


def recompute_activation_eagerly(mlp: MLP, x: Tensor,
                                 made: list[CheckpointWithoutOutput] | None = None) -> Tensor:
    """``mlp(x)`` (fc1 -> gelu -> fc2) keeping fc1's output but not the gelu output: the MLP's
    ``eager_recompute`` (the model is built with it). ``made``: a list the checkpoint is
    appended to (a memory report reads what it holds).

    fc2's backward needs the gelu output before gelu's own backward runs, so a recompute bound to
    gelu's backward would come too late. The gelu runs in a ``CheckpointWithoutOutput`` (which keeps
    only fc1's output, as gelu itself would), its output is freed once fc2 has saved it, and a hook
    on fc2's output gradient recomputes it into the same storage before fc2's backward reads it.
    """
    ckpt = CheckpointWithoutOutput(name="mlp/gelu")
    act = ckpt.checkpoint(F.gelu, mlp.fc1(x))
    out = mlp.fc2(act)
    if out.requires_grad:  # otherwise no backward will ever need act
        ckpt.discard_output_and_register_recompute(out)
    if made is not None:
        made.append(ckpt)
    return out
