"""``CheckpointWithoutOutput``: run a function without keeping its output, recompute it on demand.

The eager path of the design (docs/design.md). ``checkpoint(fn, *args)`` runs ``fn`` under
``no_grad`` inside an autograd Function, so the caller gets ordinary outputs that later ops may
consume and save for backward. ``discard_output_and_register_recompute(hook_tensor)`` then frees
the outputs' storage (``untyped_storage().resize_(0)``): every consumer that saved an output now
holds a zero-byte storage. A hook on ``hook_tensor``'s gradient recomputes ``fn`` with grad on the
saved inputs and copies the values back into the *same* storages, before any consumer's backward
reads them. The Function's own backward then differentiates the recomputed local graph.

Invariants the caller relies on:

* The backward of every consumer of an output must run after ``hook_tensor``'s gradient is
  computed; in practice ``hook_tensor`` is downstream of every consumer.
* Restoring writes through a detached writer alias of the storage (a tensor built with ``set_``),
  so the version counter that consumers recorded when they saved the output does not move.
* The RNG state of every device the inputs live on (CPU always, and each CUDA device of a CUDA
  input) is captured before ``fn`` runs and restored around the recompute, so a stateful dropout
  draws the same mask twice. The global generators are left as they were after the recompute.
* An output that shares storage with an input cannot be discarded (freeing it would free the
  input too): ``checkpoint`` rejects it, unless it is declared a *pass-through* (``passthrough``:
  the input handed on, e.g. the fused mHC pre's ``x_on``), which is never discarded or restored.

Inputs are *persistent* (saved with ``ctx.save_for_backward``, the default) or *refillable*
(listed in ``refill``): not saved at all, filled at recompute time from an upstream checkpoint's
recomputed output by the :class:`~mhc_cg.recompute.block_recompute.BlockRecomputeManager`, which resolves the
dependency ``"name.output_key"`` declared for that input.
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mhc_cg.recompute.gradient_order import capture_use_gradients, grad_node_key
from mhc_cg.core.storage import own_version_alias, storage_id
from mhc_cg.core.regions import region


# Life cycle of one checkpoint; each step may only follow the one before it.
FORWARD, DISCARDED, RECOMPUTED, CONSUMED, ABANDONED = (
    "forward", "discarded", "recomputed", "consumed", "abandoned")

@dataclass(frozen=True)
class TensorSpec:
    """What a recomputed tensor must match: the layout consumers saw at forward time."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @classmethod
    def of(cls, t: Tensor) -> "TensorSpec":
        return cls(t.shape, t.dtype, t.device, t.requires_grad)

    def mismatch(self, t: Tensor) -> str | None:
        for field in ("shape", "dtype", "device"):
            if getattr(t, field) != getattr(self, field):
                return f"{field} {getattr(t, field)} != forward's {getattr(self, field)}"
        return None


@dataclass
class RNGState:
    """CPU generator state plus one state per CUDA device the inputs live on."""

    cpu: Tensor
    cuda: dict[int, Tensor]

    @classmethod
    def capture(cls, tensors: Sequence[Tensor]) -> "RNGState":
        cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        return cls(torch.get_rng_state(),
                   {d: torch.cuda.get_rng_state(d) for d in cuda_devices})

    def same_as(self, other: "RNGState | None") -> bool:
        return (other is not None and self.cuda.keys() == other.cuda.keys()
                and torch.equal(self.cpu, other.cpu)
                and all(torch.equal(self.cuda[d], other.cuda[d]) for d in self.cuda))

    def nbytes(self) -> int:
        return self.cpu.nbytes + sum(s.nbytes for s in self.cuda.values())

    def forked(self):
        """A context in which the generators start from this state and are put back after."""
        fork = torch.random.fork_rng(devices=list(self.cuda), enabled=True)

        class _Restore:
            def __enter__(_):
                fork.__enter__()
                torch.set_rng_state(self.cpu)
                for d, state in self.cuda.items():
                    torch.cuda.set_rng_state(state, d)

            def __exit__(_, *exc):
                return fork.__exit__(*exc)

        return _Restore()


class CheckpointOwner(Protocol):
    """What a checkpoint reads of the manager it belongs to (the block's
    :class:`~mhc_cg.recompute.block_recompute.BlockRecomputeManager`), and tells it."""

    debug: bool
    draws_random: bool  # the block's ops draw from torch's generators
    last_rng_state: "RNGState | None"  # shared by consecutive checkpoints with no draw between

    def add_checkpoint(self, ckpt: "CheckpointWithoutOutput") -> None: ...


