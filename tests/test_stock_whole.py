"""model_stock planned by whole tensors (tensorunit.py): every tensor of a budgeted merge is the base's
or the full merge's, so the merge is never farther from the full merge than the base is.

The family: K = 8 experts of six (64, 256) float32 tensors, 8 KiB blocks (8 rows each); every expert's
delta is its own noise at a per-block scale plus a weak shared direction, so each tensor's mean
pairwise cosine is near 0, where t = K·cos/(1 + (K−1)·cos) is steep. Planned per block (before
2026-12-02), t came from the sketches' dots for pairs not both read, and at 10% and 25% the merge lay
1.17 and 1.26 × ‖θ_F − θ_0‖ from the full merge (benchmarks/ANALYSIS.md, 2026-12-02).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mergedb import executor, planhash, plans
from mergedb.catalog import Catalog
from mergedb.errors import PlanError
from mergedb.planner import PlanRequest
from tests.reference import load_model

K, ROWS, COLS, BLOCK_ROWS = 8, 64, 256, 8
SHARED = (0.0, 0.03, 0.06, 0.0, 0.03, 0.06)  # weight of the shared direction per tensor
ESTIMATE_FACTOR = 4.0  # measured on this family at 10–75%: 1.7–2.9× high (the sketches resolve c to ~0.006)


def make_family(folder: Path, seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    names = [f"model.layers.{i}.mlp.weight" for i in range(len(SHARED))]
    base = {n: rng.standard_normal((ROWS, COLS)).astype(np.float32) for n in names}
    experts: list[dict[str, np.ndarray]] = [{} for _ in range(K)]
    for n, share in zip(names, SHARED):
        scale = 0.01 * np.exp(rng.normal(0, 0.7, size=(ROWS // BLOCK_ROWS, 1))).repeat(BLOCK_ROWS, 0)  # (rows, 1)
        shared = rng.standard_normal((ROWS, COLS))
        for k in range(K):
            experts[k][n] = (base[n] + scale * (share * shared + rng.standard_normal((ROWS, COLS)))).astype(np.float32)
    for name, tensors in [("base", base)] + [(f"expert_{k}", e) for k, e in enumerate(experts)]:
        (folder / name).mkdir(parents=True)
        save_file(tensors, str(folder / name / "model.safetensors"), metadata={"format": "pt"})
    return base, experts


def textbook_model_stock(base: np.ndarray, experts: list[np.ndarray]) -> np.ndarray:
    """θ₀ + t·Σ_k Δ_k/K over the whole tensor, t = K·c/(1 + (K−1)·c), c the mean pairwise cosine of
    the Δ_k (float64)."""
    b = base.astype(np.float64)
    deltas = [e.astype(np.float64) - b for e in experts]
    c = np.mean([np.sum(x * y) / np.linalg.norm(x) / np.linalg.norm(y) for x, y in itertools.combinations(deltas, 2)])
    t = len(deltas) * c / (1 + (len(deltas) - 1) * c)
    return b + t * sum(deltas) / len(deltas)


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("stock-whole")
    base, experts = make_family(root / "family")
    cat = Catalog(root / "catalog.duckdb")
    cat.register([root / "family"], base_model="base", block_size=BLOCK_ROWS * COLS * 4)
    full = {n: textbook_model_stock(b, [e[n] for e in experts]) for n, b in base.items()}
    return root, cat, base, full


def _merge(cat: Catalog, plan, out: Path) -> tuple[dict[str, np.ndarray], int]:
    res = executor.execute(cat.execution_plan(plan.plan_id), out, dtype="fp32")
    return load_model(out), res.expert_bytes


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum((a[n].astype(np.float64) - b[n]) ** 2)) for n in b))


def _is_full(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal to the float64 reference within float32 rounding (|θ| ≈ 1, so a few ulps of 1)."""
    return bool(np.max(np.abs(got.astype(np.float64) - want)) < 2e-6)


@pytest.mark.parametrize("budget", ["10%", "25%", "50%", "75%"])
def test_budgeted_tensors_are_base_or_full_and_never_farther_than_the_base(fam, budget, tmp_path):
    _, cat, base, full = fam
    plan = cat.plan(PlanRequest("base", None, "model_stock", budget))
    got, read = _merge(cat, plan, tmp_path / "out")
    kept = {n for n in base if np.array_equal(got[n], base[n])}
    for n in base:
        assert n in kept or _is_full(got[n], full[n]), n  # whole: the base's, or the full merge's
    assert read == plan.selected_bytes <= plan.budget_bytes
    # every expert's non-free blocks of a read tensor: read bytes = K × the tensor's bytes here
    assert plan.selected_bytes == K * ROWS * COLS * 4 * (len(base) - len(kept))
    measured, from_base = _distance(got, full), _distance(base, full)
    omitted = math.sqrt(sum(float(np.sum((full[n] - base[n]) ** 2)) for n in kept))
    assert measured <= from_base * (1 + 1e-6)
    assert measured == pytest.approx(omitted, rel=1e-4, abs=1e-6)  # exactly the omitted tensors' updates
    assert plan.est_kind == "omitted tensors, sketched"
    if kept:
        assert measured / ESTIMATE_FACTOR <= plan.est_error <= measured * ESTIMATE_FACTOR, (plan.est_error, measured)
    else:
        assert plan.est_error == 0.0


