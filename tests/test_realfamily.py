"""The real-family builder of the fidelity benchmark (benchmarks/realfamily.py) at a tiny size."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import realfamily as rf  # noqa: E402


class FixedLogits:
    """A stand-in model whose logits are given: what `accuracy_per_example` sees of a model."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __call__(self, input_ids, attention_mask):
        return types.SimpleNamespace(logits=self.logits)


def _reference(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> list[bool]:
    """Textbook teacher-forced exact match: token t is predicted by the argmax at position t-1."""
    out = []
    for i in range(ids.shape[0]):
        ok = True
        for t in range(1, ids.shape[1]):
            if mask[i, t] and int(np.argmax(logits[i, t - 1])) != ids[i, t]:
                ok = False
        out.append(ok)
    return out


def test_accuracy_matches_an_independent_count_on_a_hand_made_case():
    # two examples "BOS task 5 7 SEP 9 EOS" with answer mask on "9 EOS"
    ids = torch.tensor([[1, 40, 9, 11, 3, 13, 2, 0], [1, 40, 9, 11, 3, 13, 2, 0]])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5:7] = True
    logits = torch.zeros(2, 8, rf.VOCAB)
    # example 0: right at both answer positions (4 -> 13, 5 -> EOS), wrong elsewhere (not scored)
    logits[0, 4, 13] = 1.0
    logits[0, 5, 2] = 1.0
    logits[0, 0, 50] = 1.0
    # example 1: right answer digit, wrong EOS
    logits[1, 4, 13] = 1.0
    logits[1, 5, 7] = 1.0
    got = rf.accuracy_per_example(FixedLogits(logits), ids, mask).tolist()
    assert got == _reference(logits.numpy(), ids.numpy(), mask.numpy()) == [True, False]


def test_task_batch_masks_exactly_the_answer_and_eos():
    rng = np.random.default_rng(3)
    ids, mask = rf.task_batch("max", 16, rng)
    for row, m in zip(ids.tolist(), mask.tolist()):
        sep, eos = row.index(rf.SEP), row.index(rf.EOS)
        digits = [t - rf.DIGIT0 for t in row[2:sep]]
        assert row[sep + 1 : eos] == [rf.DIGIT0 + max(digits)]
        assert [i for i, v in enumerate(m) if v] == list(range(sep + 1, eos + 1))


def test_tiny_family_builds_scores_and_is_cached(tmp_path):
    recipe = rf.Recipe(size="tiny", pretrain_steps=3, expert_steps=2, eval_examples=8)
    rec = rf.build(tmp_path / "fam", recipe)
    assert sorted(p.name for p in (tmp_path / "fam").iterdir() if p.is_dir()) == sorted(rec["folders"])
    stored = json.loads((tmp_path / "fam" / "recipe.json").read_text())
    assert stored["digest"] == recipe.digest() and set(stored["experts"]) == set(rf.TASKS)
    model = rf.load(tmp_path / "fam" / "expert_max")
    assert next(model.parameters()).dtype == torch.float32
    # the recorded accuracy is the stored (bf16) checkpoint's own
    assert rf.accuracy(model, "max", 8) == pytest.approx(stored["experts"]["max"]["accuracy"])
    mtime = (tmp_path / "fam" / "base" / "model.safetensors").stat().st_mtime_ns
    assert rf.build(tmp_path / "fam", recipe) == stored  # same recipe: nothing rebuilt
    assert (tmp_path / "fam" / "base" / "model.safetensors").stat().st_mtime_ns == mtime
