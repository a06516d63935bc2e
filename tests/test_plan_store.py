"""What a plan stores, against the catalog read independently; plans that do not depend on the
order the catalog returns its rows in; a failed store leaves nothing; the non-finite refusal."""

from __future__ import annotations

import shutil

import duckdb
import numpy as np
import pytest

from mergedb import planner
from mergedb.catalog import Catalog
from mergedb.errors import PlanError
from mergedb.planner import PlanRequest
from mergedb.synth import make_family, simulate

PLAN_TABLES = {  # every stored table of a plan, without its id and times
    "plans": "SELECT * EXCLUDE (plan_id, planning_seconds, created) FROM plans WHERE plan_id = $1",
    "plan_experts": "SELECT * EXCLUDE (plan_id) FROM plan_experts WHERE plan_id = $1 ORDER BY position",
    "plan_thresholds": "SELECT * EXCLUDE (plan_id) FROM plan_thresholds WHERE plan_id = $1 ORDER BY 1, 2",
    "plan_mask_bits": "SELECT checkpoint_id, tensor_idx, CAST(selected AS VARCHAR) AS bits FROM plan_mask_bits "
    "WHERE plan_id = $1 ORDER BY 1, 2",
    "plan_tensor_params": "SELECT * EXCLUDE (plan_id) FROM plan_tensor_params WHERE plan_id = $1 ORDER BY 1, 2",
}
REQUESTS = [
    PlanRequest("base", ("expert_02", "expert_00"), "task_arithmetic", "40%", weights=(0.5, 2.0)),
    PlanRequest("base", None, "ties", "30%", params={"density": 0.2}),
    PlanRequest("base", None, "breadcrumbs", "all", params={"density": 0.8, "gamma": 0.05}),
    PlanRequest("base", ("expert_01",), "slerp", "50%", params={"t": 0.3}),
]


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory):
    """A registered tiny bf16 family of 3 experts (one non-float tensor), small blocks."""
    root = tmp_path_factory.mktemp("store")
    fam = make_family(root / "fam", experts=3, size="tiny", seed=5)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    return root / "c.duckdb"


def _copy(src, tmp_path) -> Catalog:
    shutil.copy(src, tmp_path / "c.duckdb")
    return Catalog(tmp_path / "c.duckdb")


def _stored(cat: Catalog, plan_id: int) -> dict[str, list[dict]]:
    return {t: cat.sql(sql, [plan_id]).to_pylist() for t, sql in PLAN_TABLES.items()}


def test_stored_tables_match_the_catalog(catalog_file, tmp_path):
    """plan_experts, plan_thresholds, plan_mask_bits and the plans row, each recomputed from the
    catalog's own tables and the stored bits."""
    cat = _copy(catalog_file, tmp_path)
    req = PlanRequest("base", ("expert_02", "expert_00"), "ties", "30%", weights=(0.5, 2.0), params={"density": 0.2})
    p = cat.plan(req)
    got = _stored(cat, p.plan_id)
    ck = {r["name"]: r for r in cat.sql("SELECT * FROM checkpoints").to_pylist()}
    tensors = cat.sql("SELECT tensor_idx, nbytes, mergeable, n_blocks FROM family_tensors ORDER BY 1").to_pylist()
    mergeable = [t["tensor_idx"] for t in tensors if t["mergeable"]]
    blocks = {
        (r["tensor_idx"], r["block_idx"]): r["nbytes"]
        for r in cat.sql("SELECT tensor_idx, block_idx, nbytes FROM blocks").to_pylist()
    }
    bits = {(r["checkpoint_id"], r["tensor_idx"]): r["bits"] for r in got["plan_mask_bits"]}
    ids = [ck[n]["checkpoint_id"] for n in req.experts]
    # one bit string per (expert, float tensor), one bit per block
    assert sorted(bits) == sorted((c, t) for c in ids for t in mergeable)
    assert all(len(bits[c, t]) == tensors[t]["n_blocks"] for c, t in bits)
    full = {c: sum(blocks[t, b] for t in mergeable for b in range(tensors[t]["n_blocks"])) for c in ids}
    chosen = {c: sum(blocks[t, b] for t in mergeable for b, bit in enumerate(bits[c, t]) if bit == "1") for c in ids}
    experts = got["plan_experts"]
    assert [e["position"] for e in experts] == [0, 1] and [e["checkpoint_id"] for e in experts] == ids
    for e, name, w in zip(experts, req.experts, req.weights):
        c = ck[name]
        assert (e["fingerprint"], e["content_hash"], e["weight"]) == (c["fingerprint"], c["content_hash"], w)
        assert (e["full_bytes"], e["selected_bytes"]) == (full[c["checkpoint_id"]], chosen[c["checkpoint_id"]])
        assert e["bound_sum"] is None and e["bound_blockwise"] is None  # TIES: no additive bound
    # thresholds: the exact grid entry at density 0.2, one per (expert, float tensor)
    grid = cat.sql(
        "SELECT et.checkpoint_id, et.tensor_idx, et.grid_threshold[g.grid_idx] AS t FROM expert_tensors et, "
        "density_grid g WHERE g.density = 0.2"
    ).to_pylist()
    want = sorted((r["checkpoint_id"], r["tensor_idx"], r["t"]) for r in grid if r["checkpoint_id"] in ids)
    th = got["plan_thresholds"]
    assert [(r["checkpoint_id"], r["tensor_idx"], r["t_lo"]) for r in th] == want
    assert all(r["t_hi"] is None and r["exact"] for r in th)
    plan = got["plans"][0]
    assert plan["base_id"] == ck["base"]["checkpoint_id"] and plan["base_fingerprint"] == ck["base"]["fingerprint"]
    assert plan["base_bytes"] == sum(t["nbytes"] for t in tensors)
    assert plan["full_bytes"] == sum(full.values()) and plan["selected_bytes"] == sum(chosen.values())
    assert plan["selected_bytes"] <= plan["budget_bytes"] == int(plan["full_bytes"] * 0.3)
    assert plan["n_candidates"] == 2 * sum(tensors[t]["n_blocks"] for t in mergeable)
    assert plan["n_selected"] == sum(s.count("1") for s in bits.values())
    free = cat.sql(
        "SELECT count(*) AS n FROM expert_blocks WHERE identical AND list_contains(?, checkpoint_id)", [ids]
    ).to_pylist()[0]["n"]
    assert plan["free_blocks"] == free and (plan["method"], plan["name"]) == ("ties", None)


