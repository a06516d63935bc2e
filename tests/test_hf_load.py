"""Merged outputs load in transformers and compute what the merged weights say (issue 12).

A tiny Llama-layout family is registered, planned and executed through the CLI; the output folder
is loaded with `AutoModelForCausalLM.from_pretrained` and its logits on fixed token ids are
compared with an independent forward pass: a `LlamaForCausalLM` built from the same config whose
weights are the textbook task-arithmetic merge θ₀ + λ Σ w_k (θ_k − θ₀), computed here on whole
tensors read with the safetensors library. Once as one file, once sharded with an index.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

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


# --- what an output carries from the base besides weights, loaded by transformers -------------------------------

_CONFIG_PY = """from transformers import LlamaConfig


class MyConfig(LlamaConfig):
    model_type = "my"
"""
_MODELING_PY = """from transformers import LlamaForCausalLM

from .configuration_my import MyConfig
from .my_helpers import SCALE


class MyForCausalLM(LlamaForCausalLM):
    config_class = MyConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * SCALE
        return out
"""


def _tiny_pair(root, custom_code: bool = False, chat_templates: bool = False):
    """(base, expert) folders saved by transformers' own save_pretrained: a 1-layer Llama, the expert
    its weights plus noise; with `custom_code` a trust_remote_code model (auto_map, configuration_my.py,
    modeling_my.py importing my_helpers.py); with `chat_templates` a tokenizer with a default and a
    named `tool_use` chat template."""
    import transformers
    from tokenizers import Tokenizer, models

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    folders = []
    for name in ("base", "expert"):
        if name == "expert":
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        folder = root / name
        model.save_pretrained(folder)
        if custom_code:
            (folder / "configuration_my.py").write_text(_CONFIG_PY)
            (folder / "modeling_my.py").write_text(_MODELING_PY)
            (folder / "my_helpers.py").write_text("SCALE = 2.0\n")
            (folder / "train_notes.py").write_text("raise SystemExit('not part of the model')\n")
            doc = json.loads((folder / "config.json").read_text())
            doc["model_type"] = "my"
            doc["auto_map"] = {
                "AutoConfig": "configuration_my.MyConfig",
                "AutoModelForCausalLM": "modeling_my.MyForCausalLM",
                "AutoTokenizer": [None, "other/repo--tokenization_other.OtherTokenizerFast"],  # another repo's
            }
            (folder / "config.json").write_text(json.dumps(doc))
        if chat_templates:
            vocab = {f"t{i}": i for i in range(64)} | {"<unk>": 0}
            tok = transformers.PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
            )
            tok.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "TOOLS {{ tools }}"}
            tok.save_pretrained(folder)
        folders.append(folder)
    return folders


def _merge_cli(root, base, expert, *extra) -> tuple[str, object]:
    """Register base and expert, plan task arithmetic with weight 1 and λ 1 (the output is the expert's
    weights, to rounding); (catalog, CliRunner result of the execute into root/out)."""
    db = str(root / "c.duckdb")
    for args in (
        ["register", str(base), "--base", "--name", "base"],
        ["register", str(expert), "--name", "expert", "--base-model", "base"],
    ):
        res = runner.invoke(app, [*args, "-c", db, "-q"])
        assert res.exit_code == 0, res.output
    plan = ["plan", "--base", "base", "--experts", "expert", "--method", "task_arithmetic", "--weights", "1"]
    res = runner.invoke(app, [*plan, "--lambda", "1", "--budget", "all", "--name", "p", "-c", db])
    assert res.exit_code == 0, res.output
    return db, runner.invoke(app, ["execute", "p", "--out", str(root / "out"), "-c", db, "-q", *extra])


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers copies remote code into its modules cache: here a fresh one under tmp_path."""
    from transformers import dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.syspath_prepend(str(tmp_path / "hf_modules"))


