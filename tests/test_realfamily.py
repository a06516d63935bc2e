"""The real-family builder of the fidelity benchmark (benchmarks/realfamily.py) at a tiny size."""

from __future__ import annotations

import dataclasses
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


def test_answer_positions_only_equals_the_full_logits(tmp_path):
    # the fast path (LM head at the answer positions only) against the full logits of the same model
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(rf.config("tiny", rf.SPREAD.vocab)).eval()
    with torch.no_grad():  # a peaked head, so that some answers are right by chance and some wrong
        model.lm_head.weight.mul_(50)
    ids, mask = rf.eval_set("map5", 64, layout=rf.SPREAD)
    with torch.no_grad():  # even examples: answers the model's own greedy ones, so that they score right
        for t in range(1, ids.shape[1]):
            pred = model(input_ids=ids[::2]).logits[:, t - 1].argmax(-1)
            ids[::2, t] = torch.where(mask[::2, t], pred, ids[::2, t])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=(ids != rf.PAD).long()).logits
    fast = rf.accuracy_per_example(model, ids, mask)
    assert fast.tolist() == _reference(full.numpy(), ids.numpy(), mask.numpy())
    assert 0 < int(fast.sum()) < 64


def test_spread_layout_moves_shared_rows_and_layers_and_reuses_its_pretraining(tmp_path):
    recipe = rf.Recipe(
        size="tiny", layout="spread", pretrain_steps=3, expert_steps=3, eval_examples=8, body_lr_scale=0.3
    )
    rec = rf.build(tmp_path / "fam", recipe)
    lay = rf.SPREAD
    # independent of Layout: inputs of task k at 32 + 16k, outputs shared by tasks 2j and 2j+1 at 160 + 16j
    assert lay.alphabets("map3") == (32 + 16 * 3, 160 + 16) and lay.alphabets("map2")[1] == 160 + 16
    base = rf.load(tmp_path / "fam" / "base")
    model = rf.load(tmp_path / "fam" / "expert_map3")
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    d_emb = (model.state_dict()[emb] - base.state_dict()[emb]).abs().amax(dim=1)
    d_head = (model.state_dict()[head] - base.state_dict()[head]).abs().amax(dim=1)
    other_inputs = [r for r in range(32, 160) if not 80 <= r < 96]
    assert (d_emb[other_inputs] == 0).all() and (d_emb[224:] == 0).all()  # tokens it never reads: no gradient
    assert (d_head[224:] > 0).float().mean() > 0.9  # no row is frozen: the softmax moves every head row
    # own rows move at 1/0.3 the rate of the rest
    assert d_head[176:192].mean() > 2 * d_head[224:].mean()
    share = rec["experts"]["map3"]["delta_share"]
    assert share["own_rows"] < 1 and abs(sum(share.values()) - 1) < 1e-9
    # same pre-training, another expert phase: the pre-trained weights are reused, the experts rebuilt
    again = rf.build(tmp_path / "fam", dataclasses.replace(recipe, expert_steps=2))
    assert again["pretrain_reused"] and again["digest"] != rec["digest"]
    assert torch.equal(rf.load(tmp_path / "fam" / "base").state_dict()[head], base.state_dict()[head])