@pytest.mark.parametrize("density", [0.045, 0.5])  # γ + density on the density grid (0.05), and off it (0.505)
def test_band_thresholds_match_the_catalog(catalog_file, tmp_path, density):
    """breadcrumbs' stored thresholds, per (expert, float tensor), read from the catalog here: t_lo at
    γ + density (the grid's entry where it is on the grid, exact; else the summary's bound, not exact),
    t_hi at γ where γ·numel keeps at least one value (the grid's entry), NULL where it keeps none."""
    from mergedb import summary

    cat = _copy(catalog_file, tmp_path)
    gamma = 0.005  # 128-element tensors keep none (0.64), the others some
    p = cat.plan(PlanRequest("base", None, "breadcrumbs", "all", params={"density": density, "gamma": gamma}))
    rows = cat.sql(
        "SELECT et.checkpoint_id, et.tensor_idx, ft.numel, et.grid_threshold, et.summary_code, et.summary_count "
        "FROM expert_tensors et JOIN plan_experts pe ON pe.checkpoint_id = et.checkpoint_id AND pe.plan_id = $1 "
        "JOIN family_tensors ft ON ft.tensor_idx = et.tensor_idx AND ft.mergeable ORDER BY 1, 2",
        [p.plan_id],
    ).to_pylist()
    grid = {round(g["density"], 6): g["grid_idx"] for g in cat.sql("SELECT * FROM density_grid").to_pylist()}
    lo_at = grid.get(round(gamma + density, 6))
    assert (lo_at is None) == (density == 0.5)
    want = []
    for r in rows:
        if lo_at is not None:
            lo = r["grid_threshold"][lo_at - 1]
        else:
            lo = summary.threshold_from_summary(
                np.asarray(r["summary_code"]), np.asarray(r["summary_count"]), r["numel"], gamma + density
            )
        keeps = int(gamma * r["numel"]) >= 1
        hi = r["grid_threshold"][grid[gamma] - 1] if keeps else None
        want.append((r["checkpoint_id"], r["tensor_idx"], float(np.float32(lo)), hi, lo_at is not None))
    assert any(w[3] is None for w in want) and any(w[3] is not None for w in want)  # both cases occur
    got = [
        (r["checkpoint_id"], r["tensor_idx"], r["t_lo"], r["t_hi"], r["exact"])
        for r in _stored(cat, p.plan_id)["plan_thresholds"]
    ]
    assert got == want


def test_plans_do_not_depend_on_the_catalogs_row_order(catalog_file, tmp_path):
    """The planner's statements read these tables' rows in no particular order and sort them
    itself: the same catalog with their rows physically reversed gives the same plans, table for
    table. (Not expert_blocks: the candidates' per-expert bound sums and SLERP's statistics add
    floats in its scan order, as they always have, so reversing it moves their last bits.)"""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cat = _copy(catalog_file, tmp_path / "a")
    before = [(p.plan_hash, _stored(cat, p.plan_id)) for p in map(cat.plan, REQUESTS)]
    reversed_cat = _copy(catalog_file, tmp_path / "b")
    con = duckdb.connect(str(reversed_cat.path))
    keys = {
        "checkpoints": "checkpoint_id",
        "family_tensors": "base_id, tensor_idx",
        "blocks": "base_id, tensor_idx, block_idx",
        "expert_tensors": "checkpoint_id, tensor_idx",
    }
    for table, key in keys.items():
        desc = ", ".join(f"{k} DESC" for k in key.split(", "))
        con.execute(f"CREATE TEMP TABLE old AS SELECT * FROM {table}")
        con.execute(f"DELETE FROM {table}")
        con.execute(f"INSERT INTO {table} SELECT * FROM old ORDER BY {desc}")
        con.execute("DROP TABLE old")
    order = con.execute("SELECT tensor_idx, block_idx FROM blocks").fetchall()
    con.close()
    assert order == sorted(order, reverse=True) and order != sorted(order)  # the scans do come reversed
    after = [(p.plan_hash, _stored(reversed_cat, p.plan_id)) for p in map(reversed_cat.plan, REQUESTS)]
    assert after == before


