"""mergekit configs: parsing, refusals, per-tensor evaluation, model binding, export round trip.

Expected values come from mergekit's documented rules computed here independently (gradients as
np.interp over evenly spaced knots, t = layer / (L − 1), t = 0 outside the layers, first matching
filter, per-model over top level) and, where mergekit's own virtual environment exists, from
mergekit 0.1.5's planner itself (tests/mergekit_oracle.py run as a subprocess).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.configs import MERGEKIT_DEFAULTS, bind_models, parse_config, to_mergekit_yaml
from mergedb.errors import ConfigError, MergeDBError
from mergedb.mkresolve import mergekit_params

LAYERS = 5
KINDS = ("input_layernorm", "self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
NAMES = (
    ["model.embed_tokens.weight"]
    + [f"model.layers.{i}.{k}.weight" for i in range(LAYERS) for k in KINDS]
    + ["model.norm.weight", "lm_head.weight"]
)
MK_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "cache" / "mergekit-venv" / "bin" / "python"
ORACLE = Path(__file__).with_name("mergekit_oracle.py")


def t_of(name: str) -> float:
    """mergekit 0.1.5 plan.py: layer i of L has t = i/(L-1); pre and post weights are planned with t = 0."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) / (LAYERS - 1)
    return 0.0


def grad(values: list[float], name: str) -> float:
    """The documented gradient: piecewise-linear between evenly spaced knots over t in [0, 1]."""
    return float(np.interp(t_of(name), np.linspace(0, 1, len(values)), values))


def one_line_error(text: str, *, names=NAMES) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(text).resolve(names)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, MergeDBError)
    return msg


# -- evaluation, by hand ---------------------------------------------------------------------------


def test_gradients_filters_and_fallthrough_by_hand():
    res = parse_config("""
merge_method: task_arithmetic
base_model: base
models:
  - model: a
    parameters:
      weight: [0, 0.3, 0.7, 1]
  - model: b
    parameters:
      weight:
        - filter: mlp
          value: [1, 0.5]
        - filter: self_attn.q_proj
          value: 2
  - model: c
parameters:
  weight:
    - filter: "*"
      value: 0.25
  lambda: [0.5, 1.5]
""").resolve(NAMES)
    assert res.experts == ("a", "b", "c") and res.method == "task_arithmetic"
    for n in NAMES:
        assert res.value(0, n, "weight") == pytest.approx(grad([0, 0.3, 0.7, 1], n), abs=1e-12)
        # b: first matching filter; no match falls through to the top level's "*" entry
        want_b = grad([1, 0.5], n) if "mlp" in n else 2.0 if "self_attn.q_proj" in n else 0.25
        assert res.value(1, n, "weight") == pytest.approx(want_b, abs=1e-12)
        assert res.value(2, n, "weight") == 0.25
        for k in range(3):  # lambda is merge-wide: the same for every expert
            assert res.value(k, n, "lambda") == pytest.approx(grad([0.5, 1.5], n), abs=1e-12)
    # embeddings, final norm and lm_head take the gradient's first value (t = 0)
    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert res.value(0, n, "weight") == 0.0 and res.value(0, n, "lambda") == 0.5
    assert res.value(0, "model.layers.4.mlp.up_proj.weight", "weight") == 1.0


def test_override_table_holds_only_exceptions_with_the_agreed_columns():
    res = parse_config("""
merge_method: ties
base_model: base
models:
  - model: a
    parameters: {weight: 1, density: 0.5}
  - model: b
    parameters:
      weight: 1
      density: [{filter: layers.2., value: 0.2}, {value: 0.5}]
""").resolve(NAMES)
    t = res.tensor_params
    assert [(f.name, str(f.type)) for f in t.schema] == [
        ("position", "int32"),
        ("tensor", "string"),
        ("param", "string"),
        ("value", "double"),
    ]
    want = sorted((1, n, "density", 0.2) for n in NAMES if "layers.2." in n)
    assert sorted(tuple(r.values()) for r in t.to_pylist()) == want
    assert res.weights == (1.0, 1.0) and res.params == {"density": 0.5, "lambda": 1.0, "normalize": True}


