"""The C kernels (native.py, native.c) against numba's (jitkernels.py), bit for bit; how they are
chosen, built and refused; and that a merge's process never imports numba when they load.

The methods' formulas are checked against independent references elsewhere (tests/test_threads.py
runs every fused method against the per-step `sparsify` + `Accumulator` path, tests/test_methods.py
against textbook merges); here the two compiled implementations of one kernel must agree on every
input, including NaN, infinities, subnormal halves, -0 and rows that are column slices."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mergedb import executor, jitkernels, kernels, native, synth
from mergedb.catalog import Catalog
from mergedb.errors import MergeDBError
from mergedb.methods import METHODS
from mergedb.planner import PlanRequest

C = native.load()
needs_c = pytest.mark.skipif(C is None, reason=f"no C kernels here: {native.why_not()}")
REPO = Path(__file__).resolve().parents[1]


def _raw(rng: np.random.Generator, kind: int, shape: tuple[int, ...], near: np.ndarray | None = None) -> np.ndarray:
    """Raw element bits of `kind`: any bit pattern (NaN, inf, subnormals, -0 among them), or, with
    `near`, small changes of those bits (deltas of every size, most of them small)."""
    if kind == 2:
        x = rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    else:
        x = rng.integers(0, 2**16, shape, dtype=np.uint32).astype(np.uint16)
    if near is not None:
        step = rng.integers(-300, 300, shape)
        x = np.where(rng.random(shape) < 0.8, (near.astype(np.int64) + step) % (2 ** (8 * near.itemsize)), x)
        x = x.astype(near.dtype)
    return x


def _same(a: np.ndarray, b: np.ndarray, any_nan: bool = False) -> bool:
    """The same bits; with `any_nan`, a NaN matches any NaN: which NaN an operation on two NaNs
    returns (sign, payload) is the hardware's choice by operand order, which IEEE 754 leaves open and
    compilers may swap (model_stock's float64 dots of NaN inputs differ so; every other output of
    these random bit patterns, NaNs among them, matches bit for bit)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if any_nan:
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        return bool(np.array_equal(nan_a, nan_b)) and a[~nan_a].tobytes() == b[~nan_b].tobytes()
    return a.tobytes() == b.tobytes()


@needs_c
@pytest.mark.parametrize("kind", [0, 1, 2])
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_fold_group_and_finish_equal_numba(kind, mode, rows):
    rng = np.random.default_rng(100 * kind + 10 * mode + rows)
    n, g = 2 * kernels.CHUNK + 777, 4  # chunks and a ragged end
    base = _raw(rng, kind, (n,))
    wide = _raw(rng, kind, (g, n + 9), near=np.pad(base, (3, 6))[None, :].repeat(g, 0))
    ex = wide[:, 3 : 3 + n]  # rows that are column slices of a larger buffer
    coefs = rng.standard_normal(g).astype(np.float32)
    lo = np.abs(rng.standard_normal(g)) * 1e-2
    hi = np.where(rng.random(g) < 0.5, np.inf, lo + 0.3)
    keys = rng.integers(0, 2**64, g, dtype=np.uint64)
    ranks = rng.random((g, 1 << 15)) if mode == 3 else kernels.NO_RANKS
    for p, eps in ((0.37, 0.1), (1.0, 0.0), (1e-9, 0.0)):
        got = []
        for k in (jitkernels, C):
            acc = np.zeros((rows, n + 5), np.float32)[:, 2 : 2 + n]
            k.fold_group(base, ex, kind, mode, 12_345, coefs, lo, hi, keys, p, eps, ranks, acc)
            k.fold_group(base, ex[:2], kind, mode, 12_345, coefs[:2], lo[:2], hi[:2], keys[:2], p, eps, ranks[:2], acc)
            res, bf16 = np.zeros(n, np.float32), np.zeros(n, np.uint16)
            k.finish(base, kind, acc, True, 0.7, res, np.empty(0, np.uint16), 1.25)
            k.finish(base, kind, acc, False, -1.5, np.empty(0, np.float32), bf16)
            got.append((acc.copy(), res, bf16))
        for a, b in zip(*got):
            assert _same(a, b), (kind, mode, rows, p)


