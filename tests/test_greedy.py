"""greedy.py's two ways to the same cut (one sort for small plans, score buckets for large ones)
against a plain walk of the plan's order, and its bounds against textbook sums."""

from __future__ import annotations

import hashlib
import struct
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergedb import candidates, greedy


def random_candidates(seed, k, t, b, *, fixed_costs, random_scores, zero_share=0.3):
    """Candidates with many equal scores, zero scores, free rows, zero-byte rows and (optionally)
    LoRA-style fixed costs charged to carriers; returns (cands, cost, carrier_of, pair)."""
    rng = np.random.default_rng(seed)
    pos, ten, blk = (a.reshape(-1).astype(np.int32) for a in np.meshgrid(range(k), range(t), range(b), indexing="ij"))
    n = pos.size
    free = rng.random(n) < 0.2
    nbytes = rng.integers(0, 50, n).astype(np.int64)
    value = rng.choice([0.0, 1.0, 2.0, 3.5], n) * rng.integers(1, 3, n)  # many ties
    value[rng.random(n) < zero_share] = 0.0  # zero scores among non-free rows
    score = rng.choice([0.0, 0.1, 0.5, 0.9], n) if random_scores else value / np.maximum(nbytes, 1)
    fixed = np.zeros(k * t, np.int64)
    if fixed_costs:
        fixed = np.where(rng.random(k * t) < 0.6, rng.integers(1, 120, k * t), 0).astype(np.int64)
    pair = pos.astype(np.int64) * t + ten
    carrier_of = {}  # the reference's carriers: best score before charging, lowest block on ties
    for g in range(k * t):
        rows = [i for i in range(n) if pair[i] == g and not free[i]]
        if fixed[g] and rows:
            carrier_of[g] = min(rows, key=lambda i: (-score[i], blk[i]))
    kw = {} if random_scores else {"value": value}
    dep, car = candidates.charge_fixed(pair, fixed, blk, free, nbytes=nbytes, score=score, **kw)
    cands = greedy.Candidates.build(
        {"position": pos, "tensor_idx": ten, "block_idx": blk, "free": free},
        nbytes=nbytes,
        value=value,
        score=score,
        gblock=(ten * b + blk).astype(np.int64),
        n_family_blocks=t * b,
        dependent=dep,
        carrier=car,
    )
    return cands, carrier_of, pair


def walk(c, budget, carrier_of, pair):
    """Textbook greedy: in the order (score desc, position, tensor, block) take a non-free block if it
    fits and its (expert, tensor)'s carrier, if it has one, is taken already."""
    taken, left = set(), budget
    n = c.score.size
    for i in sorted(range(n), key=lambda i: (-c.score[i], c.position[i], c.tensor_idx[i], c.block_idx[i])):
        g = int(pair[i])
        ok = g not in carrier_of or carrier_of[g] == i or carrier_of[g] in taken
        if not c.free[i] and c.nbytes[i] <= left and ok:
            taken.add(i)
            left -= int(c.nbytes[i])
    return taken


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 4),
    t=st.integers(1, 5),
    b=st.integers(1, 40),
    budget_frac=st.floats(0.0, 1.1),
    fixed_costs=st.booleans(),
    random_scores=st.booleans(),
)
def test_sort_and_bucket_paths_are_the_walk(seed, k, t, b, budget_frac, fixed_costs, random_scores):
    c, carrier_of, pair = random_candidates(seed, k, t, b, fixed_costs=fixed_costs, random_scores=random_scores)
    budget = int(budget_frac * c.nbytes[~c.free].sum())
    expect = walk(c, budget, carrier_of, pair)
    by_sort, _ = greedy.select(c, budget, 256, sort_max=c.score.size)
    by_buckets, _ = greedy.select(c, budget, 256, sort_max=0)
    assert set(np.flatnonzero(by_sort).tolist()) == expect
    assert np.array_equal(by_sort, by_buckets)
    assert int(c.nbytes[by_sort].sum()) <= budget


@pytest.mark.parametrize("fixed_costs", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_a_budget_of_every_byte_takes_every_block_and_one_byte_less_is_the_walk(seed, fixed_costs):
    c, carrier_of, pair = random_candidates(seed, 3, 4, 30, fixed_costs=fixed_costs, random_scores=False)
    total = int(c.nbytes[~c.free].sum())
    for budget in (total, total + 1, 2**62):
        sel, _ = greedy.select(c, budget, 256)
        assert np.array_equal(sel, ~c.free)
    for sort_max in (c.score.size, 0):
        sel, _ = greedy.select(c, total - 1, 256, sort_max=sort_max)
        assert set(np.flatnonzero(sel).tolist()) == walk(c, total - 1, carrier_of, pair)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(2, 4), t=st.integers(1, 4), budget_frac=st.floats(0.0, 1.1))
