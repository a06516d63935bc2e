"""mergekit configs end to end: `mergedb plan --config`, `Catalog.plan_from_config`, execution, and
`show-plan --format mergekit`, on a synthetic Llama-layout family.

The expected outputs are mergekit's formulas written here on whole tensors in float64 (task
arithmetic: θ₀ + λ_t·Σ_k w_kt·(θ_k − θ₀); SLERP: mergekit 0.1.5's `slerp` of the flattened tensors),
with every per-tensor value computed by hand from mergekit's documented rules: a gradient is
interpolated over t = layer/(L − 1) (t = 0 outside the layers), the first matching filter wins.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.configs import bind_models, parse_config

runner = CliRunner(env={"COLUMNS": "250"})
LAYERS = synth.SIZES["tiny"].layers  # 2

TA = """
merge_method: task_arithmetic
base_model: base
models:
  - model: expert_00
    parameters:
      weight: [0.2, 0.8]
  - model: expert_01
    parameters:
      weight:
        - filter: mlp
          value: 0.5
        - filter: lm_head
          value: -0.25
        - value: 0.3
  - model: family/expert_02
    parameters: {weight: 0.25}
parameters:
  lambda: [1.0, 0.6]
out_dtype: float32
"""

SLERP = f"""
slices:
  - sources:
      - model: base
        layer_range: [0, {LAYERS}]
      - model: expert_01
        layer_range: [0, {LAYERS}]
merge_method: slerp
base_model: base
parameters:
  t:
    - filter: self_attn
      value: [0.1, 0.9]
    - filter: mlp
      value: [0.7, 0.3]
    - value: 0.5
dtype: float32
"""


def t_of(name: str) -> float:
    return int(name.split(".")[2]) / (LAYERS - 1) if name.startswith("model.layers.") else 0.0


def ta_values(name: str) -> tuple[list[float], float]:
    """Weights of expert_00..02 and λ on tensor `name`, by mergekit's rules for TA above."""
    t = t_of(name)
    w1 = 0.5 if "mlp" in name else -0.25 if "lm_head" in name else 0.3
    return [float(np.interp(t, [0, 1], [0.2, 0.8])), w1, 0.25], float(np.interp(t, [0, 1], [1.0, 0.6]))


def slerp_t(name: str) -> float:
    t = t_of(name)
    if "self_attn" in name:
        return float(np.interp(t, [0, 1], [0.1, 0.9]))
    if "mlp" in name:
        return float(np.interp(t, [0, 1], [0.7, 0.3]))
    return 0.5


def mergekit_slerp(t: float, v0: np.ndarray, v1: np.ndarray) -> np.ndarray:
    """mergekit 0.1.5 merge_methods/slerp.py `slerp`, in float64 on the flattened tensors."""
    a, b = v0.ravel(), v1.ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    a = a / na if na > 1e-8 else a
    b = b / nb if nb > 1e-8 else b
    dot = float(np.clip(np.sum(a * b), -1.0, 1.0))
    if abs(dot) > 0.9995:
        return (1 - t) * v0 + t * v1
    theta = np.arccos(dot)
    s0, s1 = np.sin(theta - theta * t) / np.sin(theta), np.sin(theta * t) / np.sin(theta)
    return s0 * v0 + s1 * v1


