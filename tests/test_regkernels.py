"""Registration's C kernels (deltapass.c, through native.py) against numba's (deltapass.py), bit for
bit, kernel by kernel and as whole catalogs; and that a dense registration never imports numba.

group_pass, the statistics pass, is compared with stats.block_stats block by block in
tests/test_register_speed.py (both kernels); block_stats and the thresholds are checked against
independent references (sorts, float64 sums of whole tensors) in tests/test_catalog_stats.py and
tests/test_register_speed.py. Here the two compiled implementations must agree on every input,
NaN and infinity among them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_register import catalog_rows
from mergedb import deltapass, kernels, native, regkernels, stats, synth
from mergedb.catalog import Catalog

C = native.load()
needs_c = pytest.mark.skipif(C is None, reason=f"no C kernels here: {native.why_not()}")
REPO = Path(__file__).resolve().parents[1]


def _patterns(rng: np.random.Generator, n: int, wide: bool) -> np.ndarray:
    """Normal-looking values with NaN, ±Inf, -0 and subnormals among them, as bf16 (uint16) or
    float32 (uint32) patterns."""
    x = rng.normal(0, 0.02, n).astype(np.float32)
    x[rng.integers(0, n, 7)] = [np.nan, np.inf, -np.inf, -0.0, 1e-40, -1e-41, 3e38]
    bits = x.view(np.uint32)
    return bits.copy() if wide else (bits >> 16).astype(np.uint16)


@needs_c
@pytest.mark.parametrize("wide", [False, True])
def test_base_norms_equal_numba_and_the_float64_sum(wide):
    rng = np.random.default_rng(1)
    x = _patterns(rng, 40_003, wide)
    start = np.array([0, 1, 5, 64, 1000, 20_000, 40_003], np.int64)
    got = (np.zeros(6), np.zeros(6, np.int64))
    want = (np.zeros(6), np.zeros(6, np.int64))
    C.base_group(x, start, *got)
    deltapass.base_group(x, start, *want)
    assert got[0].tobytes() == want[0].tobytes() and np.array_equal(got[1], want[1])
    values = (x.astype(np.uint32) << (0 if wide else 16)).view(np.float32).astype(np.float64)
    for k in range(6):
        v = values[start[k] : start[k + 1]]
        assert got[1][k] == np.count_nonzero(~np.isfinite(v))
        assert got[0][k] == pytest.approx(np.sum(v[np.isfinite(v)] ** 2), rel=1e-12)


@needs_c
def test_sketch_codes_and_radix_histograms_equal_numba():
    rng = np.random.default_rng(2)
    for key, dim in [(0, 1), (2**64 - 1, 64), (12345, 2**15)]:
        got, want = np.empty(10_001, np.uint16), np.empty(10_001, np.uint16)
        C.bucket_codes(np.uint64(key), dim, got)
        deltapass.bucket_codes(np.uint64(key), dim, want)
        assert np.array_equal(got, want) and got.max() < 2 * dim
    bits = rng.integers(0, 2**31, 50_000, dtype=np.uint64) >> rng.integers(0, 12, 50_000).astype(np.uint64)
    bits = bits.astype(np.uint32)
    slot_of = rng.integers(0, 5, stats.SUMMARY_BINS).astype(np.int16)
    pair_of = rng.integers(0, 9, (5, 256)).astype(np.int16)
    for count_t in (np.int32, np.int64):
        got, want = np.zeros((5, 256), count_t), np.zeros((5, 256), count_t)
        C.sub_histogram(bits, slot_of, got)
        deltapass.sub_histogram(bits, slot_of, want)
        assert np.array_equal(got, want) and got.sum() == bits.size
        got, want = np.zeros((9, 512), count_t), np.zeros((9, 512), count_t)
        C.low_histogram(bits, slot_of, pair_of, got)
        deltapass.low_histogram(bits, slot_of, pair_of, want)
        assert np.array_equal(got, want) and got.sum() == bits.size


@needs_c
def test_same_bytes_on_either_kernels():
    a = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    for at in (None, 0, 4097, a.size - 1):
        b = a.copy()
        if at is not None:
            b[at] ^= 1
        assert C.same_bytes(a, b) is deltapass.same_bytes(a, b) is (at is None)


def _group(n: int = 256, blocks: int = 1, dim: int = 16, seed: int = 0) -> dict:
    """group_pass' arguments for `blocks` bf16 blocks of n elements (small deltas of a normal base)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(0, 0.02, n * blocks).astype(np.float32)
    expert = base + rng.normal(0, 1e-3, base.size).astype(np.float32)
    e, b = ((x.view(np.uint32) >> 16).astype(np.uint16) for x in (expert, base))
    start = np.arange(blocks + 1, dtype=np.int64) * n
    codes = np.concatenate([stats.sketch_codes(np.uint64(k), n, dim) for k in range(blocks)])
    return dict(
        e_raw=e.view(np.uint8), b_raw=b.view(np.uint8), e=e, b=b, raw_start=start * 2, start=start,
        abs_bits=np.zeros(n * blocks, np.uint32), codes=codes, summary=np.zeros(stats.SUMMARY_BINS, np.int64),
        exc=np.zeros(n * blocks + 1, np.uint32), n_exc=0, edge=stats.EDGE, edge_sq=stats.EDGE_SQ,
        hist_shift=stats.HIST_SHIFT, summary_shift=stats.SUMMARY_SHIFT, out=stats.group_arrays(blocks, dim),
    )  # fmt: skip