def test_per_model_over_top_level_and_mergekit_defaults():
    res = parse_config("""
merge_method: dare_ties
base_model: base
models:
  - model: a
    parameters: {weight: 0.7}
  - model: b
parameters: {weight: 0.3, density: 0.4}
""").resolve(NAMES)
    assert res.weights == (0.7, 0.3)
    # mergekit 0.1.5: dare_ties defaults to normalize false, lambda 1, rescale true (mergedb's 1/p)
    assert res.params == {"density": 0.4, "lambda": 1.0, "normalize": False}
    ties = parse_config("merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {weight: 1}}]")
    # mergekit's ties keeps everything unless density is given (its default is 1.0, mergedb's own is 0.2)
    assert ties.resolve(NAMES).params == {"density": 1.0, "lambda": 1.0, "normalize": True}


def test_normalisation_is_folded_into_coefficients():
    ta = parse_config("""
merge_method: task_arithmetic
base_model: base
models: [{model: a, parameters: {weight: 1}}, {model: b, parameters: {weight: 3}}]
parameters: {normalize: true}
""").resolve(NAMES)
    assert ta.weights == (0.25, 0.75)
    # linear: mergekit averages its inputs, the base among them when base_model is given
    lin = parse_config("""
merge_method: linear
base_model: base
models: [{model: a, parameters: {weight: 1}}, {model: b, parameters: {weight: 2}}]
parameters: {weight: 1}
""").resolve(NAMES)
    assert lin.weights == (0.25, 0.5) and lin.params == {"normalize": False}
    # ... but not to a slice's sources, which mergekit merges as written: (a + 2b) / 3, no base (review)
    sliced = parse_config(f"""
merge_method: linear
base_model: base
slices:
  - sources:
      - {{model: a, layer_range: [0, {LAYERS}], parameters: {{weight: 1}}}}
      - {{model: b, layer_range: [0, {LAYERS}], parameters: {{weight: 2}}}}
parameters: {{weight: 1}}
""").resolve(NAMES)
    assert sliced.weights == pytest.approx((1 / 3, 2 / 3), abs=1e-15) and sliced.params == {"normalize": False}
    lin2 = parse_config("""
merge_method: linear
models: [{model: a, parameters: {weight: [1, 3]}}, {model: b, parameters: {weight: 1}}]
""").resolve(NAMES)
    for n in NAMES:
        wa = grad([1, 3], n)
        assert lin2.value(0, n, "weight") == pytest.approx(wa / (wa + 1), abs=1e-12)
        assert lin2.value(1, n, "weight") == pytest.approx(1 / (wa + 1), abs=1e-12)


def test_density_edges_follow_mergekit():
    res = parse_config("""
merge_method: breadcrumbs
base_model: base
models:
  - model: a
    parameters: {weight: 1, density: [0, 0.5, 1]}
""").resolve(NAMES)
    for n in NAMES:
        d = grad([0, 0.5, 1], n)
        if d <= 0:  # mergekit zeroes the delta
            assert res.value(0, n, "weight") == 0.0
        elif d >= 1:  # mergekit keeps it untouched: no outliers removed either
            assert (res.value(0, n, "density"), res.value(0, n, "gamma")) == (1.0, 0.0)
        else:
            assert res.value(0, n, "density") == pytest.approx(d) and res.value(0, n, "gamma") == 0.01


def test_scalar_trim_parameters_are_a_combination_some_tensor_has():
    # a: density 1 (so gamma 0) everywhere; b, c: gamma 0.1 and densities that vary by layer. The most
    # common density (1) and the most common gamma (0.1) never occur together, and 1.1 > 1 is invalid.
    res = parse_config(
        head("breadcrumbs") + "models: [{model: a, parameters: {weight: 1}}, "
        "{model: b, parameters: {weight: 1, density: [0.2, 0.6], gamma: 0.1}}, "
        "{model: c, parameters: {weight: 1, density: [0.3, 0.7], gamma: 0.1}}]"
    ).resolve(NAMES)
    d, g = res.params["density"], res.params["gamma"]
    assert g + d <= 1 and (d, g) in {
        (res.value(k, n, "density"), res.value(k, n, "gamma")) for k in (0, 1) for n in NAMES
    }