def load(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def as64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("mkcli")
    synth.make_family(root / "family", experts=3, size="tiny", seed=11)
    db = root / "c.duckdb"
    res = runner.invoke(app, ["register", str(root / "family"), "--base-model", "base", "-c", str(db), "-q"])
    assert res.exit_code == 0, res.output
    models = {n: load(root / "family" / n) for n in ("base", "expert_00", "expert_01", "expert_02")}
    return root, db, models


def _mergeable(models: dict) -> list[str]:
    return [n for n, t in models["base"].items() if t.is_floating_point()]


def _plans(db: Path) -> int:
    return Catalog(db).sql("SELECT count(*) FROM plans").column(0)[0].as_py()


def test_cli_plans_a_config_with_gradients_and_filters_as_mergekit_computes_it(family, tmp_path, monkeypatch):
    root, db, models = family
    monkeypatch.chdir(root)  # mergekit reads relative model paths from the working directory
    (tmp_path / "merge.yml").write_text(TA)
    res = runner.invoke(app, ["plan", "--config", str(tmp_path / "merge.yml"), "--name", "ta", "-c", str(db)])
    assert res.exit_code == 0, res.output
    # the plan does not store the config's out_dtype: plan prints the execute command that writes it
    nxt = next(line for line in res.output.splitlines() if line.startswith("output dtype:"))
    assert "asks for fp32 (the base is bf16)" in nxt
    cmd = shlex.split(nxt.split("next: ", 1)[1].replace("DIR", str(tmp_path / "out")))
    assert cmd[:2] == ["mergedb", "execute"] and cmd[-2:] == ["--dtype", "fp32"]
    res = runner.invoke(app, [*cmd[1:], "-q"])
    assert res.exit_code == 0, res.output
    got = load(tmp_path / "out")
    base = models["base"]
    for name, b in base.items():
        if not b.is_floating_point():
            assert torch.equal(got[name], b), name  # the non-float buffer is the base's
            continue
        w, lam = ta_values(name)
        ref = as64(b) + lam * sum(wk * (as64(models[f"expert_{k:02d}"][name]) - as64(b)) for k, wk in enumerate(w))
        assert got[name].dtype == torch.float32, name
        np.testing.assert_allclose(as64(got[name]), ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max(), err_msg=name)

    # written back as a mergekit config, it evaluates to the same per-tensor values
    res = runner.invoke(app, ["show-plan", "ta", "--format", "mergekit", "-c", str(db)])
    assert res.exit_code == 0, res.output
    back = bind_models(parse_config(res.output), Catalog(db).checkpoints()).resolve(list(base))
    assert back.method == "task_arithmetic" and back.experts == ("expert_00", "expert_01", "expert_02")
    for name in _mergeable(models):
        w, lam = ta_values(name)
        assert [back.value(k, name, "weight") for k in range(3)] == pytest.approx(w, abs=1e-12), name
        assert back.value(0, name, "lambda") == pytest.approx(lam, abs=1e-12), name


def test_library_plans_slerp_from_a_slices_config(family, tmp_path, monkeypatch):
    root, db, models = family
    monkeypatch.chdir(root)
    cat = Catalog(db)
    cfg = parse_config(SLERP)
    plan = cat.plan_from_config(cfg, name="sl")
    assert plan.method == "slerp" and [e.name for e in plan.experts] == ["expert_01"]
    cat.execute(plan.plan_id, tmp_path / "out", dtype=cfg.output_dtype)
    got = load(tmp_path / "out")
    base, other = models["base"], models["expert_01"]
    for name in _mergeable(models):
        ref = mergekit_slerp(slerp_t(name), as64(base[name]), as64(other[name]))
        np.testing.assert_allclose(as64(got[name]), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=name)
    text = runner.invoke(app, ["show-plan", "sl", "-f", "mergekit", "-c", str(db)]).output
    back = bind_models(parse_config(text), cat.checkpoints()).resolve(list(base))
    for name in _mergeable(models):
        assert back.value(0, name, "t") == pytest.approx(slerp_t(name), abs=1e-12), name


def test_config_from_a_path_at_a_budget(family, tmp_path, monkeypatch):
    root, db, _ = family
    monkeypatch.chdir(root)
    (tmp_path / "m.yml").write_text(TA)
    plan = Catalog(db).plan_from_config(tmp_path / "m.yml", budget="40%", name="ta40")
    assert plan.selected_bytes <= plan.budget_bytes < plan.full_bytes and plan.name == "ta40"


def test_a_plan_over_a_path_mergekit_would_misread_is_not_exported(tmp_path):
    """A registered path holding '@' was written back as it is: mergekit reads PATH@REVISION (and
    MODEL+LORA) in any name, so the "equivalent" config named another model (mergekit review)."""
    root = tmp_path / "models@v2"
    synth.make_family(root / "family", experts=2, size="tiny", seed=3)
    db = str(tmp_path / "c.duckdb")
    assert runner.invoke(app, ["register", str(root / "family"), "--base-model", "base", "-c", db, "-q"]).exit_code == 0
    assert runner.invoke(app, ["plan", "--base", "base", "--all", "-m", "task_arithmetic", "-c", db]).exit_code == 0
    res = runner.invoke(app, ["show-plan", "1", "--format", "mergekit", "-c", db])
    assert res.exit_code == 1 and "'@' or '+' mergekit reads as a revision" in res.output, res.output
    assert "models@v2" in res.output and "merge_method" not in res.output


def test_a_config_need_not_give_values_for_integer_buffers(family, tmp_path, monkeypatch):
    """Filters covering every float tensor were refused for the int64 buffer position_ids ("no t
    for tensor 'model.rotary_emb.position_ids'"), which mergekit never plans and mergedb copies from
    the base (mergekit review). The buffer comes out as the base's, the filtered tensors merged."""
    root, db, models = family
    monkeypatch.chdir(root)
    ints = [n for n, t in models["base"].items() if not t.is_floating_point()]
    assert ints  # the family has one, or this test tests nothing
    (tmp_path / "w.yml").write_text(
        "merge_method: task_arithmetic\nbase_model: family/base\nmodels:\n"
        "  - model: family/expert_00\n    parameters:\n      weight: [{filter: weight, value: 0.5}]\n"
    )
    res = runner.invoke(app, ["plan", "--config", str(tmp_path / "w.yml"), "-c", str(db)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    assert runner.invoke(app, ["execute", str(_plans(db)), "--out", str(out), "-c", str(db), "-q"]).exit_code == 0
    got = load(out)
    for n in ints:
        assert torch.equal(got[n], models["base"][n]), n
    n = "model.layers.0.mlp.up_proj.weight"
    want = as64(models["base"][n]) + 0.5 * (as64(models["expert_00"][n]) - as64(models["base"][n]))
    np.testing.assert_allclose(as64(got[n]), want, rtol=0, atol=np.abs(want).max() * 2**-7)


@pytest.mark.parametrize(
    "args,config,needle",
    [
        (["--method", "ties"], TA, "--method cannot be combined with --config"),
        (["--weights", "1,2,3"], TA, "--weights cannot be combined with --config"),
        (["--all"], TA, "--all cannot be combined with --config"),
        ([], TA.replace("task_arithmetic", "passthrough"), "passthrough"),
        ([], TA.replace("family/expert_02", "expert_09"), "run: mergedb register expert_09 --base-model base"),
        ([], TA + "modules: {}\n", "modules:"),
    ],
)
def test_refusals_are_one_line_and_change_nothing(family, tmp_path, monkeypatch, args, config, needle):
    root, db, _ = family
    monkeypatch.chdir(root)
    before = _plans(db)
    (tmp_path / "bad.yml").write_text(config)
    res = runner.invoke(app, ["plan", "--config", str(tmp_path / "bad.yml"), *args, "-c", str(db)])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and needle in lines[0], res.output
    assert _plans(db) == before


def test_plan_without_config_still_needs_base_and_method(family):
    _, db, _ = family
    res = runner.invoke(app, ["plan", "--all", "--method", "ties", "-c", str(db)])
    assert res.exit_code == 1 and "give --base and --method" in res.output


def test_show_plan_unknown_format_names_mergekit(family):
    _, db, _ = family
    res = runner.invoke(app, ["show-plan", "1", "-f", "xml", "-c", str(db)])
    assert res.exit_code == 1 and "mergekit" in res.output


TIES = """
merge_method: ties
base_model: base
models:
  - model: expert_00
    parameters:
      weight: 1.0
      density: [1, 0.7, 0.1]
  - model: expert_02
    parameters:
      weight: [{filter: mlp, value: 0.5}, {value: 0.2}]
      density: 0.5
parameters: {normalize: true}
"""


def test_ties_with_density_gradient_exports_to_the_same_values(family, tmp_path):
    _, db, models = family
    cat = Catalog(db)
    cat.plan_from_config(TIES, budget="60%", name="ties-grad")
    text = runner.invoke(app, ["show-plan", "ties-grad", "--format", "mergekit", "-c", str(db)]).output
    back = bind_models(parse_config(text), cat.checkpoints()).resolve(list(models["base"]))
    assert back.method == "ties" and back.params["normalize"] is True
    for name in _mergeable(models):
        d0 = float(np.interp(t_of(name), [0, 0.5, 1], [1, 0.7, 0.1]))
        assert back.value(0, name, "density") == pytest.approx(d0, abs=1e-12), name
        assert back.value(1, name, "density") == 0.5, name
        assert back.value(0, name, "weight") == 1.0, name
        assert back.value(1, name, "weight") == (0.5 if "mlp" in name else 0.2), name


def test_slerp_plan_with_t_only_per_tensor_exports_with_a_scalar_fallback(family):
    import pyarrow as pa

    from mergedb.planner import PlanRequest

    _, db, models = family
    names = _mergeable(models)
    ts = {n: round(0.1 + 0.8 * i / (len(names) - 1), 6) for i, n in enumerate(names)}
    rows = pa.table(
        {
            "position": pa.array([0] * len(names), pa.int32()),
            "tensor": names,
            "param": ["t"] * len(names),
            "value": [ts[n] for n in names],
        }
    )
    cat = Catalog(db)
    cat.plan(PlanRequest("base", ("expert_00",), "slerp", params={}, name="sl-rows", tensor_params=rows))
    text = runner.invoke(app, ["show-plan", "sl-rows", "-f", "mergekit", "-c", str(db)]).output
    back = bind_models(parse_config(text), cat.checkpoints()).resolve(list(models["base"]))
    assert [back.value(0, n, "t") for n in names] == pytest.approx([ts[n] for n in names], abs=1e-12)
