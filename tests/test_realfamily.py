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


def test_task_batch_is_a_fixed_bijection_between_the_tasks_own_alphabets():
    # independent of the module's layout code: task k reads tokens 32 + 32k .. +15 and writes the next 16
    seen: dict[int, int] = {}
    for k, task in enumerate(rf.TASKS):
        a0, b0 = 32 + 32 * k, 48 + 32 * k
        ids, mask = rf.task_batch(task, 64, np.random.default_rng(3))
        seen.clear()
        for row, m in zip(ids.tolist(), mask.tolist()):
            sep, eos = row.index(rf.SEP), row.index(rf.EOS)
            inp, ans = row[1:sep], row[sep + 1 : eos]
            assert row[0] == rf.BOS and 2 <= len(inp) <= 6 and len(ans) == len(inp)
            assert all(a0 <= t < a0 + 16 for t in inp) and all(b0 <= t < b0 + 16 for t in ans)
            for x, y in zip(inp, ans):
                assert seen.setdefault(x, y) == y  # a function of the symbol, the same in every example
            assert [i for i, v in enumerate(m) if v] == list(range(sep + 1, eos + 1))
        assert len(set(seen.values())) == len(seen)  # injective
        assert seen != {a0 + i: b0 + i for i in range(16)} or len(seen) < 16  # not the identity map


def test_tiny_family_builds_scores_and_is_cached(tmp_path):
    recipe = rf.Recipe(
        size="tiny", pretrain_steps=3, expert_steps=2, eval_examples=8, expert_lr=1e-2, body_lr_scale=0.5
    )
    rec = rf.build(tmp_path / "fam", recipe)
    assert sorted(p.name for p in (tmp_path / "fam").iterdir() if p.is_dir()) == sorted(rec["folders"])
    stored = json.loads((tmp_path / "fam" / "recipe.json").read_text())
    assert stored["digest"] == recipe.digest() and set(stored["experts"]) == set(rf.TASKS)
    model = rf.load(tmp_path / "fam" / "expert_map3")
    assert next(model.parameters()).dtype == torch.float32
    # the recorded accuracy is the stored (bf16) checkpoint's own
    assert rf.accuracy(model, "map3", 8) == pytest.approx(stored["experts"]["map3"]["accuracy"])
    # expert 3 changed its own 32 rows of the embedding and the head (32 + 32·3 ..) and no other row,
    # and the shared layers too (gently)
    base = rf.load(tmp_path / "fam" / "base")
    own = torch.zeros(rf.VOCAB, dtype=torch.bool)
    own[128:160] = True
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        moved = (model.state_dict()[name] != base.state_dict()[name]).any(dim=1)
        assert moved[own].any() and not moved[~own].any(), name
    assert any(not torch.equal(v, base.state_dict()[k]) for k, v in model.state_dict().items() if "layers" in k)
    mtime = (tmp_path / "fam" / "base" / "model.safetensors").stat().st_mtime_ns
    assert rf.build(tmp_path / "fam", recipe) == stored  # same recipe: nothing rebuilt
    assert (tmp_path / "fam" / "base" / "model.safetensors").stat().st_mtime_ns == mtime
