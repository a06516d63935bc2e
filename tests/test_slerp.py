"""SLERP against an independent numpy implementation of mergekit 0.1.5's formula on whole tensors:
scalar and per-tensor t, both branches (lerp above the dot threshold, the angle below), budgets."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.errors import PlanError
from mergedb.planner import PlanRequest
from tests.reference import load_model


def mergekit_slerp(t: float, v0: np.ndarray, v1: np.ndarray) -> tuple[np.ndarray, float]:
    """mergekit.merge_methods.slerp.slerp on one whole tensor, in float64: normalise both (a norm
    ≤ 1e-8 counts as 1), cos = clamp(⟨a, b⟩, −1, 1); |cos| > 0.9995: (1−t)·v0 + t·v1; else
    θ = arccos(cos), sin((1−t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1. Returns (result, cos)."""
    a, b = v0.astype(np.float64).reshape(-1), v1.astype(np.float64).reshape(-1)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    na, nb = (na if na > 1e-8 else 1.0), (nb if nb > 1e-8 else 1.0)
    cos = float(np.clip(np.dot(a / na, b / nb), -1.0, 1.0))
    if abs(cos) > 0.9995:
        return ((1 - t) * a + t * b).reshape(v0.shape), cos
    theta = np.arccos(cos)
    s0, s1 = np.sin((1 - t) * theta) / np.sin(theta), np.sin(t * theta) / np.sin(theta)
    return (s0 * a + s1 * b).reshape(v0.shape), cos


def rel(got: np.ndarray, want: np.ndarray) -> float:
    den = np.linalg.norm(want.astype(np.float64))
    return float(np.linalg.norm(got.astype(np.float64) - want) / (den if den > 0 else 1.0))


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    """An fp32 family whose single expert moves every third tensor far from the base (an angle
    well below the dot threshold), flips one tensor's sign (antipodal: lerp), keeps the rest."""
    root = tmp_path_factory.mktemp("slerp")
    fam = synth.make_family(root / "fam", experts=1, size="tiny", dtype="fp32", seed=4)
    path = fam / "expert_00" / "model.safetensors"
    base = load_file(str(fam / "base" / "model.safetensors"))
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(11)
    floats = sorted(n for n, t in base.items() if t.is_floating_point())
    for i, name in enumerate(floats):
        b = base[name]
        if i % 3 == 0:
            rms = float(b.pow(2).mean().sqrt()) or 1.0
            tensors[name] = b + 2.0 * rms * torch.randn(b.shape, generator=gen)
        elif i == 1:
            tensors[name] = -b
    save_file(tensors, str(path), metadata={"format": "pt"})
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    return cat, {n: load_model(fam / n) for n in ("base", "expert_00")}, floats


def t_rows(t_of: dict[str, float]) -> pa.Table:
    return pa.table(
        {
            "position": pa.array([0] * len(t_of), pa.int32()),
            "tensor": list(t_of),
            "param": ["t"] * len(t_of),
            "value": pa.array(list(t_of.values()), pa.float64()),
        }
    )


@pytest.mark.parametrize("per_tensor", [False, True])
def test_slerp_full_equals_mergekit_formula(far, tmp_path, per_tensor):
    cat, models, floats = far
    t_of = {n: [0.0, 0.3, 0.7, 1.0, 1.25][i % 5] for i, n in enumerate(floats) if i % 4 != 3} if per_tensor else {}
    req = PlanRequest("base", ("expert_00",), "slerp", "all", params={"t": 0.4}, tensor_params=t_rows(t_of))
    plan = cat.plan(req)
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    got = load_model(tmp_path / "out")
    branches = set()
    for name in floats:
        want, cos = mergekit_slerp(t_of.get(name, 0.4), models["base"][name], models["expert_00"][name])
        branches.add(abs(cos) > 0.9995)
        assert rel(got[name], want) <= 1e-6, (name, cos, rel(got[name], want))
    assert branches == {True, False}  # both the lerp and the angle branch were checked
    rep = executor.replay(tmp_path / "out" / "mergedb_manifest.json", tmp_path / "again")  # no catalog needed
    assert load_model(tmp_path / "again").keys() == got.keys()
    assert all(np.array_equal(load_model(tmp_path / "again")[n], got[n]) for n in floats) and rep.manifest


def test_slerp_on_every_family_dtype(family, tmp_path):
    """The synthetic experts (small deltas), bf16 / fp16 sharded / fp32 inputs, written as fp32."""
    kind, folder, cat = family
    plan = cat.plan(PlanRequest("base", ("expert_01",), "slerp", "all", params={"t": 0.65}))
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out", dtype="fp32")
    got, base, ex = load_model(tmp_path / "out"), load_model(folder / "base"), load_model(folder / "expert_01")
    for name, b in base.items():
        if b.dtype.kind != "f":
            assert np.array_equal(got[name], b)
            continue
        want, _ = mergekit_slerp(0.65, b, ex[name])
        assert rel(got[name], want) <= 1e-6, name


def test_budgeted_slerp_omits_blocks_as_zero_delta_and_bounds_it(far, tmp_path):
    """An omitted block counts as Δ = 0 with the tensor's s0, s1 unchanged: the output is
    (s0 + s1)·θ₀ + s1·Δ_selected, and ‖θ_B − θ_F‖ ≤ sqrt(Σ_b (|s1|·‖Δ_b‖)²) over omitted blocks."""
    cat, models, floats = far
    plan = cat.plan(PlanRequest("base", ("expert_00",), "slerp", "40%", params={"t": 0.4}))
    full = cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all", params={"t": 0.4}))
    res = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "b")
    executor.execute(cat.execution_plan(full.plan_id), tmp_path / "f")
    assert res.expert_bytes == plan.selected_bytes <= plan.budget_bytes < full.selected_bytes
    blocks = cat.sql(
        "SELECT ft.name, bl.row_start, bl.row_end, m.selected FROM plan_mask m "
        "JOIN family_tensors ft ON ft.base_id = 1 AND ft.tensor_idx = m.tensor_idx "
        "JOIN blocks bl ON bl.base_id = 1 AND bl.tensor_idx = m.tensor_idx AND bl.block_idx = m.block_idx "
        "WHERE m.plan_id = ?",
        [plan.plan_id],
    ).to_pylist()
    got, f = load_model(tmp_path / "b"), load_model(tmp_path / "f")
    omitted_sq, diff_sq = 0.0, 0.0
    for name in floats:
        b, e = models["base"][name].astype(np.float64), models["expert_00"][name].astype(np.float64)
        rows = b.reshape(b.shape[0] if b.ndim > 1 else 1, -1)
        delta = e.reshape(rows.shape) - rows
        a, c = rows.reshape(-1), e.reshape(-1)
        cos = np.clip(np.dot(a, c) / (np.linalg.norm(a) * np.linalg.norm(c)), -1, 1)
        if abs(cos) > 0.9995:
            scale, s1 = 1.0, 0.4
        else:
            th = np.arccos(cos)
            s0, s1 = np.sin(0.6 * th) / np.sin(th), np.sin(0.4 * th) / np.sin(th)
            scale = s0 + s1
        kept = np.zeros_like(delta)
        for r in blocks:
            if r["name"] == name and r["selected"]:
                kept[r["row_start"] : r["row_end"]] = delta[r["row_start"] : r["row_end"]]
            elif r["name"] == name:
                omitted_sq += (s1 * np.linalg.norm(delta[r["row_start"] : r["row_end"]])) ** 2
        want = (scale * rows + s1 * kept).reshape(b.shape)
        assert rel(got[name], want) <= 1e-6, name
        diff_sq += float(np.sum((got[name].astype(np.float64) - f[name]) ** 2))
    assert plan.bound_blockwise == pytest.approx(np.sqrt(omitted_sq), rel=1e-6)
    assert 0 < np.sqrt(diff_sq) <= plan.bound_rounded


def test_slerp_refusals(far, tmp_path):
    cat, models, floats = far
    with pytest.raises(PlanError, match="slerp needs t for every tensor, and tensor"):
        cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all"))
    with pytest.raises(PlanError, match="slerp needs t for every tensor"):
        cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all", tensor_params=t_rows({floats[0]: 0.5})))
    with pytest.raises(PlanError, match="slerp takes no weights"):
        cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all", weights=(0.5,), params={"t": 0.5}))
    with pytest.raises(PlanError, match="method slerp has no parameter 'lambda'"):
        cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all", params={"t": 0.5, "lambda": 2.0}))
    with pytest.raises(PlanError, match="t must be a number"):
        cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all", params={"t": "half"}))


def test_slerp_needs_two_models_and_a_catalog_with_base_dots(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=2)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    with pytest.raises(PlanError, match="exactly one expert, got 2 experts"):
        cat.plan(PlanRequest("base", None, "slerp", "all", params={"t": 0.5}))
    con = duckdb.connect(str(tmp_path / "c.duckdb"))  # as a catalog registered before schema 006 holds it
    con.execute("UPDATE expert_blocks SET base_dot = NULL")
    con.close()
    with pytest.raises(PlanError, match=r"lacks for 'expert_00' .* register the family again into a new catalog"):
        cat.plan(PlanRequest("base", ("expert_00",), "slerp", "all", params={"t": 0.5}))
    assert cat.sql("SELECT count(*) AS n FROM plans").to_pylist() == [{"n": 0}]


def test_slerp_from_the_cli_with_t(far, tmp_path):
    """`mergedb plan -m slerp --t 0.3` plans SLERP (its output equals mergekit's formula); without
    --t it is refused with the reason, and --t on another method is refused."""
    from typer.testing import CliRunner

    from mergedb.cli import app

    cat, models, floats = far
    run = CliRunner().invoke
    args = ["plan", "--base", "base", "--experts", "expert_00", "-m", "slerp", "-c", str(cat.path)]
    r = run(app, [*args, "--t", "0.3", "--name", "cli-slerp"])
    assert r.exit_code == 0, r.output
    r = run(app, ["execute", "cli-slerp", "--out", str(tmp_path / "out"), "-c", str(cat.path), "-q"])
    assert r.exit_code == 0, r.output
    got = load_model(tmp_path / "out")
    for name in floats:
        assert rel(got[name], mergekit_slerp(0.3, models["base"][name], models["expert_00"][name])[0]) <= 1e-6, name
    r = run(app, args)
    assert r.exit_code != 0 and "slerp needs t for every tensor" in r.output
    r = run(app, [*args[:-4], "-m", "ties", "--t", "0.3", "-c", str(cat.path)])
    assert r.exit_code != 0 and "has no parameter 't'" in r.output