def test_slices_covering_full_range_become_models():
    cfg = parse_config(f"""
slices:
  - sources:
      - {{model: base, layer_range: [0, {LAYERS}]}}
      - {{model: a, layer_range: [0, {LAYERS}]}}
merge_method: slerp
base_model: base
parameters:
  t:
    - {{filter: self_attn, value: [0, 0.5, 0.3, 0.7, 1]}}
    - {{filter: mlp, value: [1, 0.5, 0.7, 0.3, 0]}}
    - value: 0.5
dtype: bfloat16
""")
    assert [m.model for m in cfg.models] == ["base", "a"] and cfg.output_dtype == "bf16"
    res = cfg.resolve(NAMES)
    for n in NAMES:
        want = grad([0, 0.5, 0.3, 0.7, 1], n) if "self_attn" in n else grad([1, 0.5, 0.7, 0.3, 0], n)
        assert res.value(0, n, "t") == pytest.approx(want if ("self_attn" in n or "mlp" in n) else 0.5, abs=1e-12)


# -- refusals --------------------------------------------------------------------------------------


def head(method: str, base: bool = True) -> str:
    return f"merge_method: {method}\n" + ("base_model: base\n" if base else "")


TA = head("task_arithmetic")
MODELS = "models: [{model: a, parameters: {weight: 1}}]\n"
TWO = "models: [{model: a}, {model: b}]\n"
W = "models: [{model: a, parameters: {weight: %s}}]\n"  # one model with this weight


def sources(*ranges: str, extra: str = "") -> str:
    srcs = ", ".join(f"{{model: {m}, layer_range: {r}}}" for m, r in zip(("base", "a"), ranges))
    return f"slices: [{{sources: [{srcs}]{extra}}}]\n"


REFUSED = [
    ("modules", TA + "modules: {text: {models: [{model: a}]}}", "modules"),
    ("tokenizer", TA + MODELS + "tokenizer: {source: union}", "tokenizer"),
    ("chat_template", TA + MODELS + "chat_template: chatml", "chat_template"),
    ("unknown top key", TA + MODELS + "naem: x", "'naem'"),
    ("passthrough", head("passthrough", False) + MODELS, "passthrough"),
    ("nuslerp", head("nuslerp", False) + MODELS, "nuslerp"),
    ("unknown method", head("averaging", False) + MODELS, "'averaging'"),
    ("tokenizer union", TA + MODELS + "tokenizer_source: union", "tokenizer_source"),
    ("tokenizer of a model", TA + MODELS + "tokenizer_source: a", "tokenizer_source"),
    ("models and slices", TA + MODELS + "slices: []", "exactly one of models: or slices:"),
    ("neither", TA, "exactly one of models: or slices:"),
    ("two slices", TA + "slices: [{sources: [{model: a, layer_range: [0, 2]}]}, {sources: []}]", "frankenmerge"),
    ("slice not from 0", TA + sources("[1, 5]", "[1, 5]"), "frankenmerge"),
    ("mixed ranges", TA + sources("[0, 5]", "[0, 4]"), "frankenmerge"),
    ("residual_weight", TA + sources("[0, 5]", "[0, 5]", extra=", residual_weight: 0.5"), "residual"),
    ("source key", TA + "slices: [{sources: [{model: a, layer_range: [0, 5], scale: 2}]}]", "'scale'"),
    ("model entry key", TA + "models: [{model: a, weight: 1}]", "'weight'"),
    ("unknown parameter", TA + "models: [{model: a, parameters: {weight: 1, densty: 0.5}}]", "'densty'"),
    ("gamma for ties", head("ties") + MODELS + "parameters: {gamma: 0.1}", "'gamma'"),
    ("shared under a model", TA + "models: [{model: a, parameters: {weight: 1, lambda: 2}}]", "lambda"),
    ("normalize gradient", TA + MODELS + "parameters: {normalize: [true, false]}", "normalize"),
    ("rescale false for dare", head("dare_ties") + MODELS + "parameters: {rescale: false}", "rescale"),
    ("rescale true for ties", head("ties") + MODELS + "parameters: {rescale: true}", "rescale"),
    ("filter_wise", head("model_stock") + TWO + "parameters: {filter_wise: true}", "filter_wise"),
    ("dtype float64", TA + MODELS + "dtype: float64", "dtype"),
    ("out_dtype int", TA + MODELS + "out_dtype: int64", "out_dtype"),
    ("no base for ties", head("ties", False) + MODELS, "base_model"),
    ("slerp with two", head("slerp") + TWO + "parameters: {t: 0.5}", "slerp"),
    ("model_stock with one", head("model_stock") + "models: [{model: a}]", "model_stock"),
    ("duplicate model", TA + "models: [{model: a, parameters: {weight: 1}}, {model: a}]", "twice"),
    ("not a number", TA + W % "heavy", "weight"),
    ("empty gradient", TA + W % "[]", "weight"),
    ("filter entry keys", TA + W % "[{filter: mlp, val: 1}]", "weight"),
    ("model not a string", TA + "models: [{model: 3, parameters: {weight: 1}}]", "model"),
    ("not a mapping", "- merge_method: linear", "mapping"),
    ("bad yaml", "merge_method: [linear", "YAML"),
    # refused when evaluated over the model's tensors
    ("missing weight", TA + W % "[{filter: mlp, value: 1}]", "weight"),
    ("partial slice end", TA + sources("[0, 3]", "[0, 3]"), "full range"),
    ("linear not summing to 1", head("linear", False) + W % 0.3 + "parameters: {normalize: false}", "sum"),
    ("negative weight in ties", head("ties") + W % -1, "negative"),
    ("an int past float's range", TA + W % ("1" + "0" * 400), "is not a finite number"),
    ("della epsilon", head("della") + MODELS + "parameters: {density: 0.9, epsilon: 0.1}", "epsilon"),
    ("breadcrumbs gamma", head("breadcrumbs") + MODELS + "parameters: {density: 0.95, gamma: 0.1}", "gamma"),
]