class _CheckpointFunction(torch.autograd.Function):
    """Forward: ``fn`` without a graph. Backward: differentiate the graph the recompute built."""

    @staticmethod
    def forward(ctx, ckpt: "CheckpointWithoutOutput", *args: Any):
        outputs = ckpt.fn(*args)  # grad mode is off inside Function.forward
        ctx.ckpt = ckpt
        ctx.save_for_backward(*(args[i] for i in ckpt._persistent_indices))
        ctx.set_materialize_grads(False)
        ckpt._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        if ctx.ckpt is None:
            raise RuntimeError("checkpoint: backward reached a checkpoint that was abandoned or "
                               "already consumed (its forward was unwound by an exception, or "
                               "this is a second backward); run the forward again")
        return (None, *ctx.ckpt._backward(grads))


class CheckpointWithoutOutput:
    """Checkpoint ``fn``; free its outputs after use; recompute them when backward needs them.

    With a ``manager``, :meth:`checkpoint` registers this object with it, and the manager frees
    and recomputes all its checkpoints together
    (:meth:`BlockRecomputeManager.discard_all_outputs_and_register_unified_recompute`); this
    object's own :meth:`discard_output_and_register_recompute` is then a no-op.
    ``debug=True`` keeps a clone of the outputs and checks that the recompute reproduces their
    values bit for bit (it costs the memory the checkpoint was meant to save).
    """

    def __init__(self, manager: "CheckpointOwner | None" = None, *, name: str | None = None,
                 debug: bool = False):
        self.manager = manager
        # unnamed: its address, unique among the checkpoints alive with it (a block's)
        self.name = name if name is not None else f"checkpoint@{id(self):#x}"
        self.debug = debug or bool(manager is not None and manager.debug)
        self.state = FORWARD
        self.fn: Callable[..., Any] | None = None
        self.refill: dict[int, str] = {}
        self.output_keys: tuple[str, ...] = ()
        self.passthrough: frozenset[int] = frozenset()  # outputs that alias an input
        self.outputs: tuple[Tensor, ...] = ()
        self.output_specs: tuple[TensorSpec, ...] = ()
        self.rng_state: RNGState | None = None
        self._args: list[Any] = []  # non-tensor args; tensors are saved or refilled
        self._input_specs: dict[int, TensorSpec] = {}
        self._persistent_indices: tuple[int, ...] = ()
        self._returns_tuple = False
        self._ctx = None
        self._storage_nbytes: dict[int, int] = {}  # storage id -> bytes before discard
        self._leaves: list[Any] = []
        self._recomputed: tuple[Tensor, ...] = ()
        self._debug_values: tuple[Tensor, ...] = ()
        # input index -> (autograd node, output slot) that receives the input's gradient
        self.input_grad_nodes: dict[int, tuple[Any, int]] = {}
        # input index -> sink for each per-use gradient, set by a manager that orders the sum
        self.edge_sinks: dict[int, Callable[[Tensor], None]] = {}

    # ---------------------------------------------------------------- forward
    def checkpoint(self, fn: Callable[..., Any], *args: Any, refill: Mapping[int, str] | None = None,
                   output_keys: Sequence[str] | None = None,
                   passthrough: Sequence[int] = ()) -> Any:
        """Run ``fn(*args)`` without building a graph; return its output(s) as autograd outputs.

        ``refill``: ``{arg_index: "source_name" | "source_name.output_key"}`` for refillable
        inputs (needs a manager). ``output_keys`` names the outputs of a tuple-returning ``fn``
        so that later checkpoints can depend on one of them. ``passthrough``: indices of outputs
        that are views of an input (kept, never freed).
        """
        if self.state != FORWARD or self.fn is not None:
            raise RuntimeError(f"checkpoint {self.name!r}: checkpoint() may be called only once")
        refill = dict(refill or {})
        if refill and self.manager is None:
            raise ValueError(f"checkpoint {self.name!r}: refillable inputs {sorted(refill)} need a "
                             f"BlockRecomputeManager to fill them; pass manager=...")
        for index in refill:
            if not (0 <= index < len(args)) or not isinstance(args[index], Tensor):
                raise ValueError(f"checkpoint {self.name!r}: refill index {index} is not a tensor "
                                 f"argument (fn has {len(args)} arguments)")
        self.fn, self.refill = fn, refill
        self.output_keys = tuple(output_keys or ())
        self.passthrough = frozenset(passthrough)
        self._args = [None if isinstance(a, Tensor) else a for a in args]
        self._input_specs = {i: TensorSpec.of(a) for i, a in enumerate(args) if isinstance(a, Tensor)}
        self._persistent_indices = tuple(i for i in self._input_specs if i not in refill)
        tensors = [a for a in args if isinstance(a, Tensor)]
        self.input_grad_nodes = {i: key for i, a in enumerate(args)
                                 if isinstance(a, Tensor) and (key := grad_node_key(a)) is not None}
        # Note [no generator state without a random op]: a block whose ops draw nothing from
        # torch's generators (counter dropout, or none) neither saves nor restores their state,
        # which a CUDA graph capture (a full-iteration one swallowing this recompute) refuses
        if self.manager is None or self.manager.draws_random:
            self.rng_state = self._capture_rng(tensors)

        outputs = _CheckpointFunction.apply(self, *args)
        self._returns_tuple = isinstance(outputs, tuple)
        self.outputs = outputs if self._returns_tuple else (outputs,)
        self._check_outputs(tensors)
        if self.debug:
            self._debug_values = tuple(o.detach().clone() for o in self.outputs)
        if self.manager is not None:
            self.manager.add_checkpoint(self)
        return outputs

    def _capture_rng(self, tensors: Sequence[Tensor]) -> RNGState:
        state = RNGState.capture(tensors)
        # Consecutive checkpoints with no random op between them share one state object.
        previous = self.manager.last_rng_state if self.manager is not None else None
        if state.same_as(previous):
            return previous
        if self.manager is not None:
            self.manager.last_rng_state = state
        return state

    def _check_outputs(self, inputs: Sequence[Tensor]) -> None:
        if not all(isinstance(o, Tensor) for o in self.outputs):
            raise TypeError(f"checkpoint {self.name!r}: fn must return a tensor or a tuple of "
                            f"tensors, got {[type(o).__name__ for o in self.outputs]}")
        if self.output_keys and len(self.output_keys) != len(self.outputs):
            raise ValueError(f"checkpoint {self.name!r}: {len(self.output_keys)} output_keys "
                             f"{list(self.output_keys)} for {len(self.outputs)} outputs")
        input_storages = {storage_id(t): i for i, t in enumerate(inputs)}
        for k, out in enumerate(self.outputs):
            if storage_id(out) in input_storages and k not in self.passthrough:
                raise ValueError(f"checkpoint {self.name!r}: output {k} shares storage with tensor "
                                 f"input {input_storages[storage_id(out)]}; discarding it would "
                                 f"free the input (return a copy, or do not checkpoint this op)")
        self.output_specs = tuple(TensorSpec.of(o) for o in self.outputs)

    def output_index(self, key: str) -> int:
        if key not in self.output_keys:
            raise KeyError(key)
        return self.output_keys.index(key)

    # ---------------------------------------------------------------- discard
    def discard_outputs(self) -> None:
        """Free every output's storage; consumers keep their (now empty) tensors."""
        if self.state != FORWARD:
            raise RuntimeError(f"checkpoint {self.name!r}: cannot discard in state {self.state!r}")
        for k, out in enumerate(self.outputs):
            if k in self.passthrough:
                continue
            storage = out.untyped_storage()
            self._storage_nbytes.setdefault(storage_id(out), storage.nbytes())
            storage.resize_(0)
        self.state = DISCARDED

    def discard_output_and_register_recompute(self, hook_tensor: Tensor) -> None:
        """Free the outputs and recompute them when ``hook_tensor``'s gradient is computed.

        A no-op when this checkpoint belongs to a manager: the manager does both for the block.
        """
        if self.manager is not None:
            return
        if not hook_tensor.requires_grad:
            raise ValueError(f"checkpoint {self.name!r}: hook_tensor does not require grad, so no "
                             f"backward would ever recompute the discarded outputs")
        self.discard_outputs()
        hook_tensor.register_hook(self._recompute_hook)

    def _recompute_hook(self, grad: Tensor) -> None:
        if self.state != DISCARDED:
            raise RuntimeError(
                f"checkpoint {self.name!r}: its recompute was already consumed by an earlier "
                f"backward; a second backward through a discarded checkpoint is not supported "
                f"(run the forward again)")
        with region("recompute"):
            self.recompute()

    # -------------------------------------------------------------- recompute
    def recompute(self, refilled: Mapping[int, Tensor] | None = None) -> tuple[Tensor, ...]:
        """Re-run ``fn`` with grad on the saved (and ``refilled``) inputs; restore the outputs.

        Returns the recomputed outputs (graph-carrying), which downstream refills read.
        """
        if self.state not in (FORWARD, DISCARDED):
            raise RuntimeError(f"checkpoint {self.name!r}: cannot recompute in state {self.state!r}")
        refilled = dict(refilled or {})
        if set(refilled) != set(self.refill):
            raise RuntimeError(f"checkpoint {self.name!r}: refillable inputs {sorted(self.refill)} "
                               f"but got fills for {sorted(refilled)}")
        saved = dict(zip(self._persistent_indices, self._ctx.saved_tensors))
        args = list(self._args)
        leaves: list[Any] = list(self._args)
        for i, spec in self._input_specs.items():
            source = saved[i] if i in saved else refilled[i]
            if i in refilled and (problem := spec.mismatch(source)):
                raise RuntimeError(f"checkpoint {self.name!r}: refill for input {i} from "
                                   f"{self.refill[i]!r} has {problem}")
            leaf = source.detach().requires_grad_(spec.requires_grad)
            args[i] = leaves[i] = leaf
        rng = self.rng_state.forked() if self.rng_state is not None else contextlib.nullcontext()
        with rng, torch.enable_grad():
            outputs = self.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        for i, sink in self.edge_sinks.items():
            capture_use_gradients(outputs, leaves[i], sink)
        self._check_determinism(outputs)
        self._restore_storage(outputs)
        self._leaves, self._recomputed = leaves, outputs
        self.state = RECOMPUTED
        return outputs

    def _check_determinism(self, outputs: tuple[Tensor, ...]) -> None:
        if len(outputs) != len(self.output_specs):
            raise RuntimeError(f"checkpoint {self.name!r}: recompute returned {len(outputs)} outputs, "
                               f"forward returned {len(self.output_specs)}")
        for k, (out, spec) in enumerate(zip(outputs, self.output_specs)):
            if problem := spec.mismatch(out):
                raise RuntimeError(f"checkpoint {self.name!r}: recomputed output {k} has {problem}; "
                                   f"fn is not deterministic")
        for k, (out, expected) in enumerate(zip(outputs, self._debug_values)):
            if not torch.equal(out.detach(), expected):
                diff = (out.detach().double() - expected.double()).abs().max().item()
                raise RuntimeError(f"checkpoint {self.name!r}: recomputed output {k} differs from "
                                   f"the forward's (max abs diff {diff:.3e}); fn is not deterministic")

    def _restore_storage(self, recomputed: tuple[Tensor, ...]) -> None:
        for k, (out, new) in enumerate(zip(self.outputs, recomputed)):
            if k in self.passthrough:
                continue
            storage = out.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(self._storage_nbytes[storage_id(out)])
            # A writer alias: same storage, own version counter, so saved views stay valid.
            alias = own_version_alias(out)
            with torch.no_grad(), region("copy", "refills"):
                alias.copy_(new.detach())

    # --------------------------------------------------------------- backward
    def _backward(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        if self.state != RECOMPUTED:
            raise RuntimeError(
                f"checkpoint {self.name!r}: backward reached it in state {self.state!r} without a "
                f"recompute; either the block's hook tensor was bypassed, or this is a second "
                f"backward through a block whose recompute was already consumed")
        pairs = [(o, g) for o, g in zip(self._recomputed, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(leaf.grad if isinstance(leaf, Tensor) else None for leaf in self._leaves)
        self._release(CONSUMED)
        return input_grads

    def _release(self, state: str) -> None:
        """Drop every tensor reference this checkpoint holds (the graph may outlive it)."""
        if self._ctx is not None:
            self._ctx.ckpt = None
        self._ctx = None
        self.outputs, self._leaves, self._recomputed, self._debug_values = (), [], (), ()
        self.input_grad_nodes, self.edge_sinks = {}, {}
        self.state = state

    def restore_discarded_storage(self) -> None:
        """Give discarded outputs their bytes back (contents undefined), so that nothing is left
        pointing at a zero-byte storage when the forward is abandoned."""
        if self.state != DISCARDED:
            return
        for k, out in enumerate(self.outputs):
            storage = out.untyped_storage()
            if storage.nbytes() == 0 and k not in self.passthrough:
                storage.resize_(self._storage_nbytes[storage_id(out)])

    @property
    def debug_bytes(self) -> int:
        """Bytes of the debug clones kept to check recompute determinism (0 unless debugging)."""
        return sum(t.nbytes for t in self._debug_values)

    def abandon(self) -> None:
        """Forget this checkpoint (the forward it belonged to was unwound by an exception)."""
        self._release(ABANDONED)
