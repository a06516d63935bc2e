"""Per-(expert, tensor) parameters against independent whole-tensor references: merges, bounds,
refusals, hashes and replay."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.errors import MergeDBError, PlanError
from mergedb.manifest import content_hash
from mergedb.planner import PlanRequest
from tests.conftest import FAMILIES
from tests.reference import cast_like, drop_key, kth_largest, load_model, ref_merge, threefry_draws

EXPERTS = ["expert_00", "expert_01", "expert_02"]
WEIGHTS = (1.0, 0.6, 0.3)
GRID_DENSITIES = (0.1, 0.2, 0.3, 0.45)  # on the exact grid: thresholds are exact k-th largest values


def overrides(method: str, tensors: list[str], k: int) -> list[tuple[int, str, str, float]]:
    """(position, tensor, param, value): every other tensor gets per-expert weights (and densities
    where the method has them, different per expert); every third a λ of its own; the rest keep the
    plan-level values."""
    rows = []
    for ti, name in enumerate(tensors):
        if ti % 2 == 0:
            for p in range(k):
                rows.append((p, name, "weight", round(0.2 + 0.35 * ((p + ti) % 4), 3)))
                if method in ("ties", "dare_ties"):
                    d = GRID_DENSITIES[(p + ti) % 4] if method == "ties" else 0.3 + 0.2 * ((p + ti) % 3)
                    rows.append((p, name, "density", d))
        if ti % 3 == 0 and method != "linear":
            for p in range(k):  # one λ for the tensor, given at every position
                rows.append((p, name, "lambda", 0.5 + 0.1 * (ti % 5)))
    return rows


def as_table(rows: list[tuple[int, str, str, float]]) -> pa.Table:
    return pa.table(
        {
            "position": pa.array([r[0] for r in rows], pa.int32()),
            "tensor": pa.array([r[1] for r in rows], pa.string()),
            "param": pa.array([r[2] for r in rows], pa.string()),
            "value": pa.array([r[3] for r in rows], pa.float64()),
        }
    )


def effective(rows, method, params, tensor, k):
    """The request's values for one tensor: plan-level ones, then that tensor's override rows."""
    w = list(WEIGHTS)
    d = [params.get("density")] * k
    lam = params.get("lambda", 1.0)
    for p, t, name, v in rows:
        if t != tensor:
            continue
        if name == "weight":
            w[p] = v
        elif name == "density":
            d[p] = v
        elif name == "lambda":
            lam = v
    return w, d, lam


def ref_tensor(method, params, w, dens, lam, base, experts, names, tensor, seed):
    """Textbook merge of one whole tensor with per-expert weights and densities (torch float32,
    experts in plan order): linear θ0 + Σ (w_k/Σw) Δ_k; task arithmetic θ0 + λ Σ w_k Δ_k; TIES trims
    Δ_k to |Δ| ≥ its own k-th largest (k = max(1, int(d_k·n))), DARE keeps u_i < d_k and rescales
    by 1/d_k; both then elect sign(Σ w_k Δ'_k) (+1 on zero) and average agreeing w_k Δ'_k by Σ
    agreeing w_k, times λ."""
    b = torch.from_numpy(base.astype(np.float32).reshape(-1))
    deltas = []
    for i, e in enumerate(experts):
        d = torch.from_numpy(e.astype(np.float32).reshape(-1)) - b
        if method == "ties":
            t = float(kth_largest(d.abs().numpy(), dens[i]))
            d = torch.where(d.abs() >= t, d, torch.zeros_like(d))
        elif method == "dare_ties":
            u = torch.from_numpy(threefry_draws(drop_key(seed, names[i], tensor), d.numel()))
            d = torch.where(u < dens[i], d / dens[i], torch.zeros_like(d))
        deltas.append(d)
    if method in ("linear", "task_arithmetic"):
        coefs = [x / sum(w) for x in w] if method == "linear" else [lam * x for x in w]
        total = torch.zeros_like(b)
        for c, d in zip(coefs, deltas):
            total += torch.tensor(c, dtype=torch.float32) * d
        return (b + total).numpy().reshape(base.shape)
    wt = [torch.tensor(x, dtype=torch.float32) for x in w]
    total = torch.zeros_like(b)
    for wk, d in zip(wt, deltas):
        total += wk * d
    up = total >= 0
    num, den = torch.zeros_like(b), torch.zeros_like(b)
    for wk, d in zip(wt, deltas):
        agree = torch.where(up, d > 0, d < 0)
        num += torch.where(agree, wk * d, torch.zeros_like(d))
        den += torch.where(agree, wk.expand_as(d), torch.zeros_like(d))
    num = num / torch.where(den == 0, torch.ones_like(den), den)  # mergekit: divisor[divisor == 0] = 1
    return (b + torch.tensor(lam, dtype=torch.float32) * num).numpy().reshape(base.shape)


@pytest.fixture(scope="module")
def loaded(family):
    kind, folder, cat = family
    return {n: load_model(folder / n) for n in ["base", *EXPERTS]}


CASES = [
    ("linear", {}),
    ("task_arithmetic", {"lambda": 0.7}),
    ("ties", {"density": 0.2, "lambda": 0.9}),
    ("dare_ties", {"density": 0.5}),
]


@pytest.mark.parametrize("method,params", CASES)
def test_per_tensor_full_budget_equals_reference(family, loaded, tmp_path, method, params):
    kind, folder, cat = family
    floats = [n for n, a in loaded["base"].items() if a.dtype.kind == "f"]
    rows = overrides(method, sorted(floats), len(EXPERTS))
    req = PlanRequest("base", tuple(EXPERTS), method, "all", WEIGHTS, params, seed=5, tensor_params=as_table(rows))
    plan = cat.plan(req)
    res = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    assert res.expert_bytes == plan.selected_bytes <= plan.budget_bytes
    got = load_model(tmp_path / "out")
    differs = 0
    for name in floats:
        w, dens, lam = effective(rows, method, params, name, len(EXPERTS))
        experts = [loaded[e][name] for e in EXPERTS]
        want = cast_like(
            ref_tensor(method, params, w, dens, lam, loaded["base"][name], experts, EXPERTS, name, 5), FAMILIES[kind][0]
        )
        assert np.array_equal(got[name], want), (method, name, np.abs(got[name] - want).max())
        # the overrides matter: the plan-level merge of this tensor is another tensor
        w0, d0, l0 = list(WEIGHTS), [params.get("density")] * 3, params.get("lambda", 1.0)
        plain = cast_like(
            ref_tensor(method, params, w0, d0, l0, loaded["base"][name], experts, EXPERTS, name, 5), FAMILIES[kind][0]
        )
        differs += not np.array_equal(plain, want)
    assert differs >= len(floats) // 3
    # replay from the manifest alone (it carries the per-tensor values) gives the same bytes
    rep = executor.replay(tmp_path / "out" / "mergedb_manifest.json", tmp_path / "replayed")
    assert rep.manifest["tensor_hashes"] == res.manifest["tensor_hashes"]


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    fam = synth.make_family(root / "fam", experts=4, size="tiny", dtype="fp32", seed=9)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    names = ["expert_00", "expert_01", "expert_02", "expert_03"]
    models = {n: load_model(fam / n) for n in ["base", *names]}
    return cat, models, names


@pytest.mark.parametrize("method,params", [("linear", {}), ("task_arithmetic", {"lambda": 0.8})])
@pytest.mark.parametrize("budget", ["10%", "50%", "90%"])
def test_bounds_with_per_tensor_coefficients(registered, tmp_path, method, params, budget):
    """The reported bounds equal their definition computed from whole tensors with coefficients
    derived here, and bound the actual error of the written fp32 output."""
    cat, models, names = registered
    weights = (1.0, 0.5, -0.7, 2.0)
    floats = sorted(n for n, a in models["base"].items() if a.dtype.kind == "f")
    rows = [(p, t, "weight", 0.25 + 0.5 * ((p * 3 + i) % 5)) for i, t in enumerate(floats[::2]) for p in range(4)]
    rows += [(0, t, "lambda", 1.5) for t in floats[1::3]] if method == "task_arithmetic" else []
    p = cat.plan(PlanRequest("base", None, method, budget, weights, params, tensor_params=as_table(rows)))
    blocks = cat.sql(
        "SELECT pe.position, ft.name, bl.row_start, bl.row_end, m.selected FROM plan_mask m "
        "JOIN plan_experts pe ON pe.plan_id = m.plan_id AND pe.checkpoint_id = m.checkpoint_id "
        "JOIN family_tensors ft ON ft.base_id = 1 AND ft.tensor_idx = m.tensor_idx "
        "JOIN blocks bl ON bl.base_id = 1 AND bl.tensor_idx = m.tensor_idx AND bl.block_idx = m.block_idx "
        "WHERE m.plan_id = ?",
        [p.plan_id],
    ).to_pylist()
    coef = {}
    for t in floats:
        w = list(weights)
        lam = params.get("lambda", 1.0)
        for pos, tt, name, v in rows:
            if tt == t and name == "weight":
                w[pos] = v
            if tt == t and name == "lambda":
                lam = v
        coef[t] = [x / sum(w) for x in w] if method == "linear" else [lam * x for x in w]
    err, per_block = {}, {}
    total_sum = 0.0
    for r in blocks:
        if r["selected"]:
            continue
        b = models["base"][r["name"]]
        d = (models[names[r["position"]]][r["name"]].astype(np.float64) - b).reshape(
            b.shape[0] if b.ndim > 1 else 1, -1
        )
        c = coef[r["name"]][r["position"]]
        part = d[r["row_start"] : r["row_end"]]
        acc = err.setdefault(r["name"], np.zeros_like(d))
        acc[r["row_start"] : r["row_end"]] += c * part
        v = abs(c) * np.sqrt((part**2).sum())
        key = (r["name"], r["row_start"])
        per_block[key] = per_block.get(key, 0.0) + v
        total_sum += v
    blockwise = np.sqrt(sum(v * v for v in per_block.values()))
    assert p.bound_sum == pytest.approx(total_sum, rel=1e-9, abs=1e-12)
    assert p.bound_blockwise == pytest.approx(blockwise, rel=1e-9, abs=1e-12)
    full = cat.plan(PlanRequest("base", None, method, "all", weights, params, tensor_params=as_table(rows)))
    executor.execute(cat.execution_plan(p.plan_id), tmp_path / "b")
    executor.execute(cat.execution_plan(full.plan_id), tmp_path / "f")
    a, f = load_model(tmp_path / "b"), load_model(tmp_path / "f")
    written = np.sqrt(sum(np.sum((a[n].astype(np.float64) - f[n]) ** 2) for n in floats))
    exact = np.sqrt(sum(float((e**2).sum()) for e in err.values()))
    assert exact <= p.bound_blockwise * (1 + 1e-9)
    assert written <= p.bound_rounded * (1 + 1e-9)
    assert (written > 0) == (exact > 0)


def _plans(cat):
    return cat.sql("SELECT count(*) AS n FROM plans").to_pylist()[0]["n"]


T0 = "model.layers.0.mlp.up_proj.weight"
BAD = [
    ("ties", [(0, "nope.weight", "weight", 1.0)], r"no tensor 'nope.weight'"),
    ("ties", [(5, T0, "weight", 1.0)], r"position 5 is not an expert of this plan \(0 to 2\)"),
    ("ties", [(0, T0, "gamma", 0.1)], r"method ties takes no per-tensor 'gamma'"),
    ("linear", [(0, T0, "t", 0.5)], r"method linear takes no per-tensor 't'"),
    ("linear", [(0, T0, "warp", 0.5)], r"takes no per-tensor 'warp'"),
    ("model_stock", [(0, T0, "weight", 2.0)], r"method model_stock takes no per-tensor 'weight'"),
    ("ties", [(0, T0, "density", float("nan"))], r"value nan is not a finite number"),
    ("ties", [(0, T0, "density", 0.3), (0, T0, "density", 0.4)], r"given twice"),
    ("ties", [(0, T0, "lambda", 0.3), (1, T0, "lambda", 0.4)], r"lambda is one value per tensor.*0.3 and 0.4"),
    ("ties", [(1, T0, "density", 1.5)], rf"'expert_01' in tensor '{T0}': density must be in \(0, 1\]"),
    ("dare_ties", [(2, T0, "density", 0.0)], r"'expert_02' in tensor .*density must be in \(0, 1\]"),
    ("task_arithmetic", [(0, T0, "weight", 1e7)], r"weight outside ±1e\+06"),
    # accepted per tensor where refused per plan: float32 made w·Δ 0 but counted w, so TIES kept the base (review)
    ("ties", [(1, T0, "weight", 1e-41)], rf"'expert_01' in tensor '{T0}': a weight below float32's normal range"),
    # sign election sorts experts by the sign of Δ, not of w·Δ: a negative weight dropped the delta
    ("ties", [(1, T0, "weight", -0.5)], rf"'expert_01' in tensor '{T0}': a negative weight: ties elects"),
    ("breadcrumbs_ties", [(0, T0, "weight", -1.0)], r"a negative weight: breadcrumbs_ties elects each element"),
    (
        "linear",
        [(0, T0, "weight", -0.4)],
        rf"tensor '{T0}': linear with normalize needs weights that do not sum to zero",
    ),
]


@pytest.mark.parametrize("method,rows,match", BAD)
def test_bad_rows_refused_and_nothing_stored(family, method, rows, match):
    kind, folder, cat = family
    before = _plans(cat)
    weights = (0.5, 0.2, 0.2) if method == "linear" else None
    with pytest.raises(PlanError, match=match):
        cat.plan(PlanRequest("base", tuple(EXPERTS), method, "all", weights, tensor_params=as_table(rows)))
    assert _plans(cat) == before


def test_bad_tables_refused(family):
    kind, folder, cat = family
    good = as_table([(0, T0, "weight", 1.0)])
    with pytest.raises(PlanError, match=r"the columns \['position', 'tensor', 'param', 'value'\]"):
        cat.plan(PlanRequest("base", None, "linear", tensor_params=good.drop(["value"])))
    floats = good.set_column(0, "position", pa.array([0.5], pa.float64()))
    with pytest.raises(PlanError, match="column 'position' is double, not int32"):
        cat.plan(PlanRequest("base", None, "linear", tensor_params=floats))
    nulls = good.set_column(3, "value", pa.array([None], pa.float64()))
    with pytest.raises(PlanError, match="column 'value' holds nulls"):
        cat.plan(PlanRequest("base", None, "linear", tensor_params=nulls))


def test_hash_follows_the_per_tensor_values(family):
    kind, folder, cat = family

    def plan(rows):
        table = as_table(rows) if rows is not None else None
        return cat.plan(PlanRequest("base", tuple(EXPERTS), "task_arithmetic", "all", tensor_params=table)).plan_hash

    plain = plan(None)
    one = plan([(0, T0, "weight", 2.0)])
    assert plan([(0, T0, "weight", 2.0)]) == one != plain
    assert plan([(0, T0, "weight", 2.5)]) != one
    assert plan([]) == plain  # no rows: the plan-level values everywhere, the plain plan's hash


def test_edited_per_tensor_values_in_a_manifest_are_refused(family, tmp_path):
    """A manifest whose tensor_params were edited and re-hashed consistently is still refused."""
    kind, folder, cat = family
    rows = [(p, T0, "density", 0.3) for p in range(3)]
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), "dare_ties", "all", tensor_params=as_table(rows)))
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    path = tmp_path / "out" / "mergedb_manifest.json"
    doc = json.loads(path.read_text())
    assert doc["tensor_params"] and {r["density"] for r in doc["tensor_params"]} == {0.3, 0.5}
    for field, value, match in [
        ("density", 2.0, r"tensor_params\[0\]: density must be in \(0, 1\]"),
        ("coef", float("inf"), r"tensor_params\[0\]: coef must be a finite number"),
        ("position", 7, r"tensor_params\[0\]: position must be an expert index below 3"),
    ]:
        bad = json.loads(path.read_text())
        bad["tensor_params"][0][field] = value
        bad["content_hash"] = content_hash(bad)
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "mergedb_manifest.json").write_text(json.dumps(bad))
        (tmp_path / "bad" / "mask.parquet").write_bytes((tmp_path / "out" / "mask.parquet").read_bytes())
        with pytest.raises(MergeDBError, match=match):
            executor.replay(tmp_path / "bad" / "mergedb_manifest.json", tmp_path / "replayed")


@pytest.mark.parametrize(
    "method,params,per_tensor",
    [
        (
            "della",
            {"density": 0.6, "epsilon": 0.2},
            [{"density": 0.5, "epsilon": 0.1}, {"density": 0.8, "epsilon": 0.15}],
        ),
        (
            "breadcrumbs",
            {"density": 0.8, "gamma": 0.05},
            [{"density": 0.6, "gamma": 0.1}, {"density": 0.9, "gamma": 0.0}],
        ),
    ],
)
def test_per_tensor_della_and_breadcrumbs_equal_reference(family, loaded, tmp_path, method, params, per_tensor):
    """ε and γ per tensor (one value for every expert of a tensor, so tests/reference.ref_merge,
    given that tensor's parameters, is the reference)."""
    kind, folder, cat = family
    floats = sorted(n for n, a in loaded["base"].items() if a.dtype.kind == "f")
    chosen = {name: per_tensor[i % 2] for i, name in enumerate(floats) if i % 3 != 2}
    rows = [(p, name, k, v) for name, ps in chosen.items() for k, v in ps.items() for p in range(len(EXPERTS))]
    plan = cat.plan(
        PlanRequest("base", tuple(EXPERTS), method, "all", WEIGHTS, params, seed=2, tensor_params=as_table(rows))
    )
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    got = load_model(tmp_path / "out")
    for name in floats:
        p = {**params, **chosen.get(name, {})}
        ex = [loaded[e][name] for e in EXPERTS]
        full = ref_merge(method, p, list(WEIGHTS), loaded["base"][name], ex, seed=2, expert_names=EXPERTS, tensor=name)
        want = cast_like(full, FAMILIES[kind][0])
        assert np.array_equal(got[name], want), (method, name)


@pytest.mark.parametrize("method", ["dare_ties", "task_arithmetic"])
def test_many_experts_several_read_groups_per_block(tmp_path, method):
    """7 experts: three READ_AHEAD groups per block, the next group read while one is folded in,
    each group cut where the DARE density changes; equals the reference bit for bit."""
    fam = synth.make_family(tmp_path / "fam", experts=7, size="tiny", dtype="fp32", seed=5)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    names = [f"expert_{i:02d}" for i in range(7)]
    models = {n: load_model(fam / n) for n in ["base", *names]}
    floats = sorted(n for n, a in models["base"].items() if a.dtype.kind == "f")
    weights = tuple(0.2 + 0.1 * i for i in range(7))
    params = {"density": 0.5} if method == "dare_ties" else {"lambda": 0.6}
    rows = [
        (p, t, "density", (0.3, 0.3, 0.7, 0.5, 0.5, 0.5, 0.9)[(p + i) % 7])
        for i, t in enumerate(floats)
        for p in range(7)
    ]
    rows = (
        rows
        if method == "dare_ties"
        else [(p, t, "weight", 0.1 * ((p + i) % 5) + 0.05) for i, t in enumerate(floats) for p in range(7)]
    )
    plan = cat.plan(
        PlanRequest("base", tuple(names), method, "all", weights, params, seed=1, tensor_params=as_table(rows))
    )
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out", threads=2)
    got = load_model(tmp_path / "out")
    for name in floats:
        w, dens = list(weights), [params.get("density")] * 7
        for p, t, what, v in rows:
            if t == name:
                (w if what == "weight" else dens)[p] = v
        lam = params.get("lambda", 1.0)
        ex = [models[n][name] for n in names]
        want = ref_tensor(method, params, w, dens, lam, models["base"][name], ex, names, name, 1)
        assert np.array_equal(got[name], want), name


def test_linear_weights_may_cancel_without_normalize(family, loaded, tmp_path):
    """Without normalize, linear is Σ w_k Δ_k: weights summing to zero are a valid plan (a difference
    of two experts); only normalize needs a non-zero sum, per tensor too."""
    kind, folder, cat = family
    req = PlanRequest("base", tuple(EXPERTS[:2]), "linear", "all", (1.0, -1.0), params={"normalize": False})
    plan = cat.plan(req)
    out = tmp_path / "diff"
    cat.execute(plan.plan_id, out)
    got = load_model(out)
    base, a, b = (np.asarray(loaded[n][T0], np.float64) for n in ("base", *EXPERTS[:2]))
    want = base + (a - base) - (b - base)  # θ₀ + Δ_a − Δ_b
    np.testing.assert_allclose(np.asarray(got[T0], np.float64), want, rtol=0, atol=np.abs(want).max() * 2**-7)
    with pytest.raises(PlanError, match="linear with normalize needs weights that do not sum to zero"):
        cat.plan(PlanRequest("base", tuple(EXPERTS[:2]), "linear", "all", (1.0, -1.0)))


def test_linear_normalize_takes_small_weights_that_do_not_cancel(family, tmp_path):
    """Weights of 1e-13 each were refused as summing to zero (an absolute 1e-12 test); normalized they
    are 0.5 each: the merge of (1, 1). Cancelling is judged against the weights' own size, per tensor too."""
    kind, folder, cat = family
    pair = tuple(EXPERTS[:2])
    want = cat.plan(PlanRequest("base", pair, "linear", "all", (1.0, 1.0)))
    small = cat.plan(PlanRequest("base", pair, "linear", "all", (1e-13, 1e-13)))
    rows = pa.table(
        {"position": pa.array([0, 1], pa.int32()), "tensor": [T0, T0], "param": ["weight"] * 2, "value": [1e-13] * 2}
    )
    per_tensor = cat.plan(PlanRequest("base", pair, "linear", "all", (1.0, 1.0), tensor_params=rows))
    for name, plan in (("want", want), ("small", small), ("per_tensor", per_tensor)):
        cat.execute(plan.plan_id, tmp_path / name)
    assert _tensors(tmp_path / "small") == _tensors(tmp_path / "want") == _tensors(tmp_path / "per_tensor")
    with pytest.raises(PlanError, match=r"do not sum to zero; these sum to 1(\.\d+)?e-13"):
        cat.plan(PlanRequest("base", pair, "linear", "all", (1.0, -1.0 + 1e-13)))


def _tensors(out) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in load_model(out).items()}