@pytest.mark.parametrize("text,needle", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_every_refused_key_gets_one_line_naming_it(text, needle):
    assert needle in one_line_error(text)


def test_gradient_without_llama_layers_is_refused():
    msg = one_line_error(TA + "models: [{model: a, parameters: {weight: [0, 1]}}]", names=["encoder.h.0.w", "head"])
    assert "model.layers" in msg


# -- models: registered checkpoints ----------------------------------------------------------------

Row = namedtuple("Row", "name role base path fingerprint")


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    root = tmp_path_factory.mktemp("mkcfg")
    synth.make_family(root / "family", experts=2, size="tiny", seed=5)
    cat = Catalog(root / "catalog.duckdb")
    cat.register([root / "family"], base_model="base")
    return root, cat.checkpoints()


def test_models_bound_by_name_path_and_fingerprint(registered, tmp_path):
    root, rows = registered
    copy = tmp_path / "moved_expert"
    shutil.copytree(root / "family" / "expert_01", copy)  # copy2 keeps mtimes: the same fingerprint
    cfg = parse_config(f"""
merge_method: ties
base_model: family/base
models:
  - model: expert_00
    parameters: {{weight: 1}}
  - model: {copy}
    parameters: {{weight: 1}}
""")
    bound = bind_models(cfg, rows, cwd=root)
    assert bound.base_model == "base" and [m.model for m in bound.models] == ["expert_00", "expert_01"]
    lin = bind_models(parse_config("merge_method: linear\nmodels: [{model: expert_00}, {model: expert_01}]"), rows)
    assert lin.base_model == "base" and lin.base_inferred
    listed = bind_models(parse_config("merge_method: linear\nmodels: [{model: base}, {model: expert_01}]"), rows)
    assert listed.base_model == "base" and not listed.base_inferred  # the listed base is an input with a weight
    with pytest.raises(ConfigError, match="nothing to merge"):
        bind_models(parse_config("merge_method: linear\nmodels: [{model: base}]"), rows)


def test_a_copy_matching_several_registered_checkpoints_is_refused_not_guessed(registered, tmp_path):
    """Experts unpacked from an archive share sizes, headers and whole-second times: a copy of one
    matched the first registered row with its fingerprint, so a config asking for expert_01 merged
    expert_00, silently (review, 2026-12-03). Several matches are refused; the name or the
    registered path still binds."""
    import dataclasses

    root, rows = registered
    copy = tmp_path / "copy_of_01"
    shutil.copytree(root / "family" / "expert_01", copy)
    fp = next(r.fingerprint for r in rows if r.name == "expert_01")
    twins = [dataclasses.replace(r, fingerprint=fp) if r.name == "expert_00" else r for r in rows]
    cfg = "merge_method: linear\nbase_model: base\nmodels: [{model: %s}]"
    with pytest.raises(ConfigError, match=r"match 2 registered checkpoints \(expert_00, expert_01\)"):
        bind_models(parse_config(cfg % copy), twins)
    assert [m.model for m in bind_models(parse_config(cfg % copy), rows).models] == ["expert_01"]
    assert [m.model for m in bind_models(parse_config(cfg % "expert_01"), twins).models] == ["expert_01"]


def test_accepted_spellings():
    cfg = parse_config(TA + W % "'1e-3'" + "tokenizer_source: base\ndtype: torch.float16\n")
    assert cfg.output_dtype == "fp16" and cfg.tokenizer_source == "base"
    assert cfg.resolve(NAMES).weights == (0.001,)  # mergekit validates "1e-3" (a YAML string) as a float


def test_unregistered_and_misfiled_models_say_what_to_run(registered, tmp_path):
    root, rows = registered
    synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=9)
    new = tmp_path / "other" / "expert_00"
    cfg = parse_config(f"merge_method: ties\nbase_model: base\nmodels: [{{model: {new}, parameters: {{weight: 1}}}}]")
    with pytest.raises(ConfigError, match=r"not registered.*mergedb register .*expert_00 --base-model base"):
        bind_models(cfg, rows)
    hub = parse_config("merge_method: ties\nbase_model: base\nmodels: [{model: org/model, parameters: {weight: 1}}]")
    with pytest.raises(ConfigError, match="download it to a folder first"):
        bind_models(hub, rows)
    # mergekit's model+lora and model@revision when no such path exists; a relative path that is missing
    for ref, words in (
        ("a+lora", "model 'a' is neither a folder here nor a registered name"),
        ("base+expert_00", "applies 'expert_00' to 'base', but 'expert_00' is not a LoRA adapter registered against"),
        # an expert on the left: registering the adapter against it (the advice before) cannot work
        ("expert_00+expert_01", "applies 'expert_01' to 'expert_00', which is registered as an expert, not a base"),
        ("org/a@main", "names a hub revision"),
        ("../family/base", r"there is no .*family/base \(a relative path is read from"),
    ):
        cfg = parse_config(
            f"merge_method: ties\nbase_model: base\nmodels: [{{model: '{ref}', parameters: {{weight: 1}}}}]"
        )
        with pytest.raises(ConfigError, match=words):
            bind_models(cfg, rows, cwd=tmp_path)
    plus = tmp_path / "fam+ily@2"  # a folder whose name holds + and @ is that folder
    shutil.copytree(root / "family" / "expert_00", plus)
    cfg = parse_config(
        f"merge_method: ties\nbase_model: base\nmodels: [{{model: '{plus}', parameters: {{weight: 1}}}}]"
    )
    assert [m.model for m in bind_models(cfg, rows).models] == ["expert_00"]  # matched by its fingerprint
    swapped = parse_config("merge_method: ties\nbase_model: expert_00\nmodels: [{model: expert_01}]")
    with pytest.raises(ConfigError, match="registered as an expert"):
        bind_models(swapped, rows)
    here = tmp_path / "other"  # a folder named like a registered checkpoint is that folder, never the namesake
    clash = parse_config("merge_method: ties\nbase_model: base\nmodels: [{model: expert_00, parameters: {weight: 1}}]")
    with pytest.raises(ConfigError, match="is a folder here that is not registered"):
        bind_models(clash, rows, cwd=here)
    other_base = [Row("b2", "base", None, "/x", "f"), Row("e2", "expert", "b2", "/y", "g")]
    mixed = parse_config("merge_method: ties\nbase_model: base\nmodels: [{model: expert_00}, {model: e2}]")
    with pytest.raises(ConfigError, match="with base 'b2', not 'base'"):
        bind_models(mixed, [*rows, *other_base])