def test_dropping_whole_pairs_keeps_every_carrier_with_its_rows(seed, k, t, budget_frac):
    """Candidates.without (the planner's idle experts: every row of some (expert, tensor) pairs):
    the cut selects exactly what the walk over the remaining rows, with their carriers, selects."""
    c, carrier_of, pair = random_candidates(seed, k, t, 12, fixed_costs=True, random_scores=False)
    gone = np.random.default_rng(seed).random(k * t) < 0.4  # (K·T,) pairs dropped whole
    drop = gone[pair]
    kept = np.flatnonzero(~drop)  # old row of each new row
    d = c.without(drop)
    assert np.array_equal(d.score, c.score[kept]) and np.array_equal(d.gblock, c.gblock[kept])
    assert np.array_equal(kept[d.carrier], [carrier_of[int(pair[kept[r]])] for r in d.dependent])
    budget = int(budget_frac * d.nbytes[~d.free].sum())
    sel, _ = greedy.select(d, budget, 256)
    expect = walk(d, budget, {g: int(np.searchsorted(kept, i)) for g, i in carrier_of.items() if not gone[g]},
                  pair[kept])  # fmt: skip
    assert set(np.flatnonzero(sel).tolist()) == expect


@pytest.mark.parametrize("zero_share", [0.0, 0.5])
def test_paths_agree_on_many_distinct_scores(zero_share):
    """Thousands of rows with lognormal scores (the cut falls inside one bucket of many) and a
    block size that varies, so the fill passes run after the cut."""
    rng = np.random.default_rng(7)
    n = 20_000
    pos = rng.integers(0, 8, n).astype(np.int32)
    ten = rng.integers(0, 50, n).astype(np.int32)
    blk = np.arange(n, dtype=np.int32)  # unique keys
    free = rng.random(n) < 0.1
    nbytes = rng.choice([1, 7, 4096, 65536], n).astype(np.int64)
    value = np.exp(rng.normal(0, 3, n))
    value[rng.random(n) < zero_share] = 0.0
    score = value / nbytes
    score[:200] = score[200:400]  # equal scores across different keys
    c = greedy.Candidates.build(
        {"position": pos, "tensor_idx": ten, "block_idx": blk, "free": free},
        nbytes=nbytes,
        value=value,
        score=score,
        gblock=blk.astype(np.int64),
        n_family_blocks=n,
        dependent=np.zeros(0, np.int64),
        carrier=np.zeros(0, np.int64),
    )
    total = int(nbytes[~free].sum())
    for frac in (0.0, 0.01, 0.1, 0.5, 0.9, 1.0):
        budget = int(total * frac)
        by_sort, _ = greedy.select(c, budget, 256, sort_max=n)
        by_buckets, _ = greedy.select(c, budget, 256, sort_max=0)
        assert np.array_equal(by_sort, by_buckets), frac
        # the walk; plan order is (score desc, position, family block), here gblock = blk
        order = np.lexsort((blk, pos, -score))
        taken, left = np.zeros(n, bool), budget
        for i in order:
            if not free[i] and nbytes[i] <= left:
                taken[i] = True
                left -= int(nbytes[i])
        assert np.array_equal(by_sort, taken), frac


def _all_paths(c, budget, n_positions, n_blocks, first_block):
    sel, passes = greedy.select(c, budget, 256, sort_max=0)  # the bucket cut: compiled or numpy by COMPILED_MIN_ROWS
    b = greedy.bounds(c, sel, n_positions, n_blocks)
    return sel, passes, b, greedy.bit_strings(c, sel, n_positions, first_block), greedy.block_sums(c, sel, n_blocks)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), budget_frac=st.floats(0.0, 1.1), fixed_costs=st.booleans())
def test_compiled_passes_equal_the_numpy_paths(seed, budget_frac, fixed_costs):
    """planpass.py's passes (used from greedy.COMPILED_MIN_ROWS rows) against the numpy code on the same
    candidates: the same selection, bits and block sums, and bounds equal to the last bit; the bounds
    also against their textbook sums."""
    k, t, b = 3, 4, 30
    c, _, _ = random_candidates(seed, k, t, b, fixed_costs=fixed_costs, random_scores=False)
    first_block = np.arange(t + 1, dtype=np.int64) * b
    budget = int(budget_frac * c.nbytes[~c.free].sum())
    with mock.patch.object(greedy, "COMPILED_MIN_ROWS", 10**12):
        ref = _all_paths(c, budget, k, t * b, first_block)
    with mock.patch.object(greedy, "COMPILED_MIN_ROWS", 0):
        got = _all_paths(c, budget, k, t * b, first_block)
    assert np.array_equal(ref[0], got[0]) and ref[1] == got[1]
    for x, y in zip(ref[3] + ref[4], got[3] + got[4]):
        assert np.array_equal(x, y)
    rb, gb = ref[2], got[2]
    assert np.array_equal(rb.omitted_per_block, gb.omitted_per_block)
    assert {f: getattr(rb, f) for f in vars(rb) if f != "omitted_per_block"} == {
        f: getattr(gb, f) for f in vars(gb) if f != "omitted_per_block"
    }
    sel = got[0]
    omitted = np.where(sel, 0.0, c.value)
    assert gb.bound_sum == pytest.approx(sum(omitted.tolist()), rel=1e-12, abs=1e-300)
    assert gb.selected_bytes == sum(int(n) for n, s in zip(c.nbytes, sel) if s)
    assert gb.n_selected == int(sel.sum()) and gb.n_free == int(c.free.sum())
    for p in range(k):
        rows = c.position == p
        assert gb.per_position[p][0] == pytest.approx(omitted[rows].sum(), rel=1e-12, abs=1e-300)
        assert gb.per_position[p][2] == int(c.nbytes[rows & sel].sum())
        assert gb.per_position[p][3] == int(c.nbytes[rows].sum())
    per_block = [sum(omitted[c.gblock == g]) for g in range(t * b)]
    assert np.allclose(gb.omitted_per_block, per_block, rtol=1e-12, atol=0)