def test_some_budget_reads_part_of_the_model(fam, tmp_path):
    """The family is not degenerate for the test above: a middle budget reads some tensors, not all."""
    _, cat, base, full = fam
    got, _ = _merge(cat, cat.plan(PlanRequest("base", None, "model_stock", "50%")), tmp_path / "out")
    kept = [n for n in base if np.array_equal(got[n], base[n])]
    assert 0 < len(kept) < len(base)


def test_full_budget_is_the_full_merge_and_zero_the_base(fam, tmp_path):
    _, cat, base, full = fam
    got, _ = _merge(cat, cat.plan(PlanRequest("base", None, "model_stock", "all")), tmp_path / "all")
    assert all(_is_full(got[n], full[n]) for n in base)
    zero = cat.plan(PlanRequest("base", None, "model_stock", "0"))
    got, read = _merge(cat, zero, tmp_path / "zero")
    assert read == zero.selected_bytes == 0
    assert all(np.array_equal(got[n], base[n]) for n in base)
    assert zero.est_error == pytest.approx(_distance(base, full), rel=ESTIMATE_FACTOR)


def test_random_ablation_selects_whole_tensors_too(fam, tmp_path):
    """The random baseline orders tensors at random, but by the same unit (the ablation isolates the
    ranking, not the unit)."""
    _, cat, base, full = fam
    plan = cat.plan(PlanRequest("base", None, "model_stock", "50%", strategy="random", seed=3))
    got, read = _merge(cat, plan, tmp_path / "out")
    assert read <= plan.budget_bytes
    assert all(np.array_equal(got[n], base[n]) or _is_full(got[n], full[n]) for n in base)


def test_min_coverage_is_refused_for_whole_tensor_plans(fam):
    _, cat, _, _ = fam
    with pytest.raises(PlanError, match="plans whole tensors"):
        cat.plan(PlanRequest("base", None, "model_stock", "50%", min_coverage=0.2))


def stored_hash_args(cat, plan_id: int) -> tuple:
    """planhash.plan_hash's arguments (all but the unit) from a stored plan's rows, its thresholds keyed
    by checkpoint id as plans were hashed before 2026-12-03: older hash forms made again in tests."""
    xp = cat.execution_plan(plan_id)
    with cat.duckdb_connection() as con:
        trims = con.sql(
            "SELECT checkpoint_id, tensor_idx, t_lo, t_hi, exact FROM plan_thresholds WHERE plan_id = $1 "
            "ORDER BY checkpoint_id, tensor_idx",
            params=[plan_id],
        ).to_arrow_table()
    experts = [(e.fingerprint, e.content_hash, e.weight) for e in xp.experts]
    base = (xp.base.fingerprint, xp.base.content_hash)
    mask = planhash.mask_digest(xp.mask)
    return (xp.method, xp.params, xp.seed, xp.budget_bytes, "ranked", base, experts, trims, mask, None)


def test_a_plan_hashed_per_block_still_verifies(fam):
    """A model_stock plan stored before 2026-12-02 was hashed without a unit; its rows still give its
    hash (refuse_altered tries the per-block description), and a new plan's hash names the unit."""
    _, cat, _, _ = fam
    plan = cat.plan(PlanRequest("base", None, "model_stock", "25%", name="old-style"))
    args = stored_hash_args(cat, plan.plan_id)
    assert planhash.plan_hash(*args, "tensor") == plan.plan_hash
    per_block = planhash.plan_hash(*args)
    assert per_block != plan.plan_hash
    with cat.duckdb_connection(write=True) as con:
        con.execute("UPDATE plans SET plan_hash = ? WHERE plan_id = ?", [per_block, plan.plan_id])
    assert cat.execution_plan(plan.plan_id).plan_hash == per_block