@needs_c
@pytest.mark.parametrize("kind", [0, 1, 2])
def test_stock_fold_dot_decode_and_draws_equal_numba(kind):
    rng = np.random.default_rng(kind)
    n = kernels.CHUNK + 4_099
    base = _raw(rng, kind, (n,))
    for g in (1, 2, 4):
        ex = _raw(rng, kind, (g, n), near=base[None, :].repeat(g, 0))
        coefs = rng.standard_normal(g).astype(np.float32)
        got = []
        for k in (jitkernels, C):
            acc, dots = np.zeros((1, n), np.float32), np.zeros((g, g))
            k.stock_fold(base, ex, kind, coefs, acc, dots)
            got.append((acc, dots))
        assert _same(got[0][0], got[1][0]) and _same(got[0][1], got[1][1], any_nan=True)
    a, b = rng.standard_normal((2, 3 * kernels.CHUNK + 5)).astype(np.float32)
    assert jitkernels.dot64(a, b) == C.dot64(a, b)
    raw = _raw(rng, kind, (5_000,))
    outs = [np.zeros(5_000, np.uint32) for _ in range(2)]
    jitkernels.decode_bits(raw, kind, outs[0])
    C.decode_bits(raw, kind, outs[1])
    assert _same(*outs)
    for key, offset in ((0, 0), (2**64 - 1, 2**32 - 7), (12_345_678_901, 10**12)):
        assert _same(jitkernels.uniform(key, offset, 3_000), C.uniform(key, offset, 3_000))


@needs_c
@pytest.mark.parametrize("kind", [0, 2])
def test_fold_many_and_finish_many_equal_numba(kind):
    rng = np.random.default_rng(7 + kind)
    n, g, sets = kernels.CHUNK + 1_001, 3, 3
    base = _raw(rng, kind, (n,))
    ex = _raw(rng, kind, (g, n), near=base[None, :].repeat(g, 0))
    coefs = np.abs(rng.standard_normal((sets, g))).astype(np.float32)
    lo = np.abs(rng.standard_normal((sets, g))) * 1e-2
    hi = np.full((sets, g), np.inf)
    group = np.array([2, 0, 0, 1])
    normalize, lam = np.array([True, False, True, True]), np.array([1.0, 0.5, -2.0, 0.3])
    stride, at = n + 10, 4
    got = []
    for k in (jitkernels, C):
        acc = np.zeros((sets, 5, n), np.float32)
        k.fold_many(base, ex, kind, coefs, lo, hi, acc)
        res, bf = np.zeros(len(group) * stride, np.float32), np.zeros(len(group) * stride, np.uint16)
        k.finish_many(base, kind, acc, group, normalize, lam, 1.0, res, np.empty(0, np.uint16), stride, at)
        k.finish_many(base, kind, acc, group, normalize, lam, 0.75, np.empty(0, np.float32), bf, stride, at)
        got.append((acc, res, bf))
    for a, b in zip(*got):
        assert _same(a, b)


