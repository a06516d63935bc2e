"""consensus.py's model against a loop written from its definition: per block and draw, each
expert's τ (non-zero with probability p, lognormal magnitude, random sign; the module's own draws,
which are the model's input), the TIES merge of a read set (elected sign of Σ w τ, +1 on zero; the
agreeing experts' Σ w τ, divided by their Σ w when normalizing), and the expectations as means over
the draws. The vectorised code must agree within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from mergedb import consensus


def _model(k: int, nb: int, seed: int, normalize: bool) -> consensus.Model:
    rng = np.random.default_rng(seed)
    p = rng.random((k, nb)) * (rng.random((k, nb)) < 0.85)  # some experts never touch a block
    p[:, -1] = np.maximum(p[:, -1], 0.3)  # every expert touches the last one
    return consensus.Model(
        p=p,
        mu=rng.random((k, nb)) * 1e-3 + 1e-5,
        sigma=rng.random((k, nb)) * 1.5,
        # a weight per (expert, block)'s tensor; a lone expert with a negative one never agrees with its own sign
        w=rng.choice([0.5, 1.0, 2.0, -0.7] if k > 1 else [0.5, 2.0], size=(k, nb)),
        lam=rng.choice([0.5, 1.0, 1.3], size=nb),
        numel=rng.integers(1, 5000, size=nb).astype(np.float64),
        normalize=normalize,
    )


def _tau(m: consensus.Model, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(R, K) float64 τ of block b per draw, and the same with every element non-zero."""
    u, sign, z = (np.asarray(a, np.float64) for a in consensus._draws(m.p.shape[0]))
    forced = sign * m.mu[:, b] * np.exp(m.sigma[:, b] * z - m.sigma[:, b] ** 2 / 2)
    return np.where(u < m.p[:, b], forced, 0.0), forced


def _ties(tau: np.ndarray, w: np.ndarray, normalize: bool) -> float:
    """One element merged from the experts' τ (zeros for experts not read)."""
    up = float(np.sum(w * tau)) >= 0
    agree = tau > 0 if up else tau < 0
    num = float(np.sum((w * tau)[agree]))
    den = float(np.sum(w[agree]))
    return num / (den if den != 0 else 1.0) if normalize else num  # mergekit: divisor[divisor == 0] = 1


def ref_deviation(m: consensus.Model, read: np.ndarray) -> float:
    total = 0.0
    for b in range(m.p.shape[1]):
        tau, _ = _tau(m, b)
        w = m.w[:, b]
        sq = [(_ties(t * read[:, b], w, m.normalize) - _ties(t, w, m.normalize)) ** 2 for t in tau]
        total += np.mean(sq) * m.numel[b] * m.lam[b] ** 2
    return float(np.sqrt(total))


def ref_leave_one_out(m: consensus.Model) -> np.ndarray:
    k, nb = m.p.shape
    out = np.zeros((k, nb))
    for b in range(nb):
        tau, forced = _tau(m, b)
        w = m.w[:, b]
        for j in range(k):
            others = np.arange(k) != j
            sq = []
            for t, f in zip(tau, forced):
                with_j = np.where(others, t, f[j])  # j's element forced non-zero
                sq.append((_ties(with_j, w, m.normalize) - _ties(t * others, w, m.normalize)) ** 2)
            out[j, b] = np.mean(sq) * m.p[j, b] * m.numel[b] * m.lam[b] ** 2
    return np.sqrt(out)


@pytest.mark.parametrize("k,nb,seed,normalize", [(3, 5, 1, True), (4, 7, 2, False), (8, 3, 3, True), (1, 2, 4, True)])
def test_deviation_is_the_definition(k, nb, seed, normalize):
    m = _model(k, nb, seed, normalize)
    rng = np.random.default_rng(seed + 100)
    read = rng.random((k, nb)) < 0.6
    read[:, 0] = True  # a block read whole: no deviation from it
    read[0, -1] = False  # and one that is not
    want, got = ref_deviation(m, read), consensus.deviation(m, read)
    assert want > 0
    assert got == pytest.approx(want, rel=1e-4)
    assert consensus.deviation(m, np.ones((k, nb), bool)) == 0.0


@pytest.mark.parametrize("k,nb,seed,normalize", [(3, 5, 5, True), (4, 4, 6, False), (6, 3, 7, True)])
def test_leave_one_out_is_the_definition(k, nb, seed, normalize):
    m = _model(k, nb, seed, normalize)
    want, got = ref_leave_one_out(m), consensus.leave_one_out(m)
    assert want.shape == got.shape and np.count_nonzero(want) > k
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-12)