def test_custom_code_model_output_loads_with_trust_remote_code(tmp_path, modules_cache):
    """The code files the base's auto_map names (and what they import relatively) are copied, nothing
    else: transformers loads the output as the custom class and computes the expert's logits."""
    import transformers

    base, expert = _tiny_pair(tmp_path, custom_code=True)
    _, res = _merge_cli(tmp_path, base, expert)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    assert {"configuration_my.py", "modeling_my.py", "my_helpers.py"} <= {p.name for p in out.iterdir()}
    assert not (out / "train_notes.py").exists()  # a .py the auto_map does not reach
    kw = {"trust_remote_code": True, "dtype": torch.float32, "attn_implementation": "eager"}
    got = transformers.AutoModelForCausalLM.from_pretrained(out, **kw)
    want = transformers.AutoModelForCausalLM.from_pretrained(expert, **kw)
    assert type(got).__name__ == "MyForCausalLM"
    tokens = torch.tensor([[1, 5, 17, 30, 2]])
    with torch.no_grad():
        a, b = got(tokens).logits.numpy(), want(tokens).logits.numpy()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())
    assert res.exit_code == 0 and runner.invoke(app, ["check", "--output", str(out)]).exit_code == 0


def test_a_base_without_the_code_its_auto_map_names_merges_with_what_it_has(tmp_path):
    """Many downloads keep a config's auto_map but not its .py files (Phi-3, Qwen2: `*.json
    *.safetensors` only), and transformers loads them natively by model_type: such a base was
    refused. The output carries the code files the base has (none missing is invented) and loads as
    the base does."""
    import transformers

    base, expert = _tiny_pair(tmp_path, custom_code=True)
    for f in ("my_helpers.py", "modeling_my.py"):
        (base / f).unlink()
    _, res = _merge_cli(tmp_path, base, expert)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.py")) == ["configuration_my.py"]  # not train_notes.py: auto_map
    assert (
        json.loads((out / "config.json").read_text())["auto_map"]
        == json.loads((base / "config.json").read_text())["auto_map"]
    )
    assert (
        type(transformers.AutoConfig.from_pretrained(out, trust_remote_code=True)).__name__
        == type(transformers.AutoConfig.from_pretrained(base, trust_remote_code=True)).__name__
    )


def test_named_chat_templates_are_carried_and_survive_a_force_rewrite(tmp_path):
    """transformers saves a tokenizer's named templates in additional_chat_templates/: the output's
    tokenizer has the base's templates (as transformers loads them from the base), also after
    `execute --force` over it; check --output verifies their hashes."""
    import transformers

    base, expert = _tiny_pair(tmp_path, chat_templates=True)
    assert (base / "additional_chat_templates" / "tool_use.jinja").is_file()
    db, res = _merge_cli(tmp_path, base, expert)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    want = transformers.AutoTokenizer.from_pretrained(base).chat_template
    assert isinstance(want, dict) and set(want) == {"default", "tool_use"}
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == want
    res = runner.invoke(app, ["execute", "p", "--out", str(out), "-c", db, "-q", "--force"])
    assert res.exit_code == 0, res.output
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == want
    assert not [p.name for p in tmp_path.iterdir() if ".mergedb-" in p.name]
    res = runner.invoke(app, ["check", "--output", str(out)])
    assert res.exit_code == 0, res.output
    (out / "additional_chat_templates" / "tool_use.jinja").write_text("edited")
    res = runner.invoke(app, ["check", "--output", str(out)])
    assert res.exit_code != 0 and "tool_use.jinja: differs from the file the output was written with" in res.output


