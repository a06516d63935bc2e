"""The SQL planner against independent references: numpy greedy, exact top sets, whole-tensor errors."""

from __future__ import annotations

from dataclasses import replace

import duckdb
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mergedb.catalog import Catalog
from mergedb.errors import PlanError
from mergedb.methods import METHODS
from mergedb.planner import PlanRequest, parse_budget
from mergedb.synth import simulate
from tests.reference import kth_largest, load_model, ref_coefficients


def mask(cat, plan_id, value="norm-sqrt"):
    """The plan's candidates (the plan_mask view) with the textbook score |c_k|·‖Δ_kb‖ / √bytes (the
    default value model, norm-sqrt) or |c_k|·‖Δ_kb‖ / bytes (value "norm")."""
    per = "sqrt(greatest(m.nbytes, 1))" if value == "norm-sqrt" else "greatest(m.nbytes, 1)"
    return cat.sql(
        "SELECT pe.position, m.tensor_idx, m.block_idx, m.selected, m.free, "
        f"abs(pe.coef) * eb.delta_norm / {per} AS score, m.nbytes FROM plan_mask m "
        "JOIN plan_experts pe ON pe.plan_id = m.plan_id AND pe.checkpoint_id = m.checkpoint_id "
        "JOIN expert_blocks eb ON eb.checkpoint_id = m.checkpoint_id AND eb.tensor_idx = m.tensor_idx "
        "AND eb.block_idx = m.block_idx WHERE m.plan_id = ? ORDER BY 1, 2, 3",
        [plan_id],
    ).to_pylist()


def numpy_greedy(rows, budget):
    """Textbook greedy: best score first (ties by key), take a block whenever it still fits."""
    cands = sorted(
        (r for r in rows if not r["free"]), key=lambda r: (-r["score"], r["position"], r["tensor_idx"], r["block_idx"])
    )
    left, chosen = budget, set()
    for r in cands:
        if r["nbytes"] <= left:
            chosen.add((r["position"], r["tensor_idx"], r["block_idx"]))
            left -= r["nbytes"]
    return chosen


def selected(rows):
    return {(r["position"], r["tensor_idx"], r["block_idx"]) for r in rows if r["selected"]}


