"""lowrank.py against whole matrices: the merged delta formed in full, its SVD by torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergedb.lowrank import concat, truncate


def _adapters(rng: np.random.Generator, out: int, inn: int, ranks: list[int]):
    bs = [rng.standard_normal((out, r)).astype(np.float32) for r in ranks]
    as_ = [rng.standard_normal((r, inn)).astype(np.float32) for r in ranks]
    return bs, as_


def test_concat_is_the_sum_of_scaled_products():
    rng = np.random.default_rng(0)
    bs, as_ = _adapters(rng, 40, 24, [4, 8, 2])
    scales = [0.5 * 2.0, -0.25 * 16 / 8, 1.0 * 4.0]  # c_k · s_k
    f = concat(bs, as_, scales)
    assert f.b.shape == (40, 14) and f.a.shape == (14, 24) and f.rank == 14
    want = sum(c * b.astype(np.float64) @ a.astype(np.float64) for b, a, c in zip(bs, as_, scales))
    got = f.b.astype(np.float64) @ f.a.astype(np.float64)
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


@pytest.mark.parametrize("rank", [1, 3, 7, 14, 20])
def test_truncate_matches_the_svd_of_the_full_delta(rank):
    rng = np.random.default_rng(rank)
    bs, as_ = _adapters(rng, 48, 30, [4, 8, 2])
    f = concat(bs, as_, [1.0, 0.3, -2.0])
    full = torch.from_numpy(f.b.astype(np.float64) @ f.a.astype(np.float64))  # (48, 30) ΔW
    u, s, vh = torch.linalg.svd(full, full_matrices=False)
    k = min(rank, 14)
    best = (u[:, :k] * s[:k]) @ vh[:k]  # Eckart–Young: the best rank-k approximation
    want_err = float(torch.linalg.norm(full - best) / torch.linalg.norm(full))
    t = truncate(f, rank)
    assert t.factors.a.shape == (k, 30) and t.factors.b.shape == (48, k)
    assert t.rel_error == pytest.approx(want_err, rel=1e-9, abs=1e-12)
    approx = torch.from_numpy(t.factors.b.astype(np.float64) @ t.factors.a.astype(np.float64))
    assert float(torch.linalg.norm(approx - best)) <= 1e-6 * float(torch.linalg.norm(full))
    assert float(torch.linalg.norm(full - approx) / torch.linalg.norm(full)) == pytest.approx(want_err, abs=1e-6)
    if rank >= 14:
        assert t.rel_error == 0.0 or t.rel_error < 1e-12


def test_truncate_of_a_rank_deficient_sum():
    """Two adapters sharing A: the sum has rank 4, not 8, and a rank-4 cut is exact."""
    rng = np.random.default_rng(3)
    b1, b2 = (rng.standard_normal((20, 4)).astype(np.float32) for _ in range(2))
    a = rng.standard_normal((4, 16)).astype(np.float32)
    t = truncate(concat([b1, b2], [a, a], [1.0, 1.0]), 4)
    want = (b1.astype(np.float64) + b2) @ a
    got = t.factors.b.astype(np.float64) @ t.factors.a
    assert t.rel_error < 1e-7
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def test_truncate_of_zero_reports_no_error():
    z = concat([np.zeros((5, 2), np.float32)], [np.ones((2, 3), np.float32)], [1.0])
    t = truncate(z, 1)
    assert t.rel_error == 0.0
    assert not np.any(t.factors.b @ t.factors.a)


def test_truncate_refuses_rank_zero():
    f = concat([np.ones((3, 1), np.float32)], [np.ones((1, 3), np.float32)], [1.0])
    with pytest.raises(ValueError, match="at least 1"):
        truncate(f, 0)


def test_one_blas_thread_pins_and_restores_openblas():
    from mergedb.lowrank import _openblas, one_blas_thread

    libs = _openblas()
    if not libs:
        pytest.skip("no OpenBLAS loaded in this process (numpy built against another BLAS)")
    before = [get_() for _, get_ in libs]
    with one_blas_thread():
        assert [get_() for _, get_ in libs] == [1] * len(libs)
    assert [get_() for _, get_ in libs] == before
