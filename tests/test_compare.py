"""``train --compare``'s verdict covers gradients and evaluation losses, not only the losses."""

from __future__ import annotations

import json

import pytest

from mhc_cg.lab.compare import modes as compare
from mhc_cg.cli import main


def result(mode, digests, eval_losses=()):
    return compare.Compared(mode, losses=[4.0, 3.5], grad_norms=[1.0, 0.9], step_times=[0.1, 0.1],
                       grad_digests=list(digests), eval_losses=list(eval_losses))


@pytest.mark.parametrize("other, problem", [
    (result("graphed_static", ["a", "X"], [3.1]),
     "graphed_static: gradients differ from eager_none's"),
    (result("graphed_static", ["a", "b"], [3.0]),
     "graphed_static: eval losses differ from eager_none's"),
])
def test_equal_losses_with_other_gradients_or_eval_losses_fail(monkeypatch, capsys, other, problem):
    results = {"eager_none": result("eager_none", ["a", "b"], [3.1]), "graphed_static": other}
    assert compare.mismatches(results) == [problem]
    monkeypatch.setattr(compare, "run_modes", lambda *a, **k: results)
    assert main(["train", "--compare", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert f"mhc-cg train: mismatch: {problem}" in captured.err
    if "gradients" in problem:  # the table says so too
        assert "losses equal, grads differ" in captured.out
    assert main(["train", "--compare", "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["agree"] is False and report["mismatches"] == [problem]


def test_identical_results_pass(monkeypatch, capsys):
    results = {m: result(m, ["a", "b"], [3.1]) for m in ("eager_none", "graphed_static")}
    monkeypatch.setattr(compare, "run_modes", lambda *a, **k: results)
    assert main(["train", "--compare", "--no-progress"]) == 0
    assert "mismatch" not in capsys.readouterr().err