@given(
    experts=st.integers(1, 4),
    tensors=st.integers(1, 3),
    blocks=st.integers(1, 5),
    equal=st.booleans(),
    seed=st.integers(0, 10**6),
    frac=st.floats(0, 1.2),
    value=st.sampled_from([None, "norm"]),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_budget_properties_on_random_catalogs(tmp_path_factory, experts, tensors, blocks, equal, seed, frac, value):
    cat = Catalog(tmp_path_factory.mktemp("p") / "c.duckdb")
    rng = np.random.default_rng(seed)
    sizes = 1000 if equal else list(rng.integers(1, 5000, tensors * blocks))
    simulate(cat, experts, tensors, blocks, block_bytes=sizes, identical_fraction=0.2, seed=seed)
    base = cat.checkpoints()[0].name
    full = sum(r["nbytes"] for r in cat.sql("SELECT nbytes FROM blocks").to_pylist()) * experts
    budget = int(full * frac)
    p = cat.plan(PlanRequest(base, None, "task_arithmetic", f"{budget}B", value_model=value))
    assert p.value_model == (value or "norm-sqrt")  # None: the default
    rows = mask(cat, p.plan_id, p.value_model)
    sel = selected(rows)
    # stored as one bit string per (expert, tensor), one bit per block; the view and the executor's
    # mask are both expansions of it
    bits = cat.sql(
        "SELECT bit_length(selected) AS n, bit_count(selected) AS ones FROM plan_mask_bits WHERE plan_id = ?",
        [p.plan_id],
    ).to_pylist()
    assert len(bits) == experts * tensors and {b["n"] for b in bits} == {blocks}
    assert sum(b["ones"] for b in bits) == len(sel) == p.n_selected
    xp = cat.execution_plan(p.plan_id)
    cols = [xp.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx")]
    assert set(zip(*cols)) == sel and len(cols[0]) == len(sel)
    # soundness
    assert p.selected_bytes == sum(r["nbytes"] for r in rows if r["selected"]) <= budget
    # the SQL cut equals an independent greedy on the same scores
    assert sel == numpy_greedy(rows, budget)
    # free blocks are never selected
    assert not any(r["free"] and r["selected"] for r in rows)
    if budget >= full:
        assert sel == {(r["position"], r["tensor_idx"], r["block_idx"]) for r in rows if not r["free"]}
    if equal:  # equal sizes: exactly the top-by-value set
        cands = sorted(
            (r for r in rows if not r["free"]),
            key=lambda r: (-r["score"], r["position"], r["tensor_idx"], r["block_idx"]),
        )
        m = budget // 1000
        assert sel == {(r["position"], r["tensor_idx"], r["block_idx"]) for r in cands[:m]}
    # determinism: same inputs, same mask and hash
    p2 = cat.plan(PlanRequest(base, None, "task_arithmetic", f"{budget}B", value_model=value))
    assert p2.plan_hash == p.plan_hash and selected(mask(cat, p2.plan_id)) == sel
    zero = cat.plan(PlanRequest(base, None, "task_arithmetic", "0"))
    assert zero.selected_bytes == 0 and not selected(mask(cat, zero.plan_id))


def test_hash_changes_with_any_input(tmp_path):
    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 3, 2, 4, seed=1)
    base = cat.checkpoints()[0].name
    ref = cat.plan(PlanRequest(base, None, "task_arithmetic", "50%")).plan_hash
    variants = [
        PlanRequest(base, None, "task_arithmetic", "40%"),
        PlanRequest(base, None, "linear", "50%"),
        PlanRequest(base, None, "task_arithmetic", "50%", weights=(1, 1, 2)),
        PlanRequest(base, None, "task_arithmetic", "50%", params={"lambda": 0.5}),
        PlanRequest(base, None, "task_arithmetic", "50%", seed=1),
    ]
    hashes = {cat.plan(v).plan_hash for v in variants}
    assert ref not in hashes and len(hashes) == len(variants)


@pytest.mark.parametrize(
    "spec,expected",
    [("all", 1000), ("25%", 250), ("12.5%", 125), ("0", 0), ("1KiB", 1024), ("500B", 500), ("2kb", 2000)],
)
def test_parse_budget(spec, expected):
    assert parse_budget(spec, 1000) == expected


@pytest.mark.parametrize("spec", ["-5MB", "100", "lots", "150%", "5 parsecs", "", "1.0", "100.0", ".5", 1.0])
def test_bad_budgets_refused_with_example(spec):
    """A bare number has no unit: refused, with a decimal point too (1.0, a fraction or all?, was
    read as 1 byte, a plan reading nothing; review, 2026-12-02)."""
    with pytest.raises(PlanError, match="2GiB"):
        parse_budget(spec, 1000)
    assert parse_budget("0.0", 1000) == 0  # nothing, in any spelling


@pytest.mark.parametrize(
    "method,params,match",
    [
        ("nonsense", {}, "unknown method"),
        ("ties", {"gamma": 0.1}, "no parameter 'gamma'"),
        ("ties", {"density": 1.5}, "density must be in"),
        ("ties", {"density": 0}, "density must be in"),
        ("breadcrumbs", {"density": 0.9, "gamma": 0.2}, "gamma"),
        ("della", {"density": 0.5, "epsilon": 0.6}, "epsilon"),
        ("task_arithmetic", {"lambda": float("nan")}, "finite"),
        ("linear", {"normalize": "yes"}, "normalize"),
    ],
)
def test_bad_methods_and_parameters_refused_before_writing(tmp_path, method, params, match):
    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)
    base = cat.checkpoints()[0].name
    with pytest.raises(PlanError, match=match):
        cat.plan(PlanRequest(base, None, method, "all", params=params))
    assert cat.plans() == []


def test_negative_weights_refused_where_signs_are_elected(tmp_path):
    """Every sign-electing method refuses a negative weight (it used to drop that expert's delta where
    signs disagreed: a lone expert at weight -1 merged to the base); task arithmetic subtracts with one.
    model_stock refuses weights it would ignore."""
    from mergedb.methods import METHODS

    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)
    base = cat.checkpoints()[0].name
    electing = [m for m in METHODS.values() if m.consensus]
    assert {"ties", "dare_ties", "breadcrumbs_ties", "della"} <= {m.name for m in electing}
    for m in electing:
        with pytest.raises(PlanError, match=rf"weight 2 of 2 is -0.5: {m.name} elects each element's sign"):
            cat.plan(PlanRequest(base, None, m.name, "all", weights=(1.0, -0.5)))
    with pytest.raises(PlanError, match="model_stock takes no weights"):
        cat.plan(PlanRequest(base, None, "model_stock", "all", weights=(1.0, 2.0)))
    assert cat.plans() == []
    assert cat.plan(PlanRequest(base, None, "task_arithmetic", "all", weights=(1.0, -0.5))).plan_id == 1


def test_unknown_expert_and_weights(tmp_path):
    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)
    base = cat.checkpoints()[0].name
    with pytest.raises(PlanError, match="no expert named 'zz'"):
        cat.plan(PlanRequest(base, ("zz",), "linear"))
    with pytest.raises(PlanError, match="one weight per expert"):
        cat.plan(PlanRequest(base, None, "linear", weights=(1.0,)))
    with pytest.raises(PlanError, match="no base named"):
        cat.plan(PlanRequest("nobase", None, "linear"))


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    from mergedb import synth

    root = tmp_path_factory.mktemp("bound")
    fam = synth.make_family(root / "fam", experts=4, size="tiny", dtype="fp32", seed=9)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    models = {n: load_model(fam / n) for n in ["base", "expert_00", "expert_01", "expert_02", "expert_03"]}
    return cat, models


