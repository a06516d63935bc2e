"""Every statistic in the catalog against numpy on whole tensors (tests/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from mergedb import stats
from tests.conftest import BLOCK_SIZE
from tests.reference import block_rows, kth_largest, load_model, load_raw

EXPERTS = ["expert_00", "expert_01", "expert_02"]


@pytest.fixture(scope="module")
def models(family):
    kind, folder, cat = family
    return {n: load_model(folder / n) for n in ["base", *EXPERTS]}


def _blocks(cat, expert):
    return cat.sql(
        """SELECT ft.name, eb.block_idx, bl.row_start, bl.row_end, eb.identical, eb.delta_norm, eb.max_abs,
                  eb.nnz, eb.nonfinite, eb.hist_lo, eb.hist_hi, eb.hist_count, eb.hist_sum, eb.hist_sumsq, eb.sketch,
                  eb.base_dot, eb.content_hash, bl.base_hash
           FROM expert_blocks eb JOIN checkpoints c USING (checkpoint_id)
           JOIN family_tensors ft ON ft.base_id = c.base_id AND ft.tensor_idx = eb.tensor_idx
           JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
           WHERE c.name = ? ORDER BY eb.tensor_idx, eb.block_idx""",
        [expert],
    ).to_pylist()


def test_block_layout_matches_definition(family, models):
    kind, folder, cat = family
    rows = cat.sql(
        "SELECT ft.name, ft.dtype, list(struct_pack(r0 := row_start, r1 := row_end) ORDER BY block_idx) AS b "
        "FROM blocks JOIN family_tensors ft USING (base_id, tensor_idx) GROUP BY ft.name, ft.dtype"
    ).to_pylist()
    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}
    assert len(rows) == len(models["base"])
    for r in rows:
        expect = block_rows(models["base"][r["name"]].shape, itemsize[r["dtype"]], BLOCK_SIZE[kind])
        assert [(b["r0"], b["r1"]) for b in r["b"]] == expect, r["name"]
    assert any(len(r["b"]) > 1 for r in rows), "the fixture should exercise multi-block tensors"


@pytest.mark.parametrize("expert", EXPERTS)
def test_block_statistics_exact(family, models, expert):
    kind, folder, cat = family
    base, exp = models["base"], models[expert]
    raw_b, raw_e = load_raw(folder / "base"), load_raw(folder / expert)
    rows = _blocks(cat, expert)
    seen_identical = seen_changed = 0
    for r in rows:
        b = base[r["name"]].reshape(base[r["name"]].shape[0] if base[r["name"]].ndim > 1 else 1, -1)
        e = exp[r["name"]].reshape(b.shape)
        b_blk = b[r["row_start"] : r["row_end"]].astype(np.float32).reshape(-1)
        d = (e[r["row_start"] : r["row_end"]] - b[r["row_start"] : r["row_end"]]).astype(np.float32).reshape(-1)
        row_bytes = len(raw_b[r["name"]]) // b.shape[0]
        sl = slice(r["row_start"] * row_bytes, r["row_end"] * row_bytes)
        identical = raw_b[r["name"]][sl] == raw_e[r["name"]][sl]
        assert r["identical"] == identical
        # the block's hash is xxh3-128 of the expert's bytes; an unchanged block's is the base block's
        assert r["content_hash"] == xxhash.xxh3_128_hexdigest(raw_e[r["name"]][sl]), r["name"]
        assert r["base_hash"] == xxhash.xxh3_128_hexdigest(raw_b[r["name"]][sl]), r["name"]
        seen_identical += identical
        seen_changed += not identical
        np.testing.assert_allclose(r["delta_norm"], np.sqrt(np.sum(d.astype(np.float64) ** 2)), rtol=1e-12, atol=0)
        assert r["max_abs"] == (np.abs(d).max() if d.size else 0)
        assert r["nnz"] == np.count_nonzero(d)
        assert r["nonfinite"] == 0
        # ⟨θ₀,b, Δ_b⟩: float64 products of the decoded base and the float32 delta, summed in float64
        terms = b_blk.astype(np.float64) * d.astype(np.float64)
        assert abs(r["base_dot"] - terms.sum()) <= 1e-10 * np.abs(terms).sum(), r["name"]
        # histogram: counts and sums per bin, bins from their stored edges
        a = np.abs(d)
        if identical:
            assert r["hist_count"] == []
            continue
        for lo, hi, cnt, s, sq in zip(r["hist_lo"], r["hist_hi"], r["hist_count"], r["hist_sum"], r["hist_sumsq"]):
            inside = a[(a >= lo) & (a < hi)]
            assert cnt == inside.size
            np.testing.assert_allclose(s, inside.astype(np.float64).sum(), rtol=1e-9)
            np.testing.assert_allclose(sq, (inside.astype(np.float64) ** 2).sum(), rtol=1e-9)
        assert sum(r["hist_count"]) == a.size
    assert seen_identical and seen_changed, "the family should have frozen and changed blocks"
    # the checkpoint's content hash: xxh3-128 over the hashes (hex digits) of its bytes of every block of
    # the family (non-mergeable tensors' too, which have no expert_blocks rows), in (tensor, block) order
    layout = cat.sql(
        "SELECT ft.name, bl.row_start, bl.row_end FROM blocks bl JOIN family_tensors ft USING (base_id, tensor_idx) "
        "ORDER BY bl.tensor_idx, bl.block_idx"
    ).to_pylist()
    stream = xxhash.xxh3_128()
    for r in layout:
        b = base[r["name"]]
        row_bytes = len(raw_e[r["name"]]) // (b.shape[0] if b.ndim > 1 else 1)
        piece = raw_e[r["name"]][r["row_start"] * row_bytes : r["row_end"] * row_bytes]
        stream.update(xxhash.xxh3_128_hexdigest(piece).encode())
    assert len(layout) > len(rows), "the family should have a tensor that is not merged"
    stored = cat.sql("SELECT content_hash FROM checkpoints WHERE name = ?", [expert]).column(0)[0].as_py()
    assert stored == stream.hexdigest()


@pytest.mark.parametrize("expert", EXPERTS)
def test_grid_thresholds_exact_and_summary_within_1pct(family, models, expert):
    kind, folder, cat = family
    rows = cat.sql(
        "SELECT ft.name, et.identical, (SELECT list(density ORDER BY grid_idx) FROM density_grid) AS grid_density, "
        "et.grid_threshold, et.summary_code, et.summary_count, ft.numel "
        "FROM expert_tensors et JOIN checkpoints c USING (checkpoint_id) "
        "JOIN family_tensors ft ON ft.base_id = c.base_id AND ft.tensor_idx = et.tensor_idx WHERE c.name = ?",
        [expert],
    ).to_pylist()
    assert rows
    for r in rows:
        a = np.abs((models[expert][r["name"]] - models["base"][r["name"]]).astype(np.float32)).reshape(-1)
        assert r["grid_density"] == list(stats.DENSITY_GRID)
        for dens, thr in zip(r["grid_density"], r["grid_threshold"]):
            assert np.float32(thr) == kth_largest(a, dens), (r["name"], dens)
        if r["identical"]:
            continue
        for dens in (0.0137, 0.0333, 0.05, 0.123, 0.2718, 0.5, 0.777):
            exact = float(kth_largest(a, dens))
            derived = stats.threshold_from_summary(
                np.array(r["summary_code"]), np.array(r["summary_count"]), r["numel"], dens
            )
            if exact == 0:
                assert derived == 0
            else:  # the lower edge of the k-th largest's bin: never above it, less than a bin below
                assert derived <= exact < derived * (1 + 2**-6), (r["name"], dens, derived, exact)


def test_histogram_estimates_survival_mass(family, models):
    """Σ of bins at or above a bin edge is the exact mass at or above that edge."""
    kind, folder, cat = family
    for r in _blocks(cat, "expert_00"):
        if r["identical"] or len(r["hist_lo"]) < 3:
            continue
        b = models["base"][r["name"]]
        b2 = b.reshape(b.shape[0] if b.ndim > 1 else 1, -1)
        e2 = models["expert_00"][r["name"]].reshape(b2.shape)
        a = np.abs(e2[r["row_start"] : r["row_end"]] - b2[r["row_start"] : r["row_end"]]).reshape(-1)
        t = r["hist_lo"][len(r["hist_lo"]) // 2]
        est_count = sum(c for lo, c in zip(r["hist_lo"], r["hist_count"]) if lo >= t)
        est_sq = sum(q for lo, q in zip(r["hist_lo"], r["hist_sumsq"]) if lo >= t)
        assert est_count == np.count_nonzero(a >= t)
        np.testing.assert_allclose(est_sq, np.sum(a[a >= t].astype(np.float64) ** 2), rtol=1e-9)


def test_sketch_linearity_and_inner_products(family, models):
    kind, folder, cat = family
    dim = int(cat.sql("SELECT value FROM settings WHERE key = 'sketch_dim'").column(0)[0].as_py())
    assert dim == stats.DEFAULT_SKETCH_DIM
    sketches = {e: {(r["name"], r["block_idx"]): (r, np.array(r["sketch"])) for r in _blocks(cat, e)} for e in EXPERTS}
    checked = 0
    within = total = 0
    for (name, bidx), (r, sk0) in sketches["expert_00"].items():
        b = models["base"][name].reshape(models["base"][name].shape[0] if models["base"][name].ndim > 1 else 1, -1)
        blk = slice(r["row_start"], r["row_end"])
        key = stats.sketch_key(name, bidx)
        deltas = {}
        for e in EXPERTS:
            e2 = models[e][name].reshape(b.shape)
            deltas[e] = (e2[blk] - b[blk]).astype(np.float32).reshape(-1)
        # linearity: sketch(θ_k) − sketch(θ_0) = sketch(Δ_k), and the stored sketch is sketch(Δ_k)
        lin = stats.sketch(models["expert_00"][name].reshape(b.shape)[blk], key, dim) - stats.sketch(b[blk], key, dim)
        np.testing.assert_allclose(lin, stats.sketch(deltas["expert_00"], key, dim), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(sk0, stats.sketch(deltas["expert_00"], key, dim), rtol=1e-5, atol=1e-7)
        checked += 1
        # inner products: unbiased, std ≤ sqrt((‖a‖²‖b‖² + ⟨a,b⟩²)/D) (CountSketch)
        for e in EXPERTS[1:]:
            a_, b_ = deltas["expert_00"], deltas[e]
            exact = float(np.dot(a_.astype(np.float64), b_.astype(np.float64)))
            est = float(np.dot(sk0.astype(np.float64), sketches[e][(name, bidx)][1].astype(np.float64)))
            sigma = np.sqrt((np.dot(a_, a_) * np.dot(b_, b_) + exact**2) / dim)
            assert abs(est - exact) <= 5 * sigma + 1e-12
            total += 1
            within += abs(est - exact) <= sigma + 1e-12
    assert checked > 5
    assert within >= 0.55 * total  # about 68% of estimates fall within one stated standard deviation


def test_sketch_is_unbiased_on_random_vectors():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(4096)
    b = 0.5 * a + rng.standard_normal(4096)
    ests = [
        float(np.dot(stats.sketch(a, stats.sketch_key("t", i)), stats.sketch(b, stats.sketch_key("t", i))))
        for i in range(400)
    ]
    exact = float(np.dot(a, b))
    sigma = np.sqrt((np.dot(a, a) * np.dot(b, b) + exact**2) / stats.DEFAULT_SKETCH_DIM)
    assert abs(np.mean(ests) - exact) < 4 * sigma / np.sqrt(len(ests))
    assert 0.7 * sigma < np.std(ests) < 1.3 * sigma


def test_base_dot_nan_only_where_delta_not_finite(tmp_path):
    """A NaN/Inf in Δ makes that block's base_dot NaN (as delta_norm); the tensor's other blocks stay exact."""
    from safetensors.torch import load_file, save_file

    from mergedb import synth
    from mergedb.catalog import Catalog

    fam = synth.make_family(tmp_path / "f", experts=1, size="tiny", seed=5)
    name = "model.layers.0.mlp.up_proj.weight"
    path = fam / "expert_00" / "model.safetensors"
    tensors = load_file(str(path))
    w = tensors[name].clone()
    w[0, 3] = float("nan")
    w[1, 0] = float("inf")
    tensors[name] = w
    save_file(tensors, str(path), metadata={"format": "pt"})
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size=4096)
    base = load_model(fam / "base")[name]
    rows = cat.sql(
        "SELECT eb.block_idx, bl.row_start, bl.row_end, eb.nonfinite, eb.base_dot FROM expert_blocks eb "
        "JOIN family_tensors ft USING (tensor_idx) JOIN blocks bl USING (tensor_idx, block_idx) "
        "WHERE ft.name = ? ORDER BY eb.block_idx",
        [name],
    ).to_pylist()
    assert len(rows) > 1 and rows[0]["row_start"] == 0 and rows[0]["row_end"] > 1
    for r in rows:
        b = base[r["row_start"] : r["row_end"]].astype(np.float64).reshape(-1)
        d = (w.float().numpy()[r["row_start"] : r["row_end"]] - base[r["row_start"] : r["row_end"]]).reshape(-1)
        if r["block_idx"] == 0:
            assert r["nonfinite"] == 2 and np.isnan(r["base_dot"])
        else:
            terms = b * d.astype(np.float32).astype(np.float64)
            assert r["nonfinite"] == 0
            assert abs(r["base_dot"] - terms.sum()) <= 1e-10 * np.abs(terms).sum()


def test_expert_costs_view(family, models):
    kind, folder, cat = family
    rows = {r["expert"]: r for r in cat.sql("SELECT * FROM expert_costs").to_pylist()}
    assert set(rows) == set(EXPERTS)
    for e in EXPERTS:
        total = sum(
            np.linalg.norm((models[e][n] - models["base"][n]).astype(np.float32).astype(np.float64)) ** 2
            for n in models[e]
            if models[e][n].dtype.kind == "f"
        )
        np.testing.assert_allclose(rows[e]["delta_norm"], np.sqrt(total), rtol=1e-9)
        assert rows[e]["changed_bytes"] < rows[e]["total_bytes"]


@pytest.mark.parametrize("block_size,limit", [("4MiB", 0.01), ("auto", 0.02)])
def test_metadata_small_relative_to_checkpoints(tmp_path, block_size, limit):
    """Per-expert statistics, uncompressed, stay under 1% of the expert's bytes at 4 MiB blocks
    (small family), and under 2% with `--block-size auto`: there the small family's embedding
    and LM head (40% of its bytes, 1 KiB rows) are 64 KiB blocks, each with ~1.5 KB of rows.

    This counts the rows' Arrow size (DuckDB stores them compressed, so the file grows by less);
    DuckDB's fixed per-file overhead (a few MiB of 256 KiB blocks) is not per-expert metadata.
    benchmarks/ records the file-size ratio on a bench-size family.
    """
    from mergedb import synth
    from mergedb.catalog import Catalog

    fam = synth.make_family(tmp_path / "f", experts=2, size="small", seed=1)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size=block_size)
    for e in ("expert_00", "expert_01"):
        rows = sum(
            cat.sql(f"SELECT t.* FROM {t} t JOIN checkpoints c USING (checkpoint_id) WHERE c.name = ?", [e]).nbytes
            for t in ("expert_blocks", "expert_tensors", "tensors", "files")
        )
        assert rows < limit * cat.checkpoint(e).bytes, (e, rows, cat.checkpoint(e).bytes)


def test_density_grid_table_matches_library(family):
    kind, folder, cat = family
    grid = cat.sql("SELECT density FROM density_grid ORDER BY grid_idx").column(0).to_pylist()
    assert grid == list(stats.DENSITY_GRID)