# -- export ----------------------------------------------------------------------------------------

ROUND_TRIP = [
    """
merge_method: ties
base_model: base
models:
  - model: a
    parameters: {weight: [0.2, 1], density: [1, 0.7, 0.1]}
  - model: b
    parameters: {weight: [{filter: mlp, value: 0.5}, {value: 1}], density: 0.33}
parameters: {lambda: [1, 0.5]}
out_dtype: bfloat16
""",
    """
merge_method: linear
base_model: base
models: [{model: a, parameters: {weight: [1, 3]}}, {model: b, parameters: {weight: 2}}]
parameters: {weight: 0.5}
""",
    """
merge_method: della_linear
base_model: base
models:
  - model: a
    parameters: {weight: 1, density: [0.3, 0.6], epsilon: 0.1}
  - model: b
    parameters: {weight: 2, density: 0.5}
parameters: {normalize: true}
""",
    """
merge_method: slerp
base_model: base
models: [{model: a}]
parameters: {t: [{filter: self_attn, value: [0, 0.5, 1]}, {value: 0.25}]}
""",
    "merge_method: model_stock\nbase_model: base\nmodels: [{model: a}, {model: b}]",
]


def _all_values(res):
    params = [p for p in res.params if p != "normalize"]
    return {(k, n, p): res.value(k, n, p) for k in range(len(res.experts)) for n in NAMES for p in ["weight", *params]}