def test_kept_stats_are_the_bins_inside_the_trim():
    """consensus.kept_stats against a loop over each block's bins: a bin wholly inside [t_lo, t_hi)
    counts fully, a straddling one by the part of its width inside, a zero-width bin if its edge is
    inside; rows without a trim (±inf) keep every bin; a block identical to the base keeps none."""
    import pyarrow as pa

    rng = np.random.default_rng(11)
    rows = []
    for r in range(40):
        n = int(rng.integers(0, 9))
        lo = np.sort(rng.random(n).astype(np.float32))
        hi = (lo + rng.choice([0.0, 0.01, 0.2], size=n).astype(np.float32)).astype(np.float32)  # some zero-width
        rows.append((lo, hi, rng.integers(1, 100, n), rng.random(n), rng.random(n), r % 7 == 3))
    t = pa.table(
        {
            "hist_lo": pa.array([r[0] for r in rows], pa.list_(pa.float32())),
            "hist_hi": pa.array([r[1] for r in rows], pa.list_(pa.float32())),
            "hist_count": pa.array([r[2] for r in rows], pa.list_(pa.int64())),
            "hist_sum": pa.array([r[3] for r in rows], pa.list_(pa.float64())),
            "hist_sumsq": pa.array([r[4] for r in rows], pa.list_(pa.float64())),
            "identical": pa.array([r[5] for r in rows]),
        }
    )
    t_lo = rng.random(40).astype(np.float32) * 0.5
    t_hi = np.where(rng.random(40) < 0.5, np.float32(np.inf), t_lo + np.float32(0.3)).astype(np.float32)
    t_lo[::5], t_hi[::5] = -np.inf, np.inf  # pairs without a trim row
    got = consensus.kept_stats(t, t_lo, t_hi)
    for i, (lo, hi, count, s, sq, identical) in enumerate(rows):
        want = [0.0, 0.0, 0.0]
        for j in range(len(lo)):
            if hi[j] > lo[j]:
                inside = np.float32(min(hi[j], t_hi[i]) - max(lo[j], t_lo[i]))
                frac = max(float(inside), 0.0) / float(np.float32(hi[j] - lo[j]))
            else:
                frac = float(t_lo[i] <= lo[j] < t_hi[i])
            for x, v in enumerate((count[j], s[j], sq[j])):
                want[x] += float(v) * frac
        if identical:
            want = [0.0, 0.0, 0.0]
        assert [g[i] for g in got] == pytest.approx(want, rel=1e-12, abs=1e-300)
    assert sum(1 for r in rows if len(r[0]) and not r[5]) > 20


def test_totals_with_infinite_draws_are_the_masked_sums():
    """A draw that overflows float32 (|Δ| near its limit) must not turn the masked sums into NaN
    (inf · 0): the totals are the textbook sums of w·τ and w over positive and negative τ."""
    x = np.array([[[np.inf, -1.0, 2.0], [0.0, -np.inf, 1.0]]], np.float32)  # (b=1, R=2, K=3)
    w = np.array([[[1.0, 2.0, 0.5]]], np.float32)
    got = consensus._totals(x, w)
    wx = (w * x)[0]
    want = (
        wx.sum(-1),
        np.array([sum(v for v, t in zip(r, xr) if t > 0) for r, xr in zip(wx, x[0])], np.float32),
        np.array([sum(wk for wk, t in zip(w[0, 0], xr) if t > 0) for xr in x[0]], np.float32),
        np.array([sum(v for v, t in zip(r, xr) if t < 0) for r, xr in zip(wx, x[0])], np.float32),
        np.array([sum(wk for wk, t in zip(w[0, 0], xr) if t < 0) for xr in x[0]], np.float32),
    )
    for g, v in zip(got, want):
        np.testing.assert_array_equal(g[0], v)


def test_histogram_columns_of_unequal_lengths_are_a_damaged_catalog():
    """Both readers of a block's bins (trimmed values, the consensus statistics) refuse lists that
    differ in length instead of pairing one block's edges with another's sums."""
    import pyarrow as pa

    from mergedb.candidates import histogram_bins
    from mergedb.errors import CatalogError

    lo = pa.array([[0.1, 0.2], [0.3]], pa.list_(pa.float32()))
    counts, (a, b) = histogram_bins([lo, pa.array([[1, 2], [3]], pa.list_(pa.int64()))])
    assert counts.tolist() == [2, 1] and a.tolist() == pytest.approx([0.1, 0.2, 0.3]) and b.tolist() == [1, 2, 3]
    with pytest.raises(CatalogError, match="damaged"):
        histogram_bins([lo, pa.array([[1], [2, 3]], pa.list_(pa.int64()))])
