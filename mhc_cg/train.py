"""The training loop behind ``mhc-cg train``."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .config import RunConfig
from .data import ProgressionCorpus
from .errors import ConfigError
from .model import MHCGPT
from .nvtx_ranges import nvtx_range, profiler_recording


@dataclass
class TrainResult:
    mode: str = "eager_none"
    info: dict = field(default_factory=dict)  # the graphed runtime's sizes (arena, sets, graphs)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    held_bytes_per_microbatch: int | None = None  # allocated by a forward and held until backward

    @property
    def median_step_ms(self) -> float:
        times = sorted(self.step_times[1:] or self.step_times)  # the first step pays warm-up
        return 1000.0 * times[len(times) // 2]


def held_bytes(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int | None]:
    """Run ``fn``; return its result and the bytes it allocated that are still live afterwards.

    On CUDA this is the allocator's counter; on CPU, the profiler's allocation events (CPU torch
    keeps no counter), or ``None`` while an outer torch profiler records. Static buffers allocated
    before ``fn`` (arena, slot sets, graph pools) are not counted: this is what each further
    microbatch in flight would add.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.memory_allocated(device) - before
    if profiler_recording():  # an inner profiler would end the outer one's session: no CPU probe
        return fn(), None
    from torch.autograd.profiler import profile

    with profile(profile_memory=True) as prof:
        out = fn()
    return out, int(sum(e.self_cpu_memory_usage for e in prof.function_events))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' was asked for but this torch build sees no CUDA GPU; "
                          "use 'cpu' or 'auto'")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"train.device: must be one of ['cpu', 'cuda', 'auto'], got {name!r}")
    return torch.device(name)