def test_tensor_updates_hold_a_chunk_of_blocks_not_the_whole_model(monkeypatch):
    """tensorunit.updates summed the sketches' dots through a (blocks, K, D) array and a (blocks, K, K)
    product over every block of the model at once (second-look review: 1 GB at K = 128 for 3,000
    blocks, ~264 GB at K = 1,000 on a 70B layout). Now one tensor at a time in chunks of blocks:
    the peak of Python-side allocations stays near the sketches' own bytes, and one tensor's value is
    |t(c)|·‖Σ_k Δ_k‖/K from the dots summed in full (the textbook sum, here over random sketches)."""
    import tracemalloc

    import duckdb
    import pyarrow as pa

    from mergedb import bounds, tensorunit

    k, n_blocks, dim = 48, 1500, 64
    rng = np.random.default_rng(5)
    sk = rng.standard_normal((n_blocks, k, dim)).astype(np.float32)
    sk[rng.random((n_blocks, k)) < 0.2] = 0  # unchanged (expert, block): no row
    norm = np.linalg.norm(sk.astype(np.float64), axis=2) * rng.uniform(0.8, 1.2, (n_blocks, k))
    b_idx, pos = np.nonzero(norm * (np.abs(sk).sum(axis=2) > 0))
    con = duckdb.connect()
    rows = {
        "checkpoint_id": pos.astype(np.int32) + 1,
        "tensor_idx": np.zeros(b_idx.size, np.int32),
        "block_idx": b_idx.astype(np.int32),
        "identical": np.zeros(b_idx.size, bool),
        "nonfinite": np.zeros(b_idx.size, np.int64),
        "delta_norm": norm[b_idx, pos],
    }
    offsets = pa.array(np.arange(b_idx.size + 1, dtype=np.int32) * dim)
    sketch = pa.ListArray.from_arrays(offsets, pa.array(sk[b_idx, pos].reshape(-1)))
    con.register("frame", pa.table({**rows, "sketch": sketch}))
    con.execute("CREATE TABLE expert_blocks AS SELECT * FROM frame")
    con.unregister("frame")
    fam = bounds.FamilyBlocks(
        first_block=np.array([0, n_blocks]),
        tensor_idx=np.zeros(n_blocks, np.int64),
        nbytes=np.full(n_blocks, 4096, np.int64),
        dtype=np.array(["F32"] * n_blocks, object),
        base_norm=np.ones(n_blocks),
        numel=np.full(n_blocks, 1024.0),
        base_nonfinite=np.zeros(n_blocks),
    )
    monkeypatch.setattr(tensorunit, "CHUNK_BYTES", 2**20)
    tracemalloc.start()
    value = tensorunit.updates(con, tuple(range(1, k + 1)), fam, False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    sketch_bytes = b_idx.size * dim * 4
    assert peak < 1.5 * sketch_bytes + 8 * 2**20, (peak, sketch_bytes)  # the old arrays: ~8× the sketches
    s = sk.astype(np.float64)
    gram = np.einsum("bjd,bkd->jk", s, s)
    n2 = (norm**2 * (np.abs(sk).sum(axis=2) > 0)).sum(axis=0)
    gram[np.diag_indices(k)] = n2
    cos = gram / np.sqrt(np.outer(n2, n2))
    c = (cos.sum() - np.trace(cos)) / (k * (k - 1))
    t = k * c / (1 + (k - 1) * c)  # one tensor: its ĉ is the model's mean, nothing to shrink
    assert value[0] == pytest.approx(abs(t) * math.sqrt(gram.sum()) / k, rel=1e-9)


def test_a_nan_block_left_out_does_not_change_t_for_the_rest_of_its_tensor(tmp_path):
    """allow_nonfinite leaves a block whose Δ holds a NaN out of the merge: Δ is 0 there, for t's dots
    and norms too. Before, that block's NaN norm made its expert's cosine to every other expert 0,
    and t (0.39 instead of 0.72 here) was silently wrong for the whole tensor."""
    rng = np.random.default_rng(4)
    base = rng.normal(0, 1, (32, 16)).astype(np.float32)
    shared = rng.normal(0, 0.01, (32, 16))
    deltas = [(shared + rng.normal(0, 0.01, (32, 16))).astype(np.float32) for _ in range(3)]  # correlated
    experts = [base + d for d in deltas]
    for name, w in [("base", base)] + [(f"expert_{i:02d}", e) for i, e in enumerate(experts)]:
        (tmp_path / "fam" / name).mkdir(parents=True)
        w = w.copy()
        if name == "expert_01":
            w[5, 3] = np.nan  # in block 0 (rows 0-7 at 512 B blocks)
        save_file({"n.w": w}, str(tmp_path / "fam" / name / "model.safetensors"))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base", block_size=512)
    plan = cat.plan(PlanRequest("base", None, "model_stock", "all", allow_nonfinite=True))
    got, _ = _merge(cat, plan, tmp_path / "out")
    merged = [e.copy() for e in experts]
    merged[1][0:8] = base[0:8]  # the block left out: that expert's Δ is 0 there
    want = textbook_model_stock(base, merged)
    assert _is_full(got["n.w"], want)


def test_a_non_finite_dot_is_refused_not_read_as_a_cosine_of_zero(tmp_path, monkeypatch):
    """StockDots.t refuses norms or dots that are not finite (a NaN compared > 0 is False, and such a
    pair silently counted as orthogonal); nothing is installed."""
    import pyarrow as pa

    from mergedb.errors import MergeDBError

    rng = np.random.default_rng(1)
    base = rng.normal(0, 1, (16, 16)).astype(np.float32)
    for name, w in [("base", base)] + [(f"expert_{i}", base + 0.01 * rng.normal(size=base.shape)) for i in range(3)]:
        (tmp_path / "fam" / name).mkdir(parents=True)
        save_file({"n.w": w.astype(np.float32)}, str(tmp_path / "fam" / name / "model.safetensors"))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "model_stock", "all"))
    real = plans._stock_dots

    def nan_norms(*a):
        t = real(*a)
        return t.set_column(3, "dot", pa.array([float("nan")] * t.num_rows, pa.float64()))

    monkeypatch.setattr(plans, "_stock_dots", nan_norms)
    with pytest.raises(MergeDBError, match="n.w: the task vectors' norms or dots are not finite"):
        _merge(cat, plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()