@needs_c
def test_c_kernels_refuse_arguments_they_would_misread():
    """numba refuses an argument of another type when it compiles; the C kernels read raw memory,
    so their wrappers check dtypes and layouts instead of reading past an array."""
    base, ex = np.zeros(8, np.uint16), np.zeros((2, 8), np.uint16)
    acc, zeros = np.zeros((1, 8), np.float32), np.zeros(2)
    keys = np.zeros(2, np.uint64)
    with pytest.raises(TypeError):  # float64 weights: numba would compute in float64
        C.fold_group(base, ex, 0, 0, 0, np.ones(2), zeros, zeros, keys, 1.0, 0.0, kernels.NO_RANKS, acc)
    with pytest.raises(ValueError):  # fewer weights than experts
        C.fold_group(base, ex, 0, 0, 0, np.ones(1, np.float32), zeros, zeros, keys, 1.0, 0.0, kernels.NO_RANKS, acc)
    with pytest.raises(ValueError):  # sums of another length
        C.fold_group(
            base, ex, 0, 0, 0, np.ones(2, np.float32), zeros, zeros, keys, 1.0, 0.0, kernels.NO_RANKS, acc[:, :4]
        )
    with pytest.raises(ValueError):  # rows that are not contiguous
        C.finish(
            base, 0, np.zeros((1, 16), np.float32)[:, ::2], True, 1.0, np.zeros(8, np.float32), np.empty(0, np.uint16)
        )
    ro = np.zeros((1, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # C would write into it (or fault on a read-only map)
        C.fold_group(base, ex, 0, 0, 0, np.ones(2, np.float32), zeros, zeros, keys, 1.0, 0.0, kernels.NO_RANKS, ro)
    with pytest.raises(ValueError):  # DELLA without a rank table per expert
        C.fold_group(base, ex, 0, 3, 0, np.ones(2, np.float32), zeros, zeros, keys, 0.5, 0.1, kernels.NO_RANKS, acc)


# -- whole merges ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fam(tmp_path_factory) -> Catalog:
    root = tmp_path_factory.mktemp("native")
    synth.make_family(root / "family", experts=4, size="tiny", dtype="bf16", seed=5)
    cat = Catalog(root / "catalog.duckdb")
    cat.register([root / "family"], base_model="base", block_size="16KiB")
    return cat


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        if p.name != executor.MANIFEST:
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest() + json.loads((out / executor.MANIFEST).read_text())["content_hash"]


@needs_c
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_merges_the_same_bytes_on_either_kernels(fam, tmp_path, monkeypatch, method):
    experts = ("expert_00",) if method == "slerp" else ("expert_00", "expert_01", "expert_02", "expert_03")
    params = {"ties": {"density": 0.3}, "dare_ties": {"density": 0.4}, "slerp": {"t": 0.3}}.get(method, {})
    plan = fam.plan(PlanRequest("base", experts, method, "60%", None, params, seed=2))
    xp = fam.execution_plan(plan.plan_id)
    digests = {}
    try:
        for choice in ("native", "numba"):
            monkeypatch.setenv("MERGEDB_KERNELS", choice)
            kernels.reset()
            assert kernels.backend() == choice
            digests[choice] = _digest(executor.execute(xp, tmp_path / choice, threads=2).out)
    finally:
        monkeypatch.delenv("MERGEDB_KERNELS")
        kernels.reset()
    assert digests["native"] == digests["numba"]


MERGE_RUN = r"""
import sys
from mergedb import executor
from mergedb.catalog import Catalog
cat = Catalog(sys.argv[1])
xp = cat.execution_plan(int(sys.argv[2]))
executor.execute(xp, sys.argv[3], threads=2)
from mergedb import kernels
print(kernels.backend(), "numba" in sys.modules)
"""


@needs_c
def test_a_merge_process_never_imports_numba(fam, tmp_path):
    """What the C kernels are for: numba's import and cache load (~0.2 s) are not paid by a merge."""
    plan = fam.plan(PlanRequest("base", ("expert_00", "expert_01"), "ties", "50%", None, {"density": 0.5}))
    fam_path = str(fam.path)
    r = subprocess.run(
        [sys.executable, "-c", MERGE_RUN, fam_path, str(plan.plan_id), str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    assert r.stdout.split() == ["native", "False"], r.stderr


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MERGEDB_KERNELS"}
    return {**env, **extra}


CHOOSE = "from mergedb import kernels, native; print(kernels.backend(), native.why_not())"


def test_without_a_compiler_the_kernels_are_numbas(tmp_path):
    """No compiler (a CC that does not exist keys a library never built): numba's kernels, and
    native.why_not() says why; MERGEDB_KERNELS=native then refuses with that reason."""
    env = _env(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", CHOOSE], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    assert r.stdout.startswith("numba ") and "no-such-cc" in r.stdout
    env["MERGEDB_KERNELS"] = "native"
    r = subprocess.run([sys.executable, "-m", "mergedb.cli", "demo", "--help"], env=env, cwd=REPO, capture_output=True)
    assert r.returncode == 0  # commands that merge nothing never choose kernels
    r = subprocess.run([sys.executable, "-c", CHOOSE], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode != 0 and "MERGEDB_KERNELS=native" in r.stderr and "no-such-cc" in r.stderr


def test_an_unknown_kernel_choice_is_refused(monkeypatch):
    monkeypatch.setenv("MERGEDB_KERNELS", "fortran")
    native.reset()
    try:
        with pytest.raises(MergeDBError, match="MERGEDB_KERNELS='fortran'"):
            native.load()
    finally:
        monkeypatch.delenv("MERGEDB_KERNELS")
        native.reset()
        native.load()


@needs_c
def test_builds_racing_for_one_folder_each_load_a_whole_library(tmp_path, monkeypatch):
    """Two builds at once into one empty folder (two processes starting on a new machine): each
    compiles to a temporary name and renames it in, so both load a whole library, which computes
    what numba does."""
    monkeypatch.setattr(native, "_folders", lambda: [tmp_path])
    got: list[Path | str] = []
    ts = [threading.Thread(target=lambda: got.append(native._build())) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(got) == 2 and all(isinstance(p, Path) and p.parent == tmp_path for p in got), got
    assert [p.name for p in tmp_path.iterdir()] == [got[0].name]  # no temporary file left
    k = native.Kernels(__import__("ctypes").CDLL(str(got[1])))
    a = np.arange(100, dtype=np.float32)
    assert k.dot64(a, a) == jitkernels.dot64(a, a) == float((a.astype(np.float64) ** 2).sum())


def test_a_build_removes_what_killed_builds_and_older_sources_left(tmp_path):
    """A build that was killed leaves its temporary file; the next build removes it once it is older
    than any build runs (STALE), but not a younger one (a build running now), and removes the
    libraries of other sources but not this source's builds for other CPUs."""
    name = "native-aaaaaaaaaaaa-111111111111.so"
    keep = [tmp_path / name, tmp_path / "native-aaaaaaaaaaaa-222222222222.so", tmp_path / ".native-running.so"]
    gone = [tmp_path / "native-bbbbbbbbbbbb-111111111111.so", tmp_path / ".native-killed.so"]
    for p in keep + gone:
        p.write_bytes(b"x")
    old = time.time() - native.STALE - 60
    os.utime(tmp_path / ".native-killed.so", (old, old))
    native._remove_older(tmp_path, name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in keep)
