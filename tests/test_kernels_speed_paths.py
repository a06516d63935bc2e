"""The random stream (Threefry-2x32-20), the fused DARE/DELLA paths and the rng guard on replay.

References are written here or in tests/reference.py from the published definitions; nothing is
taken from mergedb's kernels.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mergedb import executor, kernels, synth
from mergedb.catalog import Catalog
from mergedb.errors import MergeDBError
from mergedb.manifest import content_hash
from mergedb.planner import PlanRequest
from tests.reference import threefry_draws

# Random123's known-answer vectors for threefry2x32 with 20 rounds: (ctr0, ctr1, key0, key1) -> word 0
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), 0x6B200159),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), 0x1CB996FC),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0xC4923A9C),
]


@pytest.mark.parametrize(("words", "want"), KAT)
def test_stream_is_threefry_known_answers(words, want):
    c0, c1, k0, k1 = words
    u = kernels.uniform((k1 << 32) | k0, (c1 << 32) | c0, 1)
    assert u[0] * 2**32 == want
    assert threefry_draws((k1 << 32) | k0, 1, (c1 << 32) | c0)[0] * 2**32 == want  # the reference too


@pytest.mark.parametrize("offset", [0, 12_345, 2**32 - 5_000])  # the last crosses the counter's high word
def test_uniform_equals_reference_stream(offset):
    key = kernels.rng_key(7, "expert_03", "model.layers.0.mlp.up_proj.weight")
    got = kernels.uniform(key, offset, 10_000)
    assert np.array_equal(got, threefry_draws(key, 10_000, offset))
    # a block's draws are the whole stream's at its offset
    assert np.array_equal(kernels.uniform(key, offset + 1_234, 100), got[1_234:1_334])


def _chi2_z(counts: np.ndarray) -> float:
    """(X² − df) / sqrt(2 df): X² of equal expected counts, standardised (≈ N(0, 1) for many bins)."""
    expected = counts.sum() / counts.size
    x2 = float(((counts - expected) ** 2 / expected).sum())
    df = counts.size - 1
    return (x2 - df) / math.sqrt(2 * df)


def test_stream_uniform_and_independent():
    """Chi-square tests that a weak mixer fails: 1-D uniformity over 1024 bins, pairs of consecutive
    draws, and the same element in streams whose keys differ in one bit (low word, high word) or by
    one; each |z| < 6 (a false alarm about 1e-9)."""
    n = 1 << 20
    key = kernels.rng_key(0, "a", "t")
    u = kernels.uniform(key, 0, n)
    assert abs(_chi2_z(np.bincount((u * 1024).astype(np.int64), minlength=1024))) < 6
    cell = (u[0::2] * 32).astype(np.int64) * 32 + (u[1::2] * 32).astype(np.int64)  # consecutive pairs
    assert abs(_chi2_z(np.bincount(cell, minlength=1024))) < 6
    for other in (key ^ 1, key ^ (1 << 32), key + 1):
        v = kernels.uniform(other, 0, n)
        cell = (u * 32).astype(np.int64) * 32 + (v * 32).astype(np.int64)
        assert abs(_chi2_z(np.bincount(cell, minlength=1024))) < 6, hex(other)
    # correlation of the same element across neighbouring counters' high words (tensors > 2^32 elements)
    w = kernels.uniform(key, 1 << 32, n)
    assert abs(np.corrcoef(u, w)[0, 1]) < 6 / math.sqrt(n)


def test_a_weak_mixer_fails_the_uniformity_test():
    """The test above can fail: draws i·2^-20 mod 1 (a counter, no mixing) pass 1-D uniformity
    but not the consecutive-pairs test."""
    n = 1 << 20
    u = (np.arange(n) * 0.6180339887498949) % 1.0  # golden-ratio sequence: evenly spread, strongly serial
    cell = (u[0::2] * 32).astype(np.int64) * 32 + (u[1::2] * 32).astype(np.int64)
    assert abs(_chi2_z(np.bincount(cell, minlength=1024))) > 6


# -- fused DARE / DELLA against plain numpy written here ------------------------------------------------


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits by truncation (any bf16 values will do as inputs)."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _inputs(n: int, g: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = _bf16(rng.standard_normal(n, np.float32))
    ex = np.stack([_bf16(_f32(base) + rng.standard_normal(n, np.float32) * np.float32(0.01)) for _ in range(g)])
    ex[0, :7] = base[:7]  # some Δ exactly 0
    return base, ex


def _rank_table(delta: np.ndarray) -> np.ndarray:
    """The README's DELLA rank: fraction of elements in lower 2^-6 magnitude bins plus half of its own."""
    codes = np.abs(delta).view(np.uint32) >> 17
    counts = np.bincount(codes, minlength=1 << 15).astype(np.float64)
    return (np.cumsum(counts) - counts / 2) / counts.sum()