class ProgressBar:
    """A one-line progress bar on stderr (silent when ``enabled`` is false)."""

    def __init__(self, total: int, label: str, enabled: bool = True, width: int = 30):
        self.total, self.label, self.enabled, self.width = total, label, enabled, width

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * done // max(self.total, 1)
        line = f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {done}/{self.total} {note}"
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{line}" + ("\n" if done >= self.total else ""))
        elif done == 1 or done >= self.total or done % max(self.total // 10, 1) == 0:
            sys.stderr.write(line + "\n")  # logs get a line every 10%, not a carriage-return smear
        sys.stderr.flush()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

MODES = ("eager_none", "eager_block", "graphed_none", "graphed_static")


def graph_scopes(cfg: RunConfig) -> list[str]:
    """The configured scopes, under either spelling (``cuda_graph_modules`` is the newer one)."""
    return list(cfg.graph.cuda_graph_scope or cfg.graph.cuda_graph_modules or [])


def resolve_mode(cfg: RunConfig) -> str:
    """What a config asks for: graphed static-buffer recompute when ``mhc_recompute`` is in scope."""
    if "mhc_recompute" in graph_scopes(cfg):
        return "graphed_static"
    return "eager_block" if cfg.model.recompute == "block" else "eager_none"


def build_for_mode(cfg: RunConfig, mode: str, device: torch.device, *,
                   default_scopes: tuple[str, ...] = ("attn", "mhc_recompute")):
    """``(model, forward, graphed)`` for ``mode``; ``forward(input_ids, seed) -> logits``.

    The weights depend only on ``cfg.train.seed``, never on the mode, so modes can be compared.
    """
    if mode not in MODES:
        raise ConfigError(f"--mode: must be one of {list(MODES)}, got {mode!r}")
    # The "none" modes are the references: no recompute of any kind. Activation recompute frees
    # a storage, which no graph can hold, so graphed_none could not capture it anyway.
    no_recompute = mode in ("eager_none", "graphed_none")
    model_cfg = dataclasses.replace(
        cfg.model, recompute="block" if mode == "eager_block" else "none",
        recompute_activation=cfg.model.recompute_activation and not no_recompute,
        recompute_activation_layers=None if no_recompute else cfg.model.recompute_activation_layers)
    torch.manual_seed(cfg.train.seed)
    # weights are made in fp32 (same init for every dtype), then cast
    model = MHCGPT(model_cfg).to(device=device, dtype=DTYPES[cfg.train.dtype]).train()
    if mode == "graphed_none":  # sublayers as graphs, no recompute (mhc_cg.graphed_sublayers)
        from .graphed_sublayers import GraphedSublayersModel

        graphed = GraphedSublayersModel(model, micro_batch_size=cfg.train.micro_batch_size,
                                        backend=cfg.graph.backend).prepare(device)
        return model, graphed, graphed
    if mode != "graphed_static":
        return model, model, None
    from .graphed_model import GraphedStaticModel

    scopes = graph_scopes(cfg) or list(default_scopes)
    if "mhc_recompute" not in scopes:
        scopes.append("mhc_recompute")
    graphed = GraphedStaticModel(model, scopes, micro_batch_size=cfg.train.micro_batch_size,
                                 backend=cfg.graph.backend)
    graphed.prepare(device)
    return model, graphed, graphed


@dataclass
class TrainSession:
    """What one mode trains with: model, forward, optimizer, data and dropout seeds.

    Dropout seeds come from their own generator, one per microbatch, so every mode sees the
    same masks; the weights depend only on ``cfg.train.seed``.
    """

    cfg: RunConfig
    mode: str
    device: torch.device
    model: MHCGPT
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    graphed: object | None
    optimizer: torch.optim.Optimizer
    corpus: ProgressionCorpus
    seeds: torch.Generator

    @classmethod
    def build(cls, cfg: RunConfig, mode: str, device: torch.device,
              default_scopes: tuple[str, ...] = ("attn", "mhc_recompute")) -> "TrainSession":
        model, forward, graphed = build_for_mode(cfg, mode, device, default_scopes=default_scopes)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay)
        corpus = ProgressionCorpus(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed)
        return cls(cfg, mode, device, model, forward, graphed, optimizer, corpus,
                   torch.Generator().manual_seed(cfg.train.seed + 1))

    def step(self, *, probe_memory: bool = False,
             after_backward: Callable[[MHCGPT], None] | None = None) -> tuple[float, float, int | None]:
        """One optimizer step over ``num_microbatches``; returns (loss, grad norm, held bytes).

        ``probe_memory`` measures what the first microbatch's forward holds until its backward
        (:func:`held_bytes`); otherwise the third value is ``None``.
        """
        train, dev = self.cfg.train, self.device
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, held = 0.0, None
        for index in range(train.num_microbatches):
            inputs, targets = (t.to(dev) for t in self.corpus.batch(train.micro_batch_size))
            seed = torch.randint(0, 2 ** 31 - 1, (), generator=self.seeds).to(dev)

            def forward_loss() -> torch.Tensor:
                logits = self.forward(inputs, seed)
                return F.cross_entropy(logits.flatten(0, 1).float(),
                                       targets.flatten()) / train.num_microbatches

            with nvtx_range("forward"):
                if probe_memory and index == 0:
                    loss, held = held_bytes(forward_loss, dev)
                else:
                    loss = forward_loss()
            with nvtx_range("backward"):
                loss.backward()
            loss_sum += loss.item()
        if after_backward is not None:
            after_backward(self.model)
        with nvtx_range("optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
            self.optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return loss_sum, float(grad_norm), held


def train(cfg: RunConfig, *, steps: int | None = None, device: str | None = None,
          progress: bool = True, mode: str | None = None,
          after_backward: Callable[[int, MHCGPT], None] | None = None) -> TrainResult:
    """Train ``cfg.model`` on the synthetic corpus in ``mode`` (default: what the config asks).

    ``after_backward(step, model)`` runs once per step before the optimizer (tests read the
    gradients there).
    """
    dev = resolve_device(device or cfg.train.device)
    steps = cfg.train.steps if steps is None else steps
    if steps < 1:
        raise ConfigError(f"--steps: must be a positive integer, got {steps}")
    mode = mode or resolve_mode(cfg)
    session = TrainSession.build(cfg, mode, dev)
    graphed = session.graphed
    result = TrainResult(mode=mode, info=graphed.describe() if graphed is not None else {})
    bar = ProgressBar(steps, f"train[{mode}]", progress)
    for step in range(steps):
        start = time.perf_counter()
        hook = None if after_backward is None else (lambda model, s=step: after_backward(s, model))
        with nvtx_range("step"):  # profiler ranges; one name per phase so runs aggregate by name
            # the first step is excluded from the median time: probe memory there
            loss, grad_norm, held = session.step(probe_memory=step == 0, after_backward=hook)
        if step == 0:
            result.held_bytes_per_microbatch = held
        result.step_times.append(time.perf_counter() - start)
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        bar.update(step + 1, f"loss {loss:.4f}")
    return result
