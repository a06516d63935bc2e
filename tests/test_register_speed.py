"""Registration's faster paths change no stored value: the three-level radix select against a full
sort, and the catalog rows for every thread count (one pool over all (expert, tensor) units)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergedb import stats, summary, synth
from mergedb.catalog import Catalog


def _sorted_kth(a: np.ndarray, density: float) -> np.float32:
    """k-th largest finite |Δ| by a full sort; NaN when k passes the finite elements."""
    finite = np.sort(a[np.isfinite(a)])[::-1]
    k = max(1, int(density * a.size))
    return finite[k - 1] if k <= finite.size else np.float32(np.nan)


def _summary(a: np.ndarray) -> np.ndarray:
    """The magnitude summary as block_stats builds it: finite |Δ| by the top 15 bits."""
    bits = a[np.isfinite(a)].view(np.uint32) >> np.uint32(stats.SUMMARY_SHIFT)
    return np.bincount(bits, minlength=stats.SUMMARY_BINS).astype(np.int64)


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties away), kept as float32."""
    bits = (x.astype(np.float32).view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    scale=st.sampled_from([1e-38, 1e-6, 1e-3, 1.0]),  # 1e-38: zeros and subnormals
    distinct=st.integers(1, 12),
    n=st.integers(1, 3000),
    frozen=st.floats(0.0, 0.9),
    nonfinite=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_grid_thresholds_equal_full_sort_on_bf16_deltas(scale, distinct, n, frozen, nonfinite, seed):
    rng = np.random.default_rng(seed)
    base = _bf16(rng.normal(0, 0.02, n))
    steps = _bf16(rng.normal(0, scale, distinct))  # a bf16 fine-tune moves weights by few distinct steps
    expert = _bf16(base + steps[rng.integers(0, distinct, n)])
    expert[: int(frozen * n)] = base[: int(frozen * n)]  # exact zeros in Δ
    if nonfinite:
        expert[rng.integers(0, n, nonfinite)] = [np.nan, np.inf, -np.inf][:nonfinite]
    a = np.abs(expert - base).astype(np.float32)
    got = stats.grid_thresholds(a.copy(), _summary(a))
    want = np.array([_sorted_kth(a, d) for d in stats.DENSITY_GRID], np.float32)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(
    n=st.one_of(st.integers(0, 5000), st.integers(0, 2**53 - 1)),
    extra=st.lists(st.floats(0.0, 1.0), max_size=20),
)
def test_kth_counts_equal_the_scalar_rule(n, extra):
    """The grid's k for every density at once (grid_thresholds' _wanted) is mergekit's rule,
    max(1, int(density·n)), computed one density at a time in Python."""
    densities = np.concatenate([stats.DENSITY_GRID, np.array(extra, np.float64)])
    want = [max(1, int(d * n)) for d in densities.tolist()]
    assert summary.kth_counts(densities, n).tolist() == want


def _exceptions(a: np.ndarray, cap: int) -> stats.Exceptions:
    """The exceptions as defined: patterns of finite |Δ| whose low 17 bits are not all zero."""
    bits = a[np.isfinite(a)].view(np.uint32)
    exc = bits[(bits & np.uint32(0x1FFFF)) != 0]
    out = stats.Exceptions(cap)
    out.buf[: min(cap, exc.size)] = exc[:cap]
    out.n = exc.size
    return out


@settings(max_examples=60, deadline=None)
@given(
    scale=st.sampled_from([1e-38, 1e-6, 1e-3, 1.0]),
    distinct=st.integers(1, 12),
    n=st.integers(1, 3000),
    nonfinite=st.integers(0, 3),
    fp32=st.booleans(),  # full float32 mantissas: every element is an exception
    seed=st.integers(0, 2**32 - 1),
)
def test_grid_thresholds_from_exceptions_equal_full_sort(scale, distinct, n, nonfinite, fp32, seed):
    """Without any pass over |Δ| (the exceptions complete) and with the radix fallback (too many);
    and the sort registration uses for small tensors (stats.sorted_thresholds, tensor_thresholds)."""
    rng = np.random.default_rng(seed)
    base = _bf16(rng.normal(0, 0.02, n))
    steps = rng.normal(0, scale, distinct).astype(np.float32)
    expert = base + steps[rng.integers(0, distinct, n)]
    expert = expert.astype(np.float32) if fp32 else _bf16(expert)
    expert[: n // 3] = base[: n // 3]
    if nonfinite:
        expert[rng.integers(0, n, nonfinite)] = [np.nan, np.inf, -np.inf][:nonfinite]
    a = np.abs(expert - base).astype(np.float32)
    want = np.array([_sorted_kth(a, d) for d in stats.DENSITY_GRID], np.float32)
    for cap in (n + 1, n // 8 + 1):
        exc = _exceptions(a, cap)
        got = stats.grid_thresholds(a.copy(), _summary(a), exc)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(stats.sorted_thresholds(a.copy()), want)


@pytest.mark.parametrize("n", [1, stats.SORT_MAX, stats.SORT_MAX + 1, 50_000, stats.SORT_MAX_RADIX + 1])
@pytest.mark.parametrize("fp32", [False, True])
def test_tensor_thresholds_on_either_side_of_the_cutoffs(n, fp32, monkeypatch):
    """Whichever way tensor_thresholds takes (a sort; the radix select; complete exceptions), the
    full sort's values, bit for bit (NaN included), and the way the cutoffs say it takes."""
    took = []
    for name in ("sorted_thresholds", "grid_thresholds"):
        f = getattr(stats, name)
        monkeypatch.setattr(stats, name, lambda *a, f=f, name=name: took.append(name) or f(*a))
    rng = np.random.default_rng(n)
    base = _bf16(rng.normal(0, 0.02, n))
    expert = base + rng.normal(0, 1e-3, n).astype(np.float32)
    expert = expert.astype(np.float32) if fp32 else _bf16(expert)
    expert[: n // 3] = base[: n // 3]
    expert[n // 2] = np.nan
    a = np.abs(expert - base).astype(np.float32)
    exc = _exceptions(a, n // 2 + 1024)  # the capacity scan.py gives a tensor
    if fp32 and n >= 50_000:  # overflowed: the sort up to SORT_MAX_RADIX, the radix passes beyond
        assert not exc.complete
    want = np.array([_sorted_kth(a, d) for d in stats.DENSITY_GRID], np.float32)
    got = stats.tensor_thresholds(a.copy(), _summary(a), exc)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    sort = n <= stats.SORT_MAX or (n <= stats.SORT_MAX_RADIX and not exc.complete)
    assert took == ["sorted_thresholds" if sort else "grid_thresholds"]
    assert (n, fp32, took) != (50_000, True, ["grid_thresholds"])  # an overflowed mid-size tensor is sorted


def test_thresholds_of_an_empty_tensor_are_zeros():
    empty = np.zeros(0, np.float32)
    want = np.zeros(len(stats.DENSITY_GRID), np.float32)
    np.testing.assert_array_equal(stats.sorted_thresholds(empty), want)
    np.testing.assert_array_equal(stats.grid_thresholds(empty, np.zeros(stats.SUMMARY_BINS, np.int64)), want)
    np.testing.assert_array_equal(
        stats.tensor_thresholds(empty, np.zeros(stats.SUMMARY_BINS, np.int64), _exceptions(empty, 1)), want
    )


def test_exceptions_collected_by_block_stats():
    """block_stats collects exactly the finite |Δ| with low bits set, across blocks, in any count."""
    rng = np.random.default_rng(4)
    base = _bf16(rng.normal(0, 0.02, 5000))
    expert = _bf16(base + rng.normal(0, 1e-3, 5000))
    expert[17] = base[17] * 3 + np.float32(2**-20)  # far from the base: low bits set
    expert[99] = np.nan
    a = np.abs(expert - base).astype(np.float32)
    for cap in (5000, 3):
        exc = stats.Exceptions(cap)
        out = np.empty(5000, np.float32)
        summary = np.zeros(stats.SUMMARY_BINS, np.int64)
        for s in range(0, 5000, 1024):
            stats.block_stats(expert[s : s + 1024], base[s : s + 1024], out[s : s + 1024], 7, summary, 8, exc)
        want = _exceptions(a, 5000)
        assert exc.n == want.n >= 1 and exc.complete == (cap >= want.n)
        if exc.complete:
            np.testing.assert_array_equal(np.sort(exc.values()), np.sort(want.values()))
        np.testing.assert_array_equal(summary, _summary(a))


def test_grid_thresholds_one_value_repeated():
    """A sub-bin that holds the whole tensor (the case the third level exists for)."""
    a = np.full(100_003, np.float32(3 * 2**-14), np.float32)
    a[::7] = np.float32(2**-14)
    want = np.array([_sorted_kth(a, d) for d in stats.DENSITY_GRID], np.float32)
    np.testing.assert_array_equal(stats.grid_thresholds(a.copy(), _summary(a)), want)


def _rows(cat: Catalog) -> dict[str, list[dict]]:
    return {
        "blocks": cat.sql("SELECT * FROM blocks ORDER BY base_id, tensor_idx, block_idx").to_pylist(),
        "expert_blocks": cat.sql(
            "SELECT c.name, eb.* EXCLUDE (checkpoint_id) FROM expert_blocks eb "
            "JOIN checkpoints c USING (checkpoint_id) "
            "ORDER BY c.name, tensor_idx, block_idx"
        ).to_pylist(),
        "expert_tensors": cat.sql(
            "SELECT c.name, et.* EXCLUDE (checkpoint_id) FROM expert_tensors et "
            "JOIN checkpoints c USING (checkpoint_id) ORDER BY c.name, tensor_idx"
        ).to_pylist(),
        "checkpoints": cat.sql("SELECT name, content_hash FROM checkpoints ORDER BY name").to_pylist(),
    }


def test_catalog_rows_identical_for_every_thread_count(tmp_path):
    fam = synth.make_family(tmp_path / "family", experts=3, size="tiny", seed=11)
    rows = {}
    for threads in (1, 2, 3):
        cat = Catalog(tmp_path / f"t{threads}.duckdb")
        cat.register([fam], base_model="base", block_size=64 * 1024, threads=threads)
        rows[threads] = _rows(cat)
    assert rows[1]["expert_blocks"] and rows[1]["expert_tensors"]
    for table in rows[1]:
        assert rows[2][table] == rows[1][table], table
        assert rows[3][table] == rows[1][table], table


def test_register_threads_default_is_the_machines_cores(tmp_path, monkeypatch):
    from mergedb import scan

    seen = []
    real = scan._scan  # scan_experts' and scan_family's

    def spy(*args, **kwargs):
        seen.append(args[5])
        return real(*args, **kwargs)

    monkeypatch.setattr(scan, "_scan", spy)
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    fam = synth.make_family(tmp_path / "family", experts=1, size="tiny", seed=2)
    from mergedb.register import register

    register(Catalog(tmp_path / "c.duckdb"), [fam], base_model="base")
    assert seen == [3]


@pytest.mark.parametrize("experts", [1, 3])
def test_base_registered_with_its_experts_is_read_once(tmp_path, monkeypatch, experts):
    """A base registered in the same call as its experts is hashed by their scan (scan_family): its
    file is read once, and every row equals registering the base first, then the experts."""
    from mergedb import sources
    from mergedb.checkpoint import open_checkpoint

    fam = synth.make_family(tmp_path / "family", experts=experts, size="tiny", dtype="fp16", seed=4)
    names = [fam / f"expert_{k:02d}" for k in range(experts)]
    ref = Catalog(tmp_path / "ref.duckdb")
    ref.register([fam / "base"], base=True, block_size=4096)
    ref.register(names, base_model="base")
    read: dict[str, int] = {}
    real = sources.LocalFile.read_into

    def spy(self, buf, offset):  # type: ignore[no-untyped-def]
        read[Path(self.path).parent.name] = read.get(Path(self.path).parent.name, 0) + len(buf)
        return real(self, buf, offset)

    monkeypatch.setattr(sources.LocalFile, "read_into", spy)
    cat = Catalog(tmp_path / "one.duckdb")
    cat.register([fam], base_model="base", block_size=4096)
    assert read["base"] == sum(t.nbytes for _, t in open_checkpoint(fam / "base").tensors)
    got, want = _rows(cat), _rows(ref)
    assert got["blocks"] and got["blocks"] == want["blocks"]
    for table in want:
        assert got[table] == want[table], table


def _ref_bucket_sign(key: int, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The sketch's hash as documented (splitmix64-style mix of key + i), in numpy uint64."""
    with np.errstate(over="ignore"):
        z = (np.uint64(key) + np.arange(n, dtype=np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(32))) * np.uint64(0xBF58476D1CE4E5B9)
        z = z ^ (z >> np.uint64(29))
        j = ((z & np.uint64(0xFFFFFFFF)) * np.uint64(dim)) >> np.uint64(32)
    return j.astype(np.int64), np.where(z >> np.uint64(63), -1.0, 1.0)


def test_shared_sketch_codes_give_the_same_sketch():
    """One code table per block, shared by every expert, is the same CountSketch as hashing inline."""
    rng = np.random.default_rng(9)
    base = rng.normal(0, 0.02, 3001).astype(np.float32)
    for dim in (16, 64):
        key = stats.sketch_key("model.layers.0.mlp.up_proj.weight", 3)
        codes = stats.sketch_codes(key, base.size, dim)
        j, sign = _ref_bucket_sign(int(key), base.size, dim)
        np.testing.assert_array_equal(codes >> 1, j)
        np.testing.assert_array_equal(np.where(codes & 1, -1.0, 1.0), sign)
        for _ in range(3):  # several experts against one table
            expert = base + rng.normal(0, 1e-3, base.size).astype(np.float32)
            d = (expert - base).astype(np.float32)
            want = np.zeros(dim)
            np.add.at(want, j, sign * d.astype(np.float64))
            out = np.empty(base.size, np.float32)
            summary = np.zeros(stats.SUMMARY_BINS, np.int64)
            shared = stats.block_stats(expert, base, out, key, summary, dim, codes=codes)
            inline = stats.block_stats(expert, base, out, key, summary, dim)
            np.testing.assert_array_equal(shared.sketch, inline.sketch)
            np.testing.assert_allclose(shared.sketch, want.astype(np.float32), rtol=1e-5, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5000),
    fp32=st.booleans(),
    frozen=st.floats(0.0, 0.9),
    tiny=st.booleans(),  # denormal deltas: code 0 holds values other than zero
    nonfinite=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_statistics_from_summary_and_from_a_second_pass(n, fp32, frozen, tiny, nonfinite, seed):
    """Both ways block_stats gets the histogram, norm, max and non-zeros — from the summary plus the
    exceptions, or (exceptions overflowing) a pass over |Δ| — against numpy on the whole block."""
    rng = np.random.default_rng(seed)
    scale = 1e-40 if tiny else 1e-3
    base = _bf16(rng.normal(0, 0.02, n))
    expert = base + rng.normal(0, scale, n).astype(np.float32)
    expert = expert.astype(np.float32) if fp32 else _bf16(expert)
    expert[: int(frozen * n)] = base[: int(frozen * n)]
    if nonfinite:
        expert[rng.integers(0, n, nonfinite)] = [np.inf, np.nan][:nonfinite]
    d = (expert - base).astype(np.float32)
    a = np.abs(d)
    fin = np.isfinite(a)
    a64 = a[fin].astype(np.float64)
    for cap in (n, 0):
        out = np.empty(n, np.float32)
        summary = np.zeros(stats.SUMMARY_BINS, np.int64)
        s = stats.block_stats(expert, base, out, 5, summary, 8, stats.Exceptions(cap))
        np.testing.assert_array_equal(out.view(np.uint32), a.view(np.uint32))
        assert s.nnz == np.count_nonzero(d) and s.nonfinite == (~fin).sum()
        assert s.max_abs == (a[fin].max() if fin.any() else 0)
        if s.nonfinite == 0:
            np.testing.assert_allclose(s.norm, np.sqrt((a64**2).sum()), rtol=1e-12)
            terms = base.astype(np.float64) * d.astype(np.float64)
            assert abs(s.base_dot - terms.sum()) <= 1e-12 * np.abs(terms).sum()
        else:
            assert np.isnan(s.norm) and np.isnan(s.base_dot)
        assert s.hist_count.sum() == fin.sum()
        for lo, cnt, sm, sq in zip(s.hist_lo, s.hist_count, s.hist_sum, s.hist_sumsq):
            hi = stats.hist_hi(np.array([lo]))[0]
            inside = a64[(a[fin] >= lo) & (a[fin] < hi)]
            assert cnt == inside.size
            np.testing.assert_allclose([sm, sq], [inside.sum(), (inside**2).sum()], rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    row=st.sampled_from([64, 100, 512, 1000]),
    fp32=st.booleans(),
    touched=st.floats(0.0, 1.0),
    nonfinite_base=st.booleans(),  # a NaN/Inf base value equal in the expert: Δ is NaN, not 0
    seed=st.integers(0, 2**32 - 1),
)
def test_zero_chunks_skipped_change_nothing(rows, row, fp32, touched, nonfinite_base, seed):
    """deltapass.delta_pass skips the chunks whose bytes equal the base's (an embedding a fine-tune
    barely touched): every output equals the plain pass over all elements, bit for bit."""
    from mergedb import deltapass

    rng = np.random.default_rng(seed)
    n = rows * row
    base = _bf16(rng.normal(0, 0.02, n))
    expert = base.copy()
    for r in np.flatnonzero(rng.random(rows) < touched):  # the rows the fine-tune changed
        expert[r * row : (r + 1) * row] = base[r * row : (r + 1) * row] + rng.normal(0, 1e-3, row).astype(np.float32)
    if nonfinite_base:
        base[rng.choice(n, 2, replace=False)] = [np.nan, np.inf]  # two places (two draws could coincide)
        expert[np.isnan(base) | np.isinf(base)] = base[np.isnan(base) | np.isinf(base)]
    if fp32:
        e, b, shift = expert.view(np.uint32), base.view(np.uint32), 0
    else:
        e, b, shift = _bf16(expert).view(np.uint32) >> 16, base.view(np.uint32) >> 16, 16
        e, b = e.astype(np.uint16), b.astype(np.uint16)
    codes = stats.sketch_codes(3, n, 16)
    zero = _zero_chunks(expert, base)
    outs = []
    for run in ("chooser", "runs", "plain"):
        abs_bits = np.full(n, 7, np.uint32)
        counts, sk, bd = np.zeros(stats.SUMMARY_BINS, np.int64), np.zeros(16), np.zeros(4)
        exc = np.zeros(n + 1, np.uint32)
        args = (e, b, shift, abs_bits, codes, counts, sk, bd, exc, 0)
        if run == "runs":  # the skipping path, with the chunks an independent numpy check finds
            nonfinite, n_exc = deltapass._delta_runs(*args, zero)
        else:
            nonfinite, n_exc = (deltapass.delta_pass if run == "chooser" else deltapass._delta_pass)(*args)
        outs.append((nonfinite, n_exc, abs_bits, counts, sk.view(np.uint64), bd.view(np.uint64), exc[:n_exc]))
    for other in outs[:2]:
        for got, want in zip(other, outs[2]):
            np.testing.assert_array_equal(got, want)
    assert outs[2][0] == (2 if nonfinite_base else 0)


def _zero_chunks(expert: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Which whole chunks of deltapass.CHUNK elements have Δ = 0 exactly: equal values, finite base."""
    from mergedb import deltapass

    m = expert.size // deltapass.CHUNK * deltapass.CHUNK
    same = (expert[:m].view(np.uint32) == base[:m].view(np.uint32)) & np.isfinite(base[:m])
    return same.reshape(-1, deltapass.CHUNK).all(axis=1)


def test_delta_pass_finds_the_zero_chunks():
    """The chooser's word check marks exactly the chunks with Δ = 0 (not those where an equal
    base value is NaN or Inf), on bf16 and float32 patterns."""
    from mergedb import deltapass

    rng = np.random.default_rng(5)
    n = deltapass.CHUNK * deltapass.SAMPLE_STEP * 3 + 77
    base = _bf16(rng.normal(0, 0.02, n))
    expert = base.copy()
    expert[: deltapass.CHUNK * 5] += np.float32(1e-2)  # five changed chunks, then equal ones
    expert[deltapass.CHUNK * 20 + 3] += np.float32(1e-2)
    base[deltapass.CHUNK * 30 + 9] = expert[deltapass.CHUNK * 30 + 9] = np.inf
    expert = _bf16(expert)
    want = _zero_chunks(expert, base)
    assert want.sum() == len(want) - 7
    for shift, e, b in (
        (0, expert.view(np.uint32), base.view(np.uint32)),
        (16, *(x.view(np.uint32) >> 16 for x in (expert, base))),
    ):
        e, b = (e, b) if shift == 0 else (e.astype(np.uint16), b.astype(np.uint16))
        size, em, el, top = deltapass.LANES[shift]
        words = deltapass.CHUNK * size // 8
        ew, bw = (x.view(np.uint8)[: x.size * size // 8 * 8].view(np.uint64) for x in (e, b))
        np.testing.assert_array_equal(deltapass._equal_chunks(ew, bw, words, 1, em, el, top), want)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40000),
    fp32=st.booleans(),
    spread=st.floats(0.0, 30.0),  # magnitudes of |Δ| over e^±spread: many bins or few
    frozen=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_block_hist_equals_the_numpy_formula_bit_for_bit(n, fp32, spread, frozen, seed):
    """deltapass.block_hist (the histogram of a block from its summary counts and exceptions, in one
    compiled pass) stores exactly what the numpy expressions it replaced stored: the same float64
    sums in the same order (numpy's pairwise row sums, bincount's sequential ones), bit for bit."""
    from mergedb import deltapass

    rng = np.random.default_rng(seed)
    d = (rng.normal(0, 1, n) * np.exp(rng.uniform(-spread, spread, n))).astype(np.float32)
    d[: int(frozen * n)] = 0
    a = np.abs(d) if fp32 else np.abs(_bf16(d))
    bits = a.view(np.uint32)
    counts = np.bincount(bits >> 17, minlength=stats.SUMMARY_BINS).astype(np.int64)
    exc = bits[(bits & 0x1FFFF) != 0]  # the exceptions, in element order
    # the reference: block_stats' numpy formula before block_hist
    edge = np.arange(stats.SUMMARY_BINS, dtype=np.uint32) << np.uint32(17)
    edge = np.where(edge < np.uint32(0x7F800000), edge, np.uint32(0)).view(np.float32).astype(np.float64)
    hcount = counts.reshape(stats.HIST_BINS, -1).sum(axis=1)
    nz = np.flatnonzero(hcount)
    v = exc.view(np.float32).astype(np.float64)
    plain = counts - np.bincount(exc >> np.uint32(17), minlength=stats.SUMMARY_BINS)
    hbin = exc >> np.uint32(22)
    rows = plain.reshape(stats.HIST_BINS, -1)[nz]
    hsum, hsq = np.zeros(stats.HIST_BINS), np.zeros(stats.HIST_BINS)
    hsum[nz] = (rows * edge.reshape(stats.HIST_BINS, -1)[nz]).sum(axis=1)
    hsq[nz] = (rows * (edge * edge).reshape(stats.HIST_BINS, -1)[nz]).sum(axis=1)
    hsum += np.bincount(hbin, v, stats.HIST_BINS)
    hsq += np.bincount(hbin, v * v, stats.HIST_BINS)
    top = np.flatnonzero(plain)
    mx = max(float(v.max()) if len(v) else 0.0, float(edge[top[-1]]) if len(top) else 0.0)

    summary = np.arange(stats.SUMMARY_BINS, dtype=np.int64)
    got = deltapass.block_hist(counts.copy(), summary, exc, edge, edge * edge, 22, 17)
    np.testing.assert_array_equal(summary, np.arange(stats.SUMMARY_BINS) + counts)
    np.testing.assert_array_equal(got[0], hcount)
    assert got[1].tobytes() == hsum.tobytes() and got[2].tobytes() == hsq.tobytes()
    assert repr(float(got[3])) == repr(mx) and got[4] == plain[0]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3 * 512 * 16 + 5), min_size=1, max_size=6),  # elements per block
    fp32=st.booleans(),
    same=st.lists(st.booleans(), min_size=6, max_size=6),  # which blocks equal the base's
    frozen=st.floats(0.0, 1.0),  # leading part of a block equal to the base (zero chunks)
    cap=st.sampled_from([0, 50, 10**6]),  # exceptions that fit: none, a few, all
    nonfinite=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    kernel=st.sampled_from(["numba", "native"]),
)
def test_group_pass_equals_block_stats_per_block(sizes, fp32, same, frozen, cap, nonfinite, seed, kernel):
    """group_pass (consecutive blocks in one call), numba's (deltapass.py) and C's (deltapass.c),
    gives every block exactly what stats.block_stats gives it alone, in order: the same rows bit for
    bit, |Δ|, tensor summary and exceptions, whatever the block sizes (word-aligned or not), equal
    blocks and overflow."""
    from mergedb import deltapass, native

    impl = deltapass if kernel == "numba" else native.load()
    if impl is None:
        pytest.skip(f"no C kernels here: {native.why_not()}")

    rng = np.random.default_rng(seed)
    n = sum(sizes)
    base = _bf16(rng.normal(0, 0.02, n))
    if nonfinite:  # a base value Inf: Δ NaN there, and a chunk around it that is never a zero chunk
        base[rng.integers(0, n)] = np.inf
    expert = base + rng.normal(0, 1e-3, n).astype(np.float32)
    expert = expert.astype(np.float32) if fp32 else _bf16(expert)
    start = np.cumsum([0, *sizes])
    for k, (s, t) in enumerate(zip(start[:-1], start[1:])):
        cut = s + int(frozen * (t - s))
        expert[s:cut] = base[s:cut]
        if same[k]:
            expert[s:t] = base[s:t]
    if nonfinite:
        expert[rng.integers(0, n)] = np.nan
    pat = (lambda x: x.view(np.uint32)) if fp32 else (lambda x: (x.view(np.uint32) >> 16).astype(np.uint16))
    e, b = pat(expert), pat(base)
    size = e.itemsize
    codes = [stats.sketch_codes(stats.sketch_key("t", k), m, 16) for k, m in enumerate(sizes)]

    # reference: block_stats block by block
    want_abs = np.empty(n, np.float32)
    want_sum = np.zeros(stats.SUMMARY_BINS, np.int64)
    want_exc = stats.Exceptions(cap)
    want = []
    for k, (s, t) in enumerate(zip(start[:-1], start[1:])):
        if np.array_equal(e[s:t], b[s:t]):
            want_abs[s:t] = 0
            want_sum[0] += t - s
            want.append(None)
        else:
            ek, bk = (x[s:t].view(np.float32) if fp32 else x[s:t] for x in (e, b))
            st_ = stats.block_stats(ek, bk, want_abs[s:t], 0, want_sum, 16, want_exc, codes[k])
            want.append(st_)

    got_abs = np.empty(n, np.float32)
    got_sum = np.zeros(stats.SUMMARY_BINS, np.int64)
    got_exc = stats.Exceptions(cap)
    out = stats.group_arrays(len(sizes), 16)
    got_exc.n = impl.group_pass(
        e.view(np.uint8), b.view(np.uint8), e, b, start * size, start,
        got_abs.view(np.uint32), np.concatenate(codes), got_sum, got_exc.buf, 0,
        stats.EDGE, stats.EDGE_SQ, stats.HIST_SHIFT, stats.SUMMARY_SHIFT, out,
    )  # fmt: skip
    assert got_abs.tobytes() == want_abs.tobytes() and np.array_equal(got_sum, want_sum)
    assert (
        got_exc.n == want_exc.n
        and got_exc.buf[: min(got_exc.n, cap + 1)].tobytes() == want_exc.buf[: min(want_exc.n, cap + 1)].tobytes()
    )
    for k, w in enumerate(want):
        assert bool(out[0][k]) == (w is None)
        if w is not None:
            g = stats.group_block_stats(out, k, sizes[k])
            for name in w.__dataclass_fields__:
                x, y = getattr(w, name), getattr(g, name)
                if isinstance(x, np.ndarray):
                    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
                else:
                    assert repr(x) == repr(y) and type(x) is type(y), name