@needs_c
def test_c_group_pass_needs_no_zeroed_rows():
    """numba's group_pass adds into rows that must be zero; C's clears each block's rows first, so rows
    left from an earlier group give the same results."""
    want, got = _group(blocks=3), _group(blocks=3)
    for a in got["out"]:
        a.view(np.uint8)[:] = 0xA5
    assert deltapass.group_pass(**want) == C.group_pass(**got)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(want["out"], got["out"]))


@needs_c
def test_c_kernels_refuse_arguments_they_would_misread():
    """Where numba clips a slice, wraps an index or refuses a type, the C code would read or write past an
    array: the wrappers refuse such arguments before the call (a review found each of these accepted)."""
    x = np.zeros(100, np.uint16)
    with pytest.raises(ValueError, match="ascending"):
        C.base_group(x, np.array([0, 101]), np.zeros(1), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="ascending"):
        C.base_group(x, np.array([0, 50, 10]), np.zeros(2), np.zeros(2, np.int64))
    with pytest.raises(TypeError):
        C.bucket_codes(np.uint64(1), 8, np.zeros(10, np.int16))
    with pytest.raises(ValueError, match="key"):  # ctypes would keep the low 64 bits of -1; numba drew other bits
        C.bucket_codes(-1, 8, np.zeros(10, np.uint16))
    with pytest.raises(ValueError, match="out of range"):
        C.sub_histogram(np.zeros(4, np.uint32), np.full(stats.SUMMARY_BINS, 9, np.int16), np.zeros((5, 256), np.int32))
    bad = {
        "start": dict(start=np.array([0, 300, 256]), raw_start=np.array([0, 2, 512])),  # past the patterns
        "raw_start": dict(raw_start=np.array([0, 1000])),  # past the 512 bytes of raw patterns
        "n_exc": dict(n_exc=-20),  # numba wraps the index; C would write before the buffer
        "shifts": dict(hist_shift=21, summary_shift=16),  # C hard-codes registration's 22 and 17
        "codes": dict(codes=np.full(256, 2 * 40, np.uint16)),  # bucket 40 of a 16-bucket sketch
        "abs_bits": dict(abs_bits=np.zeros(512, np.uint32)[::2]),  # not one run of elements
        "unaligned": dict(abs_bits=np.zeros(1025, np.uint8)[1:].view(np.uint32)),
    }
    for what, change in bad.items():
        args = _group() | change
        with pytest.raises((ValueError, TypeError)):
            C.group_pass(**args)
        assert not args["summary"].any(), what  # refused before anything was written
    rows = list(_group()["out"])
    rows[5] = np.zeros((1, 8))  # Σ|Δ| rows of 8 bins, not 512
    with pytest.raises(ValueError, match="output rows"):
        C.group_pass(**(_group() | {"out": tuple(rows)}))
    parent = np.zeros((4, 512))
    two = list(_group(blocks=2)["out"])
    two[5] = parent[1:3][::-1]  # rows in reverse
    with pytest.raises(ValueError, match="C order"):
        C.group_pass(**(_group(blocks=2) | {"out": tuple(two)}))
    assert not parent.any()
    ok = _group()  # and the scratch the refused calls never reached is still all zero: a good call matches
    want = _group()
    assert C.group_pass(**ok) == deltapass.group_pass(**want)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(ok["out"], want["out"]))


@needs_c
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_a_registration_stores_the_same_catalog_on_either_kernels(tmp_path, monkeypatch, dtype):
    """bf16 (exceptions that fit), fp16 (decoded to float32 first) and fp32 (exceptions overflow:
    the second pass over |Δ| and the radix thresholds): every row, bit for bit."""
    synth.make_family(tmp_path / "fam", experts=2, size="tiny", dtype=dtype, seed=7)
    rows = {}
    try:
        for choice in ("native", "numba"):
            monkeypatch.setenv("MERGEDB_KERNELS", choice)
            kernels.reset()  # the registration kernels follow the same choice
            assert regkernels.backend() == choice
            cat = Catalog(tmp_path / f"{choice}.duckdb")
            cat.register([tmp_path / "fam"], base_model="base", block_size="8KiB", threads=2)
            rows[choice] = catalog_rows(cat.path)  # every table, without the columns of where and when
    finally:
        monkeypatch.delenv("MERGEDB_KERNELS")
        kernels.reset()
    assert len(rows["native"]["expert_blocks"]) > 100
    assert repr(rows["native"]) == repr(rows["numba"])


REGISTER_RUN = r"""
import sys
from mergedb import regkernels
from mergedb.catalog import Catalog
Catalog(sys.argv[1]).register([sys.argv[2]], base_model="base", threads=2)
print(regkernels.backend(), "numba" in sys.modules)
"""


@needs_c
def test_a_registration_process_never_imports_numba(tmp_path):
    """What deltapass.c is for: numba's import and cache load (~0.2 s) are not paid by a registration."""
    synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=8)
    r = subprocess.run(
        [sys.executable, "-c", REGISTER_RUN, str(tmp_path / "c.duckdb"), str(tmp_path / "fam")],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    assert r.stdout.split() == ["native", "False"], r.stderr


@needs_c
def test_the_kernel_benchmark_times_registrations_kernels_on_equal_outputs():
    """benchmarks/bench_kernels.py's registration rows run (it stops if the two kernels differ)."""
    from benchmarks import bench_kernels

    rows = bench_kernels.stats_times(70_001, 1)
    assert [r["kernel"].split()[0] for r in rows] == ["group_pass", "base_group", "bucket_codes"]
    assert "3 blocks of 64 KiB" in rows[0]["kernel"] and all(r["native_ms"]["min"] > 0 for r in rows)
