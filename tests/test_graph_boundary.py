"""Nothing silently wrong at a graphed callable's boundary: what eager autograd would refuse is
refused, what it would compute is computed, and a bad dropout seed is one clear line in every
graphed mode."""

from __future__ import annotations

import pytest
import torch

from mhc_cg.model import lm_loss
from mhc_cg.graphs import GraphOptions, make_graphed_callables
from mhc_cg.lab.emulation.backends import get_backend
from mhc_cg.lab.registry import MODES

from helpers import build_for_mode, small_config

BACKENDS = ["tape", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


class Scaled(torch.nn.Module):
    """``act(x @ w)``: sigmoid saves its output for backward, the plain product does not."""

    def __init__(self, device: str, saves_output: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, device=device))
        self.saves_output = saves_output

    def forward(self, x):
        y = x @ self.w
        return torch.sigmoid(y) if self.saves_output else y


def graphed(backend_name: str, saves_output: bool):
    backend = get_backend(backend_name)
    torch.manual_seed(0)
    module = Scaled(backend.device, saves_output)
    sample = torch.randn(4, 4, device=backend.device, requires_grad=True)
    return module, make_graphed_callables(module, (sample,), options=GraphOptions(backend=backend))


def eager_grads(module, x, edit):
    w = module.w.detach().clone().requires_grad_()
    y = x.detach() @ w
    out = torch.sigmoid(y) if module.saves_output else y
    edit(out)
    out.sum().backward()
    return w.grad


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_editing_a_saved_output_in_place_raises_as_autograd_does(backend_name):
    module, fn = graphed(backend_name, saves_output=True)
    x = torch.randn(4, 4, device=module.w.device, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        eager_grads(module, x, lambda out: out.mul_(2))  # what eager autograd says
    out = fn(x)
    out.mul_(2)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: output 0 of graphed "
                                           r"callable .*clone the output"):
        out.sum().backward()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_editing_an_output_nothing_saved_gives_eagers_gradients(backend_name):
    module, fn = graphed(backend_name, saves_output=False)
    x = torch.randn(4, 4, device=module.w.device, requires_grad=True)
    want = eager_grads(module, x, lambda out: out.mul_(2))
    module.zero_grad(set_to_none=True)
    out = fn(x)
    out.mul_(2)
    out.sum().backward()
    assert torch.equal(module.w.grad, want)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("alias", ["transpose", "broadcast row"])
def test_an_input_aliasing_the_static_buffer_in_another_layout_gives_the_eager_answer(
        backend_name, alias):
    module, fn = graphed(backend_name, saves_output=True)
    static = fn.forward.state.static_inputs[0]
    with torch.no_grad():
        static.copy_(torch.randn(4, 4, device=static.device))
        # the same storage and first element, another geometry: a transpose, or row 0 repeated
        given = static.t() if alias == "transpose" else static[0].expand(4, 4)
        # a copy in the buffer's row-major layout, which the graph multiplies: given.clone() keeps
        # the transpose's strides, and cuBLAS may round a transposed operand's product otherwise
        want = torch.sigmoid(given.clone(memory_format=torch.contiguous_format) @ module.w)
    assert torch.equal(fn(given), want)


def training_pass(mode_model, ids, seed):
    """A training forward and backward as the mode runs one: a captured iteration replays every
    microbatch (each given ``ids`` and ``seed``), the other modes run a forward here and the
    caller's backward."""
    if not mode_model.captures_iteration:
        return mode_model(ids, seed)
    return mode_model.run_iteration([(ids, ids, seed)] * mode_model.plan.iteration_microbatches)


@pytest.mark.parametrize("mode", [m.name for m in MODES.values() if m.graphed and m.same_model])
def test_every_graphed_mode_refuses_a_bad_dropout_seed_in_one_line(mode):
    graphed_model = build_for_mode(small_config(["attn", "mhc_recompute"]), mode, "cpu")
    ids = torch.zeros(graphed_model.micro_batch_size, graphed_model.model.cfg.seq_length,
                      dtype=torch.int64)
    for seed, got in ((torch.tensor(3, dtype=torch.int32), "[] torch.int32"),
                      (torch.tensor(3.0), "[] torch.float32"), (3, "int 3"),
                      (torch.tensor([3]), "[1] torch.int64")):
        with pytest.raises(ValueError) as info:
            training_pass(graphed_model, ids, seed)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"dropout_seed is {got}")
        assert "captured with [] torch.int64 on cpu; pass a tensor of that shape" in message
        graphed_model.release_pending()


@pytest.mark.parametrize("mode", [m.name for m in MODES.values() if m.graphed and m.same_model])
def test_no_dropout_seed_draws_one_as_the_plain_model_does(mode):
    cfg = small_config(["attn", "mhc_recompute"])
    mode_models = {name: build_for_mode(cfg, name, "cpu") for name in ("eager_none", mode)}
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size,
                                                  cfg.model.seq_length))
    n = cfg.train.num_microbatches
    grads = {}
    for name, mode_model in mode_models.items():
        torch.manual_seed(11)  # the seeds the forwards draw
        if mode_model.captures_iteration:  # the loss it captured, over n microbatches
            training_pass(mode_model, ids, None)
        else:
            for _ in range(n):
                (lm_loss(mode_model(ids, None), ids, grad_over_logits=True) / n).backward()
        grads[name] = [p.grad for p in mode_model.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["eager_none"], grads[mode]))