@pytest.mark.parametrize(
    "method,weights,params",
    [
        ("task_arithmetic", (1.0, 0.5, -0.7, 2.0), {"lambda": 0.8}),
        ("linear", (1.0, 2.0, 3.0, 4.0), {}),
    ],
)
@pytest.mark.parametrize("budget", ["0", "10%", "33%", "50%", "90%", "all"])
def test_bounds_hold_against_whole_tensor_errors(registered, method, weights, params, budget):
    cat, models = registered
    p = cat.plan(PlanRequest("base", None, method, budget, weights, params))
    rows = cat.sql(
        "SELECT pe.position, pe.coef, ft.name, bl.row_start, bl.row_end, m.selected FROM plan_mask m "
        "JOIN plan_experts pe ON pe.plan_id = m.plan_id AND pe.checkpoint_id = m.checkpoint_id "
        "JOIN family_tensors ft ON ft.base_id = 1 AND ft.tensor_idx = m.tensor_idx "
        "JOIN blocks bl ON bl.base_id = 1 AND bl.tensor_idx = m.tensor_idx AND bl.block_idx = m.block_idx "
        "WHERE m.plan_id = ?",
        [p.plan_id],
    ).to_pylist()
    names = ["expert_00", "expert_01", "expert_02", "expert_03"]
    # θ_B − θ_F = −Σ_{omitted} c_k Δ_kb, computed from whole tensors
    err = {}
    for r in rows:
        if r["selected"]:
            continue
        b = models["base"][r["name"]]
        d = (models[names[r["position"]]][r["name"]].astype(np.float64) - b).reshape(
            b.shape[0] if b.ndim > 1 else 1, -1
        )
        acc = err.setdefault(r["name"], np.zeros_like(d))
        acc[r["row_start"] : r["row_end"]] += r["coef"] * d[r["row_start"] : r["row_end"]]
    actual = np.sqrt(sum(float((e**2).sum()) for e in err.values()))
    assert actual <= p.bound_blockwise * (1 + 1e-9) + 1e-12
    assert p.bound_blockwise <= p.bound_sum * (1 + 1e-9) + 1e-12
    if budget == "all":
        assert actual == 0 and p.bound_sum == 0
    if actual > 0:  # the sketch estimate is an estimate: same order of magnitude
        assert 0.5 * actual <= p.est_error <= 2.0 * actual


def test_trimmed_scores_and_thresholds_exact_on_grid(registered):
    cat, models = registered
    p = cat.plan(PlanRequest("base", None, "ties", "50%", params={"density": 0.2}))
    th = cat.sql(
        "SELECT bool_and(exact) AS e, count(*) AS n FROM plan_thresholds WHERE plan_id = ?", [p.plan_id]
    ).to_pylist()
    assert th[0]["e"] and th[0]["n"] > 0
    off = cat.plan(PlanRequest("base", None, "ties", "50%", params={"density": 0.2345}))
    th = cat.sql("SELECT bool_or(exact) AS e FROM plan_thresholds WHERE plan_id = ?", [off.plan_id]).to_pylist()
    assert th[0]["e"] is False
    assert p.selected_bytes <= p.budget_bytes and p.bound_sum is None