def _ref_fold(base, ex, coefs, keys, offset, density, eps, tables, consensus):
    """Plain numpy: Δ_k = x_k − x_0 (float32), keep Δ/p where u < p (p per element for DELLA), then
    Σ c_k Δ'_k or the TIES sums (total, pos, neg, pos_w, neg_w), experts in order, float32."""
    b = _f32(base)
    sums = np.zeros((5 if consensus else 1, b.size), np.float32)
    for k in range(ex.shape[0]):
        d = _f32(ex[k]) - b
        u = threefry_draws(int(keys[k]), b.size, offset)
        if tables is None:
            p = np.full(b.size, np.float32(density))
            keep = u < density
        else:
            rank = tables[k][np.abs(d).view(np.uint32) >> 17]
            p = (density - eps + 2 * eps * rank).astype(np.float32)
            keep = u < p.astype(np.float64)
        d = np.where(keep, d / p, np.float32(0)).astype(np.float32)
        c = coefs[k]
        sums[0] += c * d
        if consensus:
            sums[1] += np.where(d > 0, c * d, np.float32(0))
            sums[2] += np.where(d < 0, c * d, np.float32(0))
            sums[3] += np.where(d > 0, c, np.float32(0))
            sums[4] += np.where(d < 0, c, np.float32(0))
    return sums


@pytest.mark.parametrize("consensus", [False, True])
@pytest.mark.parametrize("della", [False, True])
def test_fused_drop_equals_numpy_reference(della, consensus):
    n, g = 3 * kernels.CHUNK + 123, 3  # several chunks and a ragged end
    offset = 5 * kernels.CHUNK + 17  # a block in the middle of its tensor
    base, ex = _inputs(n, g)
    coefs = np.array([0.7, -0.4, 1.3], np.float32)
    keys = np.array([kernels.rng_key(3, f"e{k}", "w") for k in range(g)], np.uint64)
    density, eps = 0.55, 0.2
    tables = [_rank_table(_f32(ex[k]) - _f32(base)) for k in range(g)] if della else None
    want = _ref_fold(base, ex, coefs, keys, offset, density, eps, tables, consensus)
    acc = np.zeros((5 if consensus else 1, n), np.float32)
    ranks = np.stack(tables) if della else kernels.NO_RANKS
    mode = kernels.MODE["della" if della else "random"]
    lo, hi = np.zeros(g), np.full(g, np.inf)
    kernels.fold_group(base, ex, 0, mode, offset, coefs, lo, hi, keys, density, eps, ranks, acc)
    assert np.array_equal(acc.view(np.uint32), want.view(np.uint32))
    kept = np.count_nonzero(acc[0]) / n
    assert 0.2 < kept < 0.95  # something was dropped, something kept


@pytest.mark.parametrize("density", [1.0, 1e-9])
def test_fused_drop_extreme_densities(density):
    n = 1000
    base, ex = _inputs(n, 1, seed=2)
    keys = np.array([12345], np.uint64)
    acc = np.zeros((1, n), np.float32)
    one = np.ones(1, np.float32)
    kernels.fold_group(
        base, ex, 0, kernels.MODE["random"], 0, one, np.zeros(1), np.ones(1), keys, density, 0.0, kernels.NO_RANKS, acc
    )
    want = _ref_fold(base, ex, one, keys, 0, density, 0.0, None, False)
    assert np.array_equal(acc, want)


# -- the rng guard -------------------------------------------------------------------------------------


def test_replay_of_a_manifest_from_another_stream_is_refused(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=5)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    dare = cat.plan(PlanRequest("base", None, "dare_ties", "all", params={"density": 0.4}, seed=2))
    res = executor.execute(cat.execution_plan(dare.plan_id), tmp_path / "out")
    assert res.manifest["rng"] == "threefry2x32-20"
    executor.replay(tmp_path / "out" / executor.MANIFEST, tmp_path / "again")  # same stream: replays
    # an older manifest: no `rng` field, consistently re-hashed
    path = tmp_path / "out" / executor.MANIFEST
    doc = json.loads(path.read_text())
    del doc["rng"]
    doc["content_hash"] = content_hash(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(MergeDBError, match="splitmix64.*threefry2x32-20"):
        executor.replay(path, tmp_path / "old")
    assert not (tmp_path / "old").exists()
    ties = cat.plan(PlanRequest("base", None, "ties", "all", params={"density": 0.4}))
    assert "rng" not in executor.execute(cat.execution_plan(ties.plan_id), tmp_path / "ties").manifest