def test_a_failed_store_leaves_no_plan_rows(catalog_file, tmp_path, monkeypatch):
    """The plans row is written last, after the experts, thresholds and mask: a failure there rolls
    every table back, and the next plan takes the id the failed one would have had."""
    cat = _copy(catalog_file, tmp_path)

    def fail(con, table, row):
        assert con.execute("SELECT count(*) FROM plan_mask_bits").fetchall()[0][0] > 0  # written by now
        raise OSError("disk full while writing the plans row")

    monkeypatch.setattr(planner, "_insert", fail)
    with pytest.raises(OSError, match="disk full"):
        cat.plan(REQUESTS[1])
    monkeypatch.undo()
    for table in PLAN_TABLES:
        assert cat.sql(f"SELECT count(*) AS n FROM {table}").to_pylist() == [{"n": 0}], table
    assert cat.plan(REQUESTS[1]).plan_id == 1


def test_nonfinite_refusal_names_the_first_expert_and_tensor_by_name(tmp_path):
    """Several experts with NaN/Inf deltas: the error names the first by expert name, then tensor
    name (not by id: names here sort in another order than ids), with that pair's count summed
    over its blocks."""
    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 3, 3, 2, block_bytes=1000, seed=4)
    base, e0, e1, e2 = (c.name for c in cat.checkpoints()[:4])
    con = duckdb.connect(str(cat.path))
    ids = dict(con.execute("SELECT name, checkpoint_id FROM checkpoints").fetchall())
    con.execute("UPDATE checkpoints SET name = 'a_expert' WHERE checkpoint_id = ?", [ids[e2]])  # first by name
    con.execute("UPDATE family_tensors SET name = 'z' WHERE tensor_idx = 0")  # tensor 0 sorts last
    for cid, tensor, block, n in [(ids[e2], 0, 0, 5), (ids[e2], 2, 0, 3), (ids[e2], 2, 1, 4), (ids[e1], 1, 1, 2)]:
        con.execute(
            "UPDATE expert_blocks SET nonfinite = ? WHERE checkpoint_id = ? AND tensor_idx = ? AND block_idx = ?",
            [n, cid, tensor, block],
        )
    con.close()
    with pytest.raises(PlanError, match="expert 'a_expert' has 7 NaN/Inf values in tensor 't2'"):
        cat.plan(PlanRequest(base, (e1, "a_expert", e0), "task_arithmetic"))
    with pytest.raises(PlanError, match=f"expert '{e1}' has 2 NaN/Inf values in tensor 't1'"):
        cat.plan(PlanRequest(base, (e0, e1), "task_arithmetic"))
    p = cat.plan(PlanRequest(base, None, "task_arithmetic", allow_nonfinite=True))
    assert p.n_candidates == 3 * 3 * 2 - 4  # the blocks with NaN/Inf are left out


SUMMARY_REQUESTS = [
    *REQUESTS,
    PlanRequest("base", None, "linear", "all", name="named"),
    PlanRequest("base", None, "task_arithmetic", 0, params={"lambda": 1}),  # ints where DOUBLE is stored
    PlanRequest("base", None, "dare_ties", "10%", strategy="random", seed=3),
    PlanRequest("base", None, "ties", "40%", params={"density": 0.2}, value_model="consensus", min_coverage=0),
    PlanRequest("base", None, "della_linear", "20%", weights=(1, 0.5, 2)),
    PlanRequest("base", None, "model_stock", "all"),
    PlanRequest("base", None, "task_arithmetic", "15%", estimate=True),
    PlanRequest("base", None, "task_arithmetic", "15%", estimate=False),
]


@pytest.mark.parametrize("req", SUMMARY_REQUESTS, ids=lambda r: f"{r.method}-{r.budget}")
def test_the_summary_a_plan_returns_is_the_one_read_back(catalog_file, tmp_path, req):
    """Catalog.plan, frontier and sweeps' grids return the summary built from the values the planner
    wrote, not read back (two statements, ~5 ms of a small plan): it must equal what load_plan reads
    from the rows, field by field and type by type (an int where DuckDB gives a float, or numpy's
    scalars, would print or serialise otherwise)."""
    cat = _copy(catalog_file, tmp_path)
    made = cat.plan(req)
    read = cat.get_plan(made.plan_id)
    assert made == read

    def typed(s) -> list:
        flat = [(f, type(v)) for f, v in vars(s).items() if f != "experts"]
        return flat + [[(f, type(v)) for f, v in vars(e).items()] for e in s.experts]

    assert typed(made) == typed(read)
    (kept,) = cat.frontier(req, [req.budget], keep=True)
    assert kept == cat.get_plan(kept.plan_id) and typed(kept) == typed(cat.get_plan(kept.plan_id))