@pytest.mark.parametrize("text", ROUND_TRIP, ids=["ties", "linear", "della_linear", "slerp", "model_stock"])
def test_export_parses_back_to_the_same_per_tensor_parameters(text):
    res = parse_config(text).resolve(NAMES)
    paths = {"base": "/models/base", "a": "/models/a", "b": "/models/b"}
    back = parse_config(to_mergekit_yaml(res, paths, NAMES)).resolve(NAMES)
    assert back.method == res.method and back.experts == tuple(paths[e] for e in res.experts)
    assert back.params.get("normalize") == res.params.get("normalize") and back.output_dtype == res.output_dtype
    want, got = _all_values(res), _all_values(back)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= 1e-12 for k in want), [k for k in want if abs(got[k] - want[k]) > 1e-12][:3]


def test_export_filters_never_catch_a_longer_name():
    names = ["model.norm.weight", "model.norm.weight.extra", "lm_head.weight"]
    res = parse_config(TA + "models: [{model: a, parameters: {weight: [{filter: model.norm.weight.extra, value: 1},"
                       "{filter: model.norm.weight, value: 2}, {value: 3}]}}]")  # fmt: skip
    r = res.resolve(names)
    back = parse_config(to_mergekit_yaml(r, {"base": "b", "a": "a"}, names)).resolve(names)
    assert [back.value(0, n, "weight") for n in names] == [2.0, 1.0, 3.0]


# -- mergekit itself, when its virtual environment exists ------------------------------------------

needs_mergekit = pytest.mark.skipif(not MK_PY.exists(), reason=f"no mergekit venv at {MK_PY} (benchmarks make one)")


