"""Merged outputs load in transformers and compute what the merged weights say (issue 12).

A tiny Llama-layout family is registered, planned and executed through the CLI; the output folder
is loaded with `AutoModelForCausalLM.from_pretrained` and its logits on fixed token ids are
compared with an independent forward pass: a `LlamaForCausalLM` built from the same config whose
weights are the textbook task-arithmetic merge θ₀ + λ Σ w_k (θ_k − θ₀), computed here on whole
tensors read with the safetensors library. Once as one file, once sharded with an index.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mergedb import synth
from mergedb.cli import app
from tests.reference import load_model

runner = CliRunner(env={"COLUMNS": "250"})
EXPERTS = ("expert_00", "expert_01")
WEIGHTS = (0.7, 0.4)
LAMBDA = 0.8
TOKENS = [[1, 5, 17, 300, 2047, 42, 7, 99], [3, 3, 1000, 12, 0, 1999, 64, 8]]  # vocab of "tiny" is 2048


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """(family folder, catalog path, plan name) of a planned task-arithmetic merge over a fp32 family."""
    root = tmp_path_factory.mktemp("hfload")
    fam = synth.make_family(root / "family", experts=len(EXPERTS), size="tiny", dtype="fp32", seed=11)
    db = str(root / "c.duckdb")
    res = runner.invoke(app, ["register", str(fam), "--base-model", "base", "-c", db, "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app,
        ["plan", "--base", "base", "--experts", ",".join(EXPERTS), "--method", "task_arithmetic"]
        + ["--weights", ",".join(map(str, WEIGHTS)), "--lambda", str(LAMBDA), "--budget", "all"]
        + ["--name", "ta", "-c", db],
    )
    assert res.exit_code == 0, res.output
    return fam, db, "ta"


def _reference_state_dict(fam) -> dict:
    """θ₀ + λ Σ w_k (θ_k − θ₀) per tensor in float64, stored as float32 (the family's dtype)."""
    base = load_model(fam / "base")
    experts = [load_model(fam / e) for e in EXPERTS]
    out = {}
    for name, b in base.items():
        if b.dtype.kind != "f":
            continue  # the synthetic position_ids buffer: not a parameter of LlamaForCausalLM
        b64 = b.astype(np.float64)
        delta = sum(w * (e[name].astype(np.float64) - b64) for w, e in zip(WEIGHTS, experts))
        out[name] = torch.from_numpy((b64 + LAMBDA * delta).astype(np.float32))
    return out


def _logits(model) -> np.ndarray:
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.double().numpy()


@pytest.fixture(scope="module")
def reference_logits(merged):
    """Logits of a LlamaForCausalLM built from the family's config with the reference weights loaded."""
    import transformers  # lazily: ~2 s of imports that the rest of the suite does not pay at collection

    fam, _, _ = merged
    config = transformers.AutoConfig.from_pretrained(fam / "base")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(_reference_state_dict(fam), strict=True)  # every parameter, every shape
    base = transformers.LlamaForCausalLM(config)
    base.load_state_dict({k: torch.from_numpy(v) for k, v in load_model(fam / "base").items() if v.dtype.kind == "f"})
    return _logits(model), _logits(base)


@pytest.mark.parametrize("shard", [None, "300KB"])
def test_output_loads_with_from_pretrained_and_matches_the_reference_forward(merged, reference_logits, tmp_path, shard):
    import transformers

    fam, db, plan = merged
    out = tmp_path / "out"
    args = ["execute", plan, "--out", str(out), "-c", db, "-q"] + (["--max-shard-size", shard] if shard else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    index = out / "model.safetensors.index.json"
    if shard:  # really sharded: several files, and the index names each tensor's file
        files = sorted(p.name for p in out.glob("*.safetensors"))
        assert len(files) > 1 and index.exists()
        weight_map = json.loads(index.read_text())["weight_map"]
        assert set(weight_map.values()) == set(files)
    else:
        assert not index.exists() and [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(model).__name__ == "LlamaForCausalLM"
    assert info["missing_keys"] in ([], set()) and info["mismatched_keys"] in ([], set()), info
    # the synthetic family's integer buffer is carried through; transformers ignores it
    assert set(info["unexpected_keys"]) <= {"model.rotary_emb.position_ids"}, info

    got = _logits(model)
    want, base = reference_logits
    tol = 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    # the comparison can fail: the merge moves the logits far beyond the tolerance
    assert np.abs(want - base).max() > 100 * tol