def _hist_bin(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Edges of the |Δ| histogram bin of each (positive, normal) a: [2^e, 1.5·2^e) or [1.5·2^e, 2^(e+1))."""
    m, e = np.frexp(a.astype(np.float64))  # a = m·2^e, m in [0.5, 1)
    octave = np.ldexp(1.0, e - 1)
    upper_half = m >= 0.75
    return np.where(upper_half, 1.5 * octave, octave), np.where(upper_half, 2 * octave, 1.5 * octave)


@pytest.mark.parametrize(
    "method,params",
    [
        ("ties", {"density": 0.2, "lambda": 0.8}),
        ("breadcrumbs", {"density": 0.8, "gamma": 0.05}),
        ("breadcrumbs_ties", {"density": 0.6, "gamma": 0.01}),
    ],
)
def test_trimmed_values_interpolate_the_histogram(registered, method, params):
    """plan_candidates_trimmed.sql against the raw arrays: per (expert, block), value = |c_k|·sqrt(
    Σ_bins ΣΔ²_bin · |bin ∩ [t_lo, t_hi)| / |bin|) (bins wholly inside count fully, a straddling
    bin by the overlapping fraction of its width), recomputed here from every element; the
    estimate brackets the exact ‖Δ surviving the trim‖ like the bins do, and is close to it."""
    cat, models = registered
    names = ["expert_00", "expert_01", "expert_02", "expert_03"]
    from mergedb.methods import METHODS

    weights = (1.0, 0.5, 0.7 if METHODS[method].consensus else -0.7, 2.0)  # |c_k|; sign election takes w ≥ 0
    req = PlanRequest("base", tuple(names), method, "50%", weights, params)
    p = cat.plan(req)
    cat_with = duckdb.connect()
    cat_with.register("cands", cat.plan_candidates(req))
    cat_with.register(
        "info",
        cat.sql(
            "SELECT pe.position, ft.name, bl.tensor_idx, bl.block_idx, bl.row_start, bl.row_end, th.t_lo, th.t_hi, "
            "th.exact FROM plan_experts pe JOIN plans pl USING (plan_id) "
            "JOIN family_tensors ft ON ft.base_id = pl.base_id "
            "JOIN blocks bl ON bl.base_id = pl.base_id AND bl.tensor_idx = ft.tensor_idx "
            "JOIN plan_thresholds th ON th.plan_id = pe.plan_id AND th.checkpoint_id = pe.checkpoint_id "
            "AND th.tensor_idx = ft.tensor_idx WHERE pe.plan_id = ?",
            [p.plan_id],
        ),
    )
    rows = (
        cat_with.sql(
            "SELECT i.position, i.name, i.row_start, i.row_end, c.free, c.value, c.score, c.nbytes, i.t_lo, i.t_hi, "
            "i.exact FROM cands c JOIN info i USING (position, tensor_idx, block_idx)"
        )
        .to_arrow_table()
        .to_pylist()
    )
    coefs = ref_coefficients(method, params, list(weights))
    density, gamma = params["density"], params.get("gamma", 0.0)
    assert len(rows) > 100
    total_value_sq = total_exact_sq = 0.0
    trims = {}
    for r in rows:
        b = models["base"][r["name"]]
        d = (models[names[r["position"]]][r["name"]] - b).reshape(b.shape[0] if b.ndim > 1 else 1, -1)
        if (r["position"], r["name"]) not in trims:
            # thresholds of the whole tensor, exact on the density grid (k = max(1, int(density·n)))
            a_all = np.abs(d).reshape(-1)
            trims[r["position"], r["name"]] = (
                kth_largest(a_all, gamma + density),
                kth_largest(a_all, gamma) if gamma and int(gamma * a_all.size) >= 1 else None,
            )
        t_lo, t_hi = trims[r["position"], r["name"]]
        assert r["exact"] and np.float32(r["t_lo"]) == t_lo
        assert (r["t_hi"] is None) if t_hi is None else np.float32(r["t_hi"]) == t_hi
        hi = np.inf if t_hi is None else float(t_hi)
        a = np.abs(d[r["row_start"] : r["row_end"]]).reshape(-1)
        assert r["nbytes"] == a.size * 4  # fp32 family
        a = a[a > 0].astype(np.float64)  # exact zeros add nothing to any ΣΔ²
        if r["free"]:
            assert a.size == 0 and r["value"] == 0 and r["score"] == 0
            continue
        q = a * a
        lo_edge, hi_edge = _hist_bin(a)
        overlap = np.clip(np.minimum(hi_edge, hi) - np.maximum(lo_edge, float(t_lo)), 0, None) / (hi_edge - lo_edge)
        c = abs(coefs[r["position"]])
        want = c * np.sqrt(np.sum(q * overlap))
        assert r["value"] == pytest.approx(want, rel=1e-6, abs=1e-12), (r["name"], r["position"])
        assert r["score"] == pytest.approx(r["value"] / np.sqrt(r["nbytes"]), rel=1e-12)  # norm-sqrt, the default
        # the documented approximation errs only inside the straddling bins: the estimate and the
        # exact survivors both lie between "bins wholly inside" and "bins touching" the kept range
        exact_sq = c * c * np.sum(q[(a >= t_lo) & (a < hi)])
        inside = c * c * np.sum(q[(lo_edge >= t_lo) & (hi_edge <= hi)])
        touching = c * c * np.sum(q[(hi_edge > t_lo) & (lo_edge < hi)])
        assert inside * (1 - 1e-9) <= min(exact_sq, r["value"] ** 2) <= max(exact_sq, r["value"] ** 2)
        assert max(exact_sq, r["value"] ** 2) <= touching * (1 + 1e-6) + 1e-30
        total_value_sq += r["value"] ** 2
        total_exact_sq += exact_sq
    # over all blocks the interpolation is close to the exact survivors (here within 2.2%; counting
    # straddling bins wholly or not at all is off by 2–21%)
    assert total_value_sq == pytest.approx(total_exact_sq, rel=0.05)


def test_nonfinite_expert_refused_then_allowed(tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from mergedb import synth

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=2)
    shutil.copytree(fam / "expert_00", fam / "bad")
    t = load_file(str(fam / "bad" / "model.safetensors"))
    w = t["lm_head.weight"].clone()
    w[0, 0] = float("inf")
    t["lm_head.weight"] = w.to(torch.bfloat16)
    save_file(t, str(fam / "bad" / "model.safetensors"))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    with pytest.raises(PlanError, match="'bad' has 1 NaN/Inf values in tensor 'lm_head.weight'.*--allow-nonfinite"):
        cat.plan(PlanRequest("base", None, "linear"))
    p = cat.plan(PlanRequest("base", None, "linear", allow_nonfinite=True))
    bad = cat.sql(
        "SELECT count(*) AS n FROM plan_mask m JOIN expert_blocks eb USING (checkpoint_id, tensor_idx, block_idx) "
        "WHERE m.plan_id = ? AND eb.nonfinite > 0",
        [p.plan_id],
    ).to_pylist()
    assert bad == [{"n": 0}]


def test_equal_scores_break_ties_by_position_tensor_block(tmp_path):
    """Every score equal (one bucket holds all): the budget takes the first blocks in (position,
    tensor_idx, block_idx) order, whatever order the catalog returns them in."""
    import duckdb as db

    path = tmp_path / "c.duckdb"
    cat = Catalog(path)
    simulate(cat, 3, 4, 5, block_bytes=1000, identical_fraction=0.0, seed=3)
    con = db.connect(str(path))
    con.execute("UPDATE expert_blocks SET delta_norm = 2.5")
    con.close()
    base = cat.checkpoints()[0].name
    p = cat.plan(PlanRequest(base, None, "task_arithmetic", "23000B"))  # 23 blocks of 1000 bytes
    keys = sorted((pos, t, b) for pos in range(3) for t in range(4) for b in range(5))
    assert selected(mask(cat, p.plan_id)) == set(keys[:23]) and p.selected_bytes == 23000


def test_random_strategy_is_a_seeded_greedy_on_uniform_scores(tmp_path):
    """--strategy random: scores uniform in [0, 1) from the seed, the same greedy cut, true bounds."""
    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 3, 4, 50, block_bytes=1000, identical_fraction=0.1, seed=5)
    base = cat.checkpoints()[0].name
    req = PlanRequest(base, None, "task_arithmetic", "30%", strategy="random", seed=7)
    p = cat.plan(req)
    cands = cat.plan_candidates(req).to_pylist()
    scores = np.array([c["score"] for c in cands])
    assert scores.min() >= 0 and scores.max() < 1 and 0.4 < scores.mean() < 0.6  # 600 uniform draws
    rows = [dict(c, selected=False) for c in cands]
    assert selected(mask(cat, p.plan_id)) == numpy_greedy(rows, p.budget_bytes)
    assert cat.plan(req).plan_hash == p.plan_hash  # the seed fixes the mask
    other = cat.plan(PlanRequest(base, None, "task_arithmetic", "30%", strategy="random", seed=8))
    ranked = cat.plan(PlanRequest(base, None, "task_arithmetic", "30%"))
    assert len({p.plan_hash, other.plan_hash, ranked.plan_hash}) == 3
    # values stay |c_k|·‖Δ_kb‖ (c_k = 1): the bound sums what the random mask left out
    left = cat.sql(
        "SELECT sum(eb.delta_norm) AS s FROM plan_mask m JOIN expert_blocks eb ON eb.checkpoint_id = m.checkpoint_id "
        "AND eb.tensor_idx = m.tensor_idx AND eb.block_idx = m.block_idx WHERE m.plan_id = ? AND NOT m.selected",
        [p.plan_id],
    ).to_pylist()[0]["s"]
    assert p.bound_sum == pytest.approx(left, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 3),
    t=st.integers(1, 4),
    b=st.integers(1, 6),
    budget_frac=st.floats(0.0, 1.0),
    random_scores=st.booleans(),
)
def test_greedy_with_fixed_costs_is_the_walk(seed, k, t, b, budget_frac, random_scores):
    """greedy.select with carriers (candidates.charge_fixed) against the plain walk: in the order
    (score desc, position, tensor, block) take a non-free block if it fits and, for a tensor with a
    fixed cost, the pair's carrier — its best block by the scores before charging, lowest block on
    ties — is taken; the carrier pays the fixed bytes. Small blocks, big factors, equal scores."""
    from mergedb import candidates, greedy

    rng = np.random.default_rng(seed)
    pos, ten, blk = (a.reshape(-1).astype(np.int32) for a in np.meshgrid(range(k), range(t), range(b), indexing="ij"))
    n = pos.size
    free = rng.random(n) < 0.2
    nbytes = rng.integers(0, 50, n).astype(np.int64)
    value = rng.choice([0.0, 1.0, 2.0, 3.5], n) * rng.integers(1, 3, n)  # many ties
    score = rng.choice([0.1, 0.5, 0.9], n) if random_scores else value / np.maximum(nbytes, 1)
    fixed = np.where(rng.random(k * t) < 0.6, rng.integers(1, 120, k * t), 0).astype(np.int64)
    pair = pos.astype(np.int64) * t + ten
    # the reference's carriers, from the scores before charging
    carrier_of = {}
    for g in range(k * t):
        rows = [i for i in range(n) if pair[i] == g and not free[i]]
        if fixed[g] and rows:
            carrier_of[g] = min(rows, key=lambda i: (-score[i], blk[i]))
    cost = nbytes.copy()
    for g, c in carrier_of.items():
        cost[c] += fixed[g]
    kw = {} if random_scores else {"value": value}
    new_nbytes, new_score = nbytes.copy(), score.copy()
    dep, car = candidates.charge_fixed(pair, fixed, blk, free, nbytes=new_nbytes, score=new_score, **kw)
    assert np.array_equal(new_nbytes, cost)
    # carriers come first in the plan's order (equal only at score 0, where the carrier is the lowest block)
    assert all((-new_score[c], blk[c]) < (-new_score[d], blk[d]) for d, c in zip(dep, car))
    assert {int(d): int(c) for d, c in zip(dep, car)} == {
        i: carrier_of[int(pair[i])]
        for i in range(n)
        if int(pair[i]) in carrier_of and i != carrier_of[int(pair[i])] and not free[i]
    }
    cands = greedy.Candidates.build(
        {"position": pos, "tensor_idx": ten, "block_idx": blk, "free": free},
        nbytes=new_nbytes,
        value=value,
        score=new_score,
        gblock=(ten * b + blk).astype(np.int64),
        n_family_blocks=t * b,
        dependent=dep,
        carrier=car,
    )
    budget = int(budget_frac * cost[~free].sum())
    sel, _ = greedy.select(cands, budget, 256)
    taken, left = set(), budget
    for i in sorted(range(n), key=lambda i: (-new_score[i], pos[i], ten[i], blk[i])):
        g = int(pair[i])
        ok = g not in carrier_of or carrier_of[g] == i or carrier_of[g] in taken
        if not free[i] and cost[i] <= left and ok:
            taken.add(i)
            left -= int(cost[i])
    assert set(np.flatnonzero(sel).tolist()) == taken
    assert int(cost[sel].sum()) <= budget


def test_trimmed_values_follow_each_expert_not_its_position(registered):
    """The trims are matched to candidates by (position, tensor) in memory (candidates.pair_trims):
    listing the experts in reverse gives every expert's blocks the same trimmed values as before,
    which fails if a position were matched to another expert's thresholds."""
    cat, _ = registered
    names = ["expert_00", "expert_01", "expert_02", "expert_03"]
    values = {}
    for order in (names, names[::-1]):
        req = PlanRequest("base", tuple(order), "breadcrumbs", "all", params={"density": 0.8, "gamma": 0.05})
        t = cat.plan_candidates(req).to_pydict()
        values[tuple(order)] = {
            (order[p], ti, bi): v for p, ti, bi, v in zip(t["position"], t["tensor_idx"], t["block_idx"], t["value"])
        }
    forward, backward = values[tuple(names)], values[tuple(names[::-1])]
    assert forward.keys() == backward.keys() and len(forward) > 100
    assert len({round(v, 12) for v in forward.values()}) > 50  # the experts' values differ from one another
    assert all(forward[k] == backward[k] for k in forward)


def test_trimmed_norms_of_a_sliced_batch_against_a_loop():
    """candidates.trimmed_norms on a batch that starts inside its list buffers (a reader's second
    batch does), NULL trims and free rows, against the textbook loop over bins."""
    import pyarrow as pa

    from mergedb.candidates import trimmed_norms

    rng = np.random.default_rng(4)
    n = 50
    lengths = rng.integers(0, 6, n)
    lo = [sorted(rng.uniform(0.01, 1, k).astype(np.float32).tolist()) for k in lengths]
    hi = [[x * 1.5 for x in row] for row in lo]
    sq = [rng.uniform(0, 3, k).tolist() for k in lengths]
    t_lo = [None if i % 7 == 0 else float(rng.uniform(0, 0.8)) for i in range(n)]
    t_hi = [None if i % 3 else float(rng.uniform(0.5, 2)) for i in range(n)]
    free = [i % 11 == 0 for i in range(n)]
    table = pa.table(
        {
            "position": pa.array([0] * n, pa.int32()),
            "tensor_idx": pa.array([0] * n, pa.int32()),
            "block_idx": pa.array(range(n), pa.int32()),
            "free": pa.array(free),
            "norm": pa.array([0.0] * n),
            "read_bytes": pa.array([-1] * n, pa.int64()),
            "random_score": pa.array([None] * n, pa.float64()),
            "hist_lo": pa.array(lo, pa.list_(pa.float32())),
            "hist_hi": pa.array(hi, pa.list_(pa.float32())),
            "hist_sumsq": pa.array(sq, pa.list_(pa.float64())),
        }
    )
    batch = table.to_batches()[0].slice(13, 30)
    out = np.full(30, -1.0)
    # the rows' trims as pair_trims gives them: ±inf for none
    row_lo = np.array([-np.inf if t is None else t for t in t_lo[13:43]], np.float32)
    row_hi = np.array([np.inf if t is None else t for t in t_hi[13:43]], np.float32)
    trimmed_norms(batch, 7, row_lo, row_hi, out)
    for j in range(30):
        i = 13 + j
        lo_t = -np.inf if t_lo[i] is None else np.float32(t_lo[i])
        hi_t = np.inf if t_hi[i] is None else np.float32(t_hi[i])
        total = 0.0
        for a, b, s in zip(np.float32(lo[i]), np.float32(hi[i]), sq[i]):
            total += s * max(0.0, min(b, hi_t) - max(a, lo_t)) / (b - a)
        want = 0.0 if free[i] else np.sqrt(total)
        assert out[j] == pytest.approx(want, rel=1e-6, abs=1e-12), i


def _stored(cat, plan_id):
    """Everything a plan stores but its id, name, budget spec and timing: the plans row, its experts,
    thresholds and mask bits."""
    skip = {"plan_id", "name", "budget_spec", "planning_seconds", "created"}
    plan = {k: v for k, v in cat.sql("SELECT * FROM plans WHERE plan_id = ?", [plan_id]).to_pylist()[0].items()}
    tables = {
        t: cat.sql(f"SELECT * EXCLUDE (plan_id) FROM {t} WHERE plan_id = ? ORDER BY ALL", [plan_id]).to_pylist()
        for t in ("plan_experts", "plan_thresholds", "plan_mask_bits")
    }
    return {k: v for k, v in plan.items() if k not in skip}, tables


_TRIMMED = [(m.name, {}) for m in METHODS.values() if m.score == "trimmed"]
_CONSENSUS = [(m.name, {"value_model": "consensus", "min_coverage": 0.3}) for m in METHODS.values() if m.consensus]


@pytest.mark.parametrize("method,options", _TRIMMED + _CONSENSUS)
def test_full_read_plans_skip_values_and_store_the_same_plan(registered, monkeypatch, method, options):
    """A budget that is the full read by its form (all, 100%) selects every candidate whatever the
    values, so the planner skips what only values need (the trimmed histograms, the consensus
    model): the stored plan is the one a size budget of the same bytes stores, which computes them."""
    from mergedb import consensus

    cat, _ = registered
    fetched = []
    real_fetch = consensus.fetch
    monkeypatch.setattr(consensus, "fetch", lambda *a, **k: fetched.append(1) or real_fetch(*a, **k))
    w3 = 0.7 if METHODS[method].consensus else -0.7  # sign election takes weights ≥ 0
    req = PlanRequest("base", None, method, "all", (1.0, 0.5, w3, 2.0), **options)
    fast = cat.plan(req, explain=True)
    assert not any("plan_candidates_trimmed" in sql for _, sql, _ in fast.explain)
    assert not fetched
    sized = cat.plan(replace(req, budget=f"{fast.full_bytes}B"), explain=True)
    trimmed = any("plan_candidates_trimmed" in sql for _, sql, _ in sized.explain)
    assert trimmed == (METHODS[method].score == "trimmed")
    assert bool(fetched) == ("value_model" in options)
    percent = cat.plan(replace(req, budget="100%"))
    assert fast.n_selected == fast.n_candidates - fast.free_blocks > 0 and fast.est_error == 0
    assert _stored(cat, fast.plan_id) == _stored(cat, sized.plan_id) == _stored(cat, percent.plan_id)


def test_a_delta_beyond_float32_is_named_as_such(tmp_path):
    """Two finite values whose difference overflows float32 make a non-finite delta: refused as
    NaN/Inf values, which the expert's file does not hold; the message says which it can be."""
    import json

    import torch
    from safetensors.torch import save_file

    for name, v in (("base", -3e38), ("e0", 3e38)):
        (tmp_path / "fam" / name).mkdir(parents=True)
        save_file({"model.w": torch.tensor([[v, 1.0]])}, str(tmp_path / "fam" / name / "model.safetensors"))
        (tmp_path / "fam" / name / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base")
    with pytest.raises(PlanError, match=r"'e0' has 1 NaN/Inf values in tensor 'model.w' \(in its file, or differences"):
        cat.plan(PlanRequest("base", None, "task_arithmetic"))


def test_listing_plans_gives_each_its_own_experts(tmp_path):
    """Catalog.plans reads every plan and every plan's experts in two statements (one pair per plan
    took `mergedb plans` 6 s for 1,000 plans); each summary must still hold only its own experts, in
    its order, with its weights: checked against the rows written (independent of load_plans)."""
    import duckdb

    from mergedb import synth

    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", dtype="fp32", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    made = [
        cat.plan(PlanRequest("base", ("expert_02", "expert_00"), "linear", "50%", (3.0, 1.0))),
        cat.plan(PlanRequest("base", None, "task_arithmetic", "10%", name="ta")),
        cat.plan(PlanRequest("base", ("expert_01",), "ties", "all", params={"density": 0.3})),
    ]
    listed = cat.plans()
    assert listed == made
    con = duckdb.connect(str(cat.path), read_only=True)
    rows = con.execute(
        "SELECT pe.plan_id, c.name, pe.weight FROM plan_experts pe JOIN checkpoints c USING (checkpoint_id) "
        "ORDER BY pe.plan_id, pe.position"
    ).fetchall()
    con.close()
    assert [(p.plan_id, e.name, e.weight) for p in listed for e in p.experts] == rows
    assert [[e.name for e in p.experts] for p in listed] == [
        ["expert_02", "expert_00"],
        ["expert_00", "expert_01", "expert_02"],
        ["expert_01"],
    ]


@pytest.mark.parametrize(
    "params, weights, words",
    [
        ({"lambda": 10**400}, [1.0], "lambda must be between"),
        ({"density": 10**400}, [1.0], "density must be between"),
        ({}, [10**400], "weight 1 of 1 is 1000"),
        ({1: 0.5, "gamma": 0.1}, [1.0], "has no parameter"),
    ],
    ids=["huge-int-lambda", "huge-int-density", "huge-int-weight", "mixed-key-types"],
)
def test_python_values_past_float_and_mixed_keys_are_plan_errors(params, weights, words):
    """From Python an int past float's range (10**400) raised OverflowError, and parameter keys of
    mixed types a TypeError from sorting them (review, 2026-12-02)."""
    from mergedb import methods

    with pytest.raises(PlanError, match=words):
        methods.validate("ties", params, weights, 1)


def test_a_wait_past_floats_range_waits_as_long_as_it_takes(tmp_path):
    from mergedb.catalog import Catalog

    assert Catalog(tmp_path / "c.duckdb", wait=10**400).wait == float("inf")


def test_a_percentage_budget_is_of_all_expert_bytes_blocks_equal_to_the_base_included(registered):
    """What the README says a percentage is of (a review read "of the bytes the full merge reads",
    which skips blocks equal to the base, and found '50%' allowing 54% of those): every expert byte the
    catalog counts (expert_costs.total_bytes), free blocks included; `all` reads every non-free one."""
    cat = registered[0]
    half = cat.plan(PlanRequest("base", None, "task_arithmetic", "50%"))
    every = cat.sql("SELECT CAST(sum(total_bytes) AS BIGINT) AS n FROM expert_costs").column("n")[0].as_py()
    assert half.free_blocks > 0 and half.full_bytes == every and half.budget_bytes == every // 2
    changed = cat.sql("SELECT CAST(sum(changed_bytes) AS BIGINT) AS n FROM expert_costs").column("n")[0].as_py()
    assert cat.plan(PlanRequest("base", None, "task_arithmetic", "all")).selected_bytes == changed < every


def test_a_plans_hash_does_not_depend_on_the_order_its_experts_were_registered_in(tmp_path):
    """A trimming plan hashed its thresholds keyed by checkpoint id, which follows registration order:
    the same plan over the same experts had two hashes in two catalogs (planner review). They are keyed
    by expert position now; a plan hashed the old way still verifies (refuse_altered tries both)."""
    from mergedb import planhash, synth
    from mergedb.planner import PlanRequest
    from tests.test_stock_whole import stored_hash_args

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=5)
    cats = []
    for name, order in (("ab", ("expert_00", "expert_01")), ("ba", ("expert_01", "expert_00"))):
        cat = Catalog(tmp_path / f"{name}.duckdb")
        cat.register([fam / "base"], base=True)
        for e in order:
            cat.register([fam / e], base_model="base")
        cats.append(cat)
    ids = [c.sql("SELECT checkpoint_id FROM checkpoints WHERE name = 'expert_00'").column(0)[0].as_py() for c in cats]
    assert ids == [2, 3]  # the ids differ, or this tests nothing
    for method, params in (("ties", {"density": 0.3}), ("breadcrumbs_ties", {"density": 0.5, "gamma": 0.01})):
        req = PlanRequest("base", ("expert_00", "expert_01"), method, "50%", params=params)
        a, b = (c.plan(req) for c in cats)
        assert a.plan_hash == b.plan_hash, method
    cat = cats[1]
    args = stored_hash_args(cat, b.plan_id)
    assert args[7].num_rows  # thresholds, keyed by checkpoint id: the old form
    old = planhash.plan_hash(*args)
    assert old != b.plan_hash
    with cat.duckdb_connection(write=True) as con:
        con.execute("UPDATE plans SET plan_hash = ? WHERE plan_id = ?", [old, b.plan_id])
    assert cat.execution_plan(b.plan_id).plan_hash == old


def test_a_taken_name_is_refused_and_unnamed_plans_take_the_next_ids(tmp_path):
    from mergedb.errors import PlanExistsError

    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)
    base = cat.checkpoints()[0].name
    first = cat.plan(PlanRequest(base, None, "task_arithmetic", "all", name="ta"))
    with pytest.raises(PlanExistsError, match="a plan named 'ta' exists already; choose another --name"):
        cat.plan(PlanRequest(base, None, "task_arithmetic", "10%", name="ta"))
    unnamed = [cat.plan(PlanRequest(base, None, "task_arithmetic", "all")).plan_id for _ in range(2)]
    assert (first.plan_id, *unnamed) == (1, 2, 3)
    assert [(p.plan_id, p.name) for p in cat.plans()] == [(1, "ta"), (2, None), (3, None)]