def _write_llama(folder: Path, layers: int = LAYERS) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    h = 8
    shapes = {"input_layernorm": (h,), "post_attention_layernorm": (h,)}
    tensors = {"model.embed_tokens.weight": np.zeros((16, h), np.float32)}
    for i in range(layers):
        for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj",
                  "mlp.gate_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):  # fmt: skip
            tensors[f"model.layers.{i}.{k}.weight"] = np.zeros(shapes.get(k, (h, h)), np.float32)
    tensors |= {"model.norm.weight": np.zeros(h, np.float32), "lm_head.weight": np.zeros((16, h), np.float32)}
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": h}
    config |= {"num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 16}
    (folder / "config.json").write_text(json.dumps(config))


def _oracle(*args: str) -> dict:
    out = subprocess.run([str(MK_PY), str(ORACLE), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@needs_mergekit
def test_defaults_table_is_mergekits():
    theirs = _oracle("defaults")
    assert {m: theirs[m] for m in MERGEKIT_DEFAULTS} == MERGEKIT_DEFAULTS


ORACLE_CONFIGS = [
    ROUND_TRIP[0],
    ROUND_TRIP[2],
    """
merge_method: linear
base_model: base
models:
  - model: a
    parameters: {weight: [{filter: mlp, value: [0, 1]}, {filter: norm, value: 2}]}
  - model: b
    parameters: {weight: 1}
parameters: {weight: [0.5, 0.1, 0.9]}
""",
    f"""
slices:
  - sources:
      - {{model: base, layer_range: [0, {LAYERS}]}}
      - {{model: a, layer_range: [0, {LAYERS}], parameters: {{weight: 3}}}}
      - {{model: b, layer_range: [0, {LAYERS}]}}
    parameters: {{weight: [0, 0.25, 1], density: [{{filter: q_proj, value: 0.9}}]}}
merge_method: breadcrumbs_ties
base_model: base
parameters: {{density: 0.5, gamma: [0.01, 0.05]}}
""",
    ROUND_TRIP[3],
]


@needs_mergekit
@pytest.mark.parametrize("i", range(len(ORACLE_CONFIGS)))
def test_per_tensor_parameters_match_mergekits_planner(tmp_path, i):
    for m in ("base", "a", "b"):
        _write_llama(tmp_path / m)
    text = ORACLE_CONFIGS[i]
    for m in ("base", "a", "b"):  # model names become these folders' absolute paths
        text = text.replace(f"model: {m}", f"model: {tmp_path / m}").replace(
            f"base_model: {m}", f"base_model: {tmp_path / m}"
        )
    (tmp_path / "c.yml").write_text(text)
    theirs = _oracle("plan", str(tmp_path / "c.yml"))
    mine = mergekit_params(parse_config(text), list(theirs))
    assert set(theirs) == set(NAMES) | {
        f"model.layers.{i}.{k}.weight"
        for i in range(LAYERS)
        for k in ("self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "post_attention_layernorm")
    }
    for name, v in theirs.items():
        shared, per = mine[name]
        assert shared == v["shared"], name
        assert {m: p for m, p in per.items() if p} == {m: p for m, p in v["inputs"].items() if p}, name


@needs_mergekit
@pytest.mark.parametrize("i", [0, 1, 2])
def test_exported_config_reads_the_same_in_mergekit(tmp_path, i):
    for m in ("base", "a", "b"):
        _write_llama(tmp_path / m)
    res = parse_config(ROUND_TRIP[i]).resolve(NAMES)
    text = to_mergekit_yaml(res, {m: str(tmp_path / m) for m in ("base", "a", "b")}, NAMES, base_dtype="BF16")
    (tmp_path / "c.yml").write_text(text)
    theirs = _oracle("plan", str(tmp_path / "c.yml"))
    mine = mergekit_params(parse_config(text), list(theirs))
    for name, v in theirs.items():
        assert mine[name][0] == v["shared"], name
        assert {m: p for m, p in mine[name][1].items() if p} == {m: p for m, p in v["inputs"].items() if p}, name


def test_readme_example_config_resolves_as_documented(tmp_path, monkeypatch, capsys):
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Coming from mergekit") :]
    config = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    synth.make_family(tmp_path / "family", experts=2, size="tiny", seed=1)
    Catalog(tmp_path / "mergedb.duckdb").register([tmp_path / "family"], base_model="base")
    (tmp_path / "merge.yml").write_text(config)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    res = ns["res"]
    assert res.experts == ("expert_00", "expert_01") and res.output_dtype == "bf16"
    layers = 2  # the tiny family
    for n in ns["names"]:
        t = int(n.split(".")[2]) / (layers - 1) if n.startswith("model.layers.") else 0.0
        assert res.value(0, n, "density") == pytest.approx(float(np.interp(t, [0, 0.5, 1], [1, 0.7, 0.1])))
        assert res.value(1, n, "weight") == (0.5 if "mlp" in n else 0.2)
    assert "merge_method: ties" in capsys.readouterr().out


@pytest.mark.parametrize(
    "method,params,weights",
    [
        ("ties", {"density": 0.3, "lambda": 0.8}, (1.0, 0.5)),
        ("linear", {}, (3.0, 1.0)),
        ("dare_linear", {}, (0.7, 0.3)),
    ],
)
def test_stored_plan_exports_to_a_config_that_resolves_to_it(registered, method, params, weights):
    from mergedb.configs import plan_resolution
    from mergedb.planner import PlanRequest

    root, rows = registered
    cat = Catalog(root / "catalog.duckdb")
    plan = cat.plan(
        PlanRequest(base="base", experts=("expert_00", "expert_01"), method=method, weights=weights, params=params)
    )
    names = cat.sql("SELECT name FROM family_tensors ORDER BY tensor_idx").column(0).to_pylist()
    text = to_mergekit_yaml(plan_resolution(plan), {r.name: r.path for r in rows}, names, base_dtype="BF16")
    back = bind_models(parse_config(text), rows).resolve(names)
    assert back.experts == ("expert_00", "expert_01") and back.output_dtype == "bf16"
    assert "tokenizer_source" not in text  # with one, mergekit resizes the embeddings to the tokenizer (review)
    # what mergedb will compute: linear's coefficients w / Σw; otherwise the plan's own weights
    want = [w / sum(weights) for w in weights] if method == "linear" else list(weights)
    for n in names:
        assert [back.value(k, n, "weight") for k in range(2)] == pytest.approx(want, abs=1e-12)
    for p, v in plan.params.items():
        if p != "normalize" or method != "linear":
            assert back.params[p] == v, p


def test_a_config_path_with_a_colon_is_a_path(tmp_path):
    path = tmp_path / "v1:ties.yml"
    path.write_text(TA + W % 1)
    assert parse_config(str(path)).resolve(NAMES).weights == (1.0,)  # was read as the YAML text 'v1:ties.yml'


def test_a_config_that_is_neither_text_nor_a_path_is_refused_by_name(tmp_path):
    """bytes were read as the YAML text "b'...'" (then refused as "not a mapping"), a NUL in a path
    raised a bare ValueError."""
    with pytest.raises(ConfigError, match="YAML text or a path to a YAML file, got b'"):
        parse_config(str(tmp_path / "a.yml").encode())
    with pytest.raises(ConfigError, match=r"cannot read config '.*a\\x00b.yml': .*give the file's path"):
        parse_config(str(tmp_path / "a\0b.yml"))


_TIES = "merge_method: ties\nbase_model: base\n"
_ONE = "models:\n  - model: a\n"


@pytest.mark.parametrize(
    "text, words",
    [
        ("merge_method: [ties]\nbase_model: base\n" + _ONE, "merge_method: .* is not a method name"),
        (_TIES + "dtype: [bfloat16]\n" + _ONE, "dtype: .* not supported"),
        (_TIES + "out_dtype: {a: 1}\n" + _ONE, "out_dtype: .* not supported"),
        (
            "merge_method: linear\nslices:\n  - base_model: [x]\n    sources:\n      - model: a\n"
            "        layer_range: [0, 2]\n",
            "slices\\[0\\].base_model: model must be a path",
        ),
        (_TIES + _ONE + "    parameters:\n      weight: 1" + "0" * 4400 + "\n", "a value YAML cannot read"),
    ],
    ids=["method-list", "dtype-list", "out-dtype-mapping", "slice-base-list", "huge-integer"],
)
def test_values_of_the_wrong_yaml_type_are_config_errors(text, words):
    """A list or mapping where a config wants a name (looked up in a dict before its type was
    checked: TypeError), a slice's base model that is not a string, an integer past Python's digit
    limit (a ValueError PyYAML lets through): tracebacks until a review found them (2026-12-02)."""
    with pytest.raises(ConfigError, match=words):
        parse_config(text)