def test_compiled_scoring_plans_the_same(tmp_path, monkeypatch):
    """A whole plan with every compiled pass (candidates' scoring included) has the numpy plan's hash,
    mask and bounds."""
    from mergedb.catalog import Catalog
    from mergedb.planner import PlanRequest
    from mergedb.synth import simulate

    cat = Catalog(tmp_path / "c.duckdb")
    rng = np.random.default_rng(3)
    simulate(cat, 3, 4, 25, block_bytes=list(rng.integers(1, 5000, 100)), identical_fraction=0.2, seed=3)
    base = cat.checkpoints()[0].name
    got = {}
    for rows in (10**12, 0):
        monkeypatch.setattr(greedy, "COMPILED_MIN_ROWS", rows)
        for budget, value in [(b, v) for b in ("all", "37%", "5%") for v in ("norm", "norm-sqrt")]:
            req = PlanRequest(base, None, "task_arithmetic", budget, weights=(0.5, -1.25, 2.0), value_model=value)
            p = cat.plan(req)
            bits = cat.sql(
                "SELECT checkpoint_id, tensor_idx, CAST(selected AS VARCHAR) AS s FROM plan_mask_bits "
                "WHERE plan_id = ? ORDER BY 1, 2",
                [p.plan_id],
            ).to_pylist()
            row = (p.plan_hash, p.bound_sum, p.bound_blockwise, p.bound_rounded, bits)
            got.setdefault((budget, value), []).append(row)
    for budget, (numpy_plan, compiled_plan) in got.items():
        assert numpy_plan == compiled_plan, budget
    assert got[("37%", "norm")][0][0] != got[("37%", "norm-sqrt")][0][0]  # blocks of 1–5,000 bytes: orders differ


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_bits_digest_is_the_mask_digest_of_the_selected_keys(chunk, compiled, monkeypatch):
    """The plan's mask digest from the bit strings equals sha256 over the selected keys listed one by
    one (sorted, little-endian int64, column after column), whatever the chunking; empty tensors too."""
    monkeypatch.setattr(greedy, "COMPILED_MIN_ROWS", 0 if compiled else 10**12)
    rng = np.random.default_rng(3)
    sizes = [3, 0, 5, 1, 4]  # blocks per tensor, one tensor without blocks
    first_block = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    k, n_blocks = 6, int(first_block[-1])
    chars = np.where(rng.random(k * n_blocks) < 0.4, ord("1"), ord("0")).astype(np.uint8)
    keys = sorted(
        (p, t, b)
        for p in range(k)
        for t, n in enumerate(sizes)
        for b in range(n)
        if chars[p * n_blocks + first_block[t] + b] == ord("1")
    )
    h = hashlib.sha256()
    for col in range(3):
        h.update(struct.pack(f"<{len(keys)}q", *(key[col] for key in keys)))
    assert greedy.bits_digest(chars, first_block, chunk=chunk) == h.hexdigest()
    assert greedy.bits_digest(np.full(k * n_blocks, ord("0"), np.uint8), first_block) == hashlib.sha256().hexdigest()


def test_mask_digest_thread_hands_back_its_result_and_its_error(monkeypatch):
    """Large plans hash the mask on a thread (greedy.bits_digest_later): the waiting call returns
    what bits_digest returns, and an error on the thread is raised by the call, never lost."""
    monkeypatch.setattr(greedy, "COMPILED_MIN_ROWS", 0)
    first_block = np.array([0, 2, 5], np.int64)
    chars = np.frombuffer(b"0110110011", np.uint8).copy()
    assert greedy.bits_digest_later(chars, first_block)() == greedy.bits_digest(chars, first_block)

    def broken(*_):
        raise MemoryError("no room for the keys")

    monkeypatch.setattr(greedy, "bits_digest", broken)
    wait = greedy.bits_digest_later(chars, first_block)
    with pytest.raises(MemoryError, match="no room"):
        wait()