def test_a_users_files_in_the_templates_folder_survive_a_force_rewrite(tmp_path):
    """The output's additional_chat_templates/ moves whole in a --force swap: a user's own template or
    folder put in it was deleted, or hidden in a leftover .OUT.mergedb-old-… folder (a review
    helper's find). Such a rewrite is refused now, before anything moves."""
    base, expert = _tiny_pair(tmp_path, chat_templates=True)
    db, res = _merge_cli(tmp_path, base, expert)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    (out / "additional_chat_templates" / "my_own.jinja").write_text("mine")
    (out / "additional_chat_templates" / "notes").mkdir()
    (out / "additional_chat_templates" / "notes" / "eval.txt").write_text("scores")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = runner.invoke(app, ["execute", "p", "--out", str(out), "-c", db, "-q", "--force"])
    assert res.exit_code == 1 and "my_own.jinja is not a file of the mergedb output there" in res.output, res.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not [p.name for p in tmp_path.iterdir() if ".mergedb-" in p.name]
    (out / "additional_chat_templates" / "my_own.jinja").unlink()
    res = runner.invoke(app, ["execute", "p", "--out", str(out), "-c", db, "-q", "--force"])
    assert res.exit_code == 1 and "additional_chat_templates/notes is not a file" in res.output, res.output
    shutil.rmtree(out / "additional_chat_templates" / "notes")
    res = runner.invoke(app, ["execute", "p", "--out", str(out), "-c", db, "-q", "--force"])
    assert res.exit_code == 0, res.output


def test_replay_of_an_output_written_with_fewer_side_files_writes_those(tmp_path):
    """An output written by a mergedb that copied fewer side files (before additional_chat_templates/,
    tekken.json, custom code): its replay was refused ('the base's side files … differ … edited
    since?') though nothing was edited. A replay writes the side files its output had."""
    from mergedb import manifest as mf

    base, expert = _tiny_pair(tmp_path, chat_templates=True)
    db, res = _merge_cli(tmp_path, base, expert)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    manifest = out / "mergedb_manifest.json"
    doc = json.loads(manifest.read_text())  # as an older mergedb wrote it: no templates, no run seal
    doc["run"]["side_files"] = {k: v for k, v in doc["run"]["side_files"].items() if "/" not in k}
    doc["run"]["files"] = [f for f in doc["run"]["files"] if f != "additional_chat_templates"]
    del doc["sealed_run"], doc["run"]["seal"]
    doc["content_hash"] = mf.content_hash(doc)
    manifest.write_text(json.dumps(doc))
    shutil.rmtree(out / "additional_chat_templates")
    res = runner.invoke(app, ["replay", str(manifest), "--out", str(tmp_path / "again")])
    assert res.exit_code == 0, res.output
    again = tmp_path / "again"
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in out.iterdir())
    for f in doc["run"]["side_files"]:
        assert (again / f).read_bytes() == (out / f).read_bytes()


def test_output_of_a_hugging_face_cache_snapshot_loads(tmp_path):
    """A base and expert read from the hub cache's layout (snapshots/REV/* -> ../../blobs/SHA): the
    output has their config and tokenizer, as regular files, and transformers loads it."""
    import transformers

    saved = _tiny_pair(tmp_path / "saved", chat_templates=True)
    snaps = []
    for folder, repo in zip(saved, ("models--org--base", "models--org--expert")):
        blobs, snap = tmp_path / "hub" / repo / "blobs", tmp_path / "hub" / repo / "snapshots" / "0123abcd"
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            rel = f.relative_to(folder)
            sha = hashlib.sha256(f.read_bytes()).hexdigest()
            blobs.mkdir(parents=True, exist_ok=True)
            (blobs / sha).write_bytes(f.read_bytes())
            (snap / rel).parent.mkdir(parents=True, exist_ok=True)
            (snap / rel).symlink_to(os.path.relpath(blobs / sha, (snap / rel).parent))
        snaps.append(snap)
    _, res = _merge_cli(tmp_path, *snaps)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "additional_chat_templates/tool_use.jinja"):  # fmt: skip
        assert (out / name).is_file() and not (out / name).is_symlink(), name
        assert (out / name).read_bytes() == (saved[0] / name).read_bytes(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template["tool_use"] == "TOOLS {{ tools }}"
