"""Shared folds: plans of a sweep that differ only in what `kernels.finish` applies fold each block
once, and every output is still exactly its plan executed alone.

References: each output against the same stored plan executed alone (`executor.execute`, no sweep);
the number of folds against the stored masks (distinct selected (tensor, block), counted in SQL)
and the grid's own arithmetic (plans per group)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mergedb import executor, foldshare, grid, synth
from mergedb import sweep as sw
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest
from tests.reference import output_digest


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    """A registered tiny bf16 family of 3 experts with small blocks (several blocks per tensor)."""
    root = tmp_path_factory.mktemp("foldshare")
    synth.make_family(root / "fam", experts=3, size="tiny", seed=21)
    cat = Catalog(root / "c.duckdb")
    cat.register([root / "fam"], base_model="base", block_size="64KiB")
    return root, cat


def _folded_blocks(cat: Catalog, plan_id: int) -> int:
    """Distinct (tensor, block) a plan reads expert bytes of: the blocks its merge folds."""
    return int(
        cat.sql(
            "SELECT CAST(count(*) AS BIGINT) AS n FROM (SELECT DISTINCT tensor_idx, block_idx FROM plan_mask "
            "WHERE plan_id = ? AND selected AND NOT free)",
            [plan_id],
        ).to_pylist()[0]["n"]
    )


CASES = {
    # 3 densities × 2 λ × normalize on/off: 3 fold groups (one per density), folded in one pass
    "ties": ({"density": [0.1, 0.3, 0.6], "lambda": [0.5, 1.0], "normalize": [True, False]}, 3, 1),
    # band trims, 2 densities × 2 λ: 2 groups, one pass
    "breadcrumbs_ties": ({"density": [0.5, 0.8], "lambda": [0.5, 2.0]}, 2, 1),
    # one keep probability, 3 λ: one group
    "dare_ties": ({"lambda": [0.5, 1.0, 2.0]}, 1, 1),
    # 2 densities × 2 λ: 2 groups, 2 passes (random drops are not folded together)
    "della": ({"density": [0.5, 0.8], "lambda": [0.7, 1.3]}, 2, 2),
    # λ is inside c_k for additive methods: 3 plans, 3 folds (no sharing, same bytes)
    "task_arithmetic": ({"lambda": [0.5, 1.0, 1.5]}, 3, 3),
}


@pytest.mark.parametrize("method", list(CASES))
def test_plans_that_differ_in_finish_fold_once_and_write_their_own_bytes(fam, tmp_path, method):
    root, cat = fam
    points, n_groups, n_passes = CASES[method]
    reqs = grid.grid_requests(PlanRequest("base", None, method, "70%", seed=3), points, f"fs-{method}")
    res = sw.sweep(cat, reqs, tmp_path / "sweep", max_parallel=len(reqs), threads=1)
    assert len(res.runs) == len(reqs) >= 3
    assert res.fold_groups == n_groups
    per_plan = {_folded_blocks(cat, p.plan_id) for p, _ in res.runs}
    assert len(per_plan) == 1 and per_plan.pop() > 0  # one budget: the plans fold the same blocks
    assert res.fold_passes == n_passes
    assert res.folds_shared == (len(reqs) - n_passes) * _folded_blocks(cat, res.runs[0][0].plan_id)
    for plan, run in res.runs:
        alone = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "alone" / plan.name, threads=2)
        assert output_digest(run.out) == output_digest(alone.out), plan.name
        assert run.expert_bytes == alone.expert_bytes == plan.selected_bytes


def test_in_memory_sweep_shares_folds_and_equals_each_plan_alone(fam):
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 1.0, 1.5]}, "fs-mem")
    got = list(cat.sweep(reqs, threads=1))
    for plan, state in got:
        alone = executor.merge_to_dict(cat.execution_plan(plan.plan_id))
        assert state.keys() == alone.keys()
        for name, arr in alone.items():
            np.testing.assert_array_equal(state[name], arr, err_msg=name)


def test_fold_keys_say_what_the_fold_reads(fam):
    """Equal keys where only finish-side values differ (λ and normalize of a consensus method);
    different keys where a trim, a weight, the seed, the mask, an additive λ or the output dtype
    asked for differs."""
    root, cat = fam

    def key(method, params, budget="all", seed=0, weights=None, dtype=None):
        p = cat.plan(PlanRequest("base", None, method, budget, weights, params=params, seed=seed))
        return foldshare.fold_key(cat.execution_plan(p.plan_id), dtype)

    ties = key("ties", {"density": 0.3})
    assert key("ties", {"density": 0.3, "lambda": 0.4}) == ties
    assert key("ties", {"density": 0.3, "normalize": False}) == ties
    assert key("ties", {"density": 0.3}, dtype="fp32") != ties
    assert key("ties", {"density": 0.4}) != ties  # another trim
    assert key("ties", {"density": 0.3}, weights=(1.0, 2.0, 1.0)) != ties  # another sign-election weight
    assert key("ties", {"density": 0.3}, budget="50%") != ties  # another mask
    assert key("dare_ties", {"density": 0.5}, seed=1) != key("dare_ties", {"density": 0.5}, seed=2)
    assert key("dare_ties", {"density": 0.5}, seed=1) == key("dare_ties", {"density": 0.5, "lambda": 3.0}, seed=1)
    assert key("task_arithmetic", {"lambda": 0.5}) != key("task_arithmetic", {"lambda": 1.0})
    assert key("ties", {"density": 0.5}) != key("breadcrumbs_ties", {"density": 0.5, "gamma": 0.0})
    assert key("model_stock", {}) is None


def test_densities_over_one_mask_decode_each_block_once_and_write_their_own_bytes(fam, tmp_path):
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"density": [0.2, 0.5, 0.8]}, "fs-dens")
    reqs.append(PlanRequest("base", None, "ties", "all", (2.0, 0.5, 1.0), {"density": 0.5}, name="fs-dens-w"))
    res = sw.sweep(cat, reqs, tmp_path / "s", threads=1)
    one = res.runs[0][0].selected_bytes
    assert res.fold_groups == 4 and res.fold_passes == 1  # four trims or weights, each expert block decoded once
    assert res.folds_shared == 3 * _folded_blocks(cat, res.runs[0][0].plan_id)
    assert res.expert_bytes_read == one and res.expert_bytes_served == 4 * one
    for plan, run in res.runs:
        alone = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "alone" / plan.name)
        assert output_digest(run.out) == output_digest(alone.out)


def test_a_fold_cap_of_zero_folds_in_every_plan_and_writes_the_same_bytes(fam, tmp_path):
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 2.0]}, "fs-cap")
    res = sw.sweep(cat, reqs, tmp_path / "s", cache_bytes=0)
    assert res.fold_groups == 1 and res.folds_shared == 0
    for plan, run in res.runs:
        alone = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "alone" / plan.name)
        assert output_digest(run.out) == output_digest(alone.out)


def test_shared_folds_fold_once_finish_all_and_hold_nothing_after():
    folds, finished = [], []
    lock = threading.Lock()

    def fold_of(value, fail=False):
        def fold(buf):
            folds.append(value)
            if fail:
                raise OSError("disk went away")
            buf[...] = value

        return fold

    def finish_of(who):
        def finish(sums):
            with lock:
                finished.append((who, float(sums[0, 0]), sums.shape))

        return finish

    shared = foldshare.SharedFolds([3, 1], cap=1 << 20)
    ran = []

    def member(group, who, value):
        ran.append(shared.fold((group, 0, 0), np.zeros((5, 4), np.float32), fold_of(value), finish_of(who)))

    threads = [threading.Thread(target=member, args=(0, f"p{i}", 7.0)) for i in range(3)]
    threads.append(threading.Thread(target=member, args=(1, "q", 9.0)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(folds) == [7.0, 9.0]  # group 0 folded once for its 3 plans, group 1 alone
    assert sorted(finished) == [("p0", 7.0, (5, 4)), ("p1", 7.0, (5, 4)), ("p2", 7.0, (5, 4)), ("q", 9.0, (5, 4))]
    assert sorted(ran) == [False, False, True, True] and shared.shared == 2
    assert shared.entries == {} and shared.held == 0 and shared.peak == 80
    assert len(shared.free) == 1  # the group's buffer, kept for its next block

    # the folding plan fails: it raises, and the waiting plans fold for themselves
    failing = foldshare.SharedFolds([2], cap=1 << 20)
    folds.clear(), finished.clear()
    with pytest.raises(OSError):
        failing.fold((0, 1, 0), np.zeros((1, 4), np.float32), fold_of(1.0, fail=True), finish_of("a"))
    assert failing.fold((0, 1, 0), np.zeros((1, 4), np.float32), fold_of(2.0), finish_of("b")) is True
    assert finished == [("b", 2.0, (1, 4))] and failing.entries == {} and failing.held == 0

    # nothing fits: every plan folds, counted as refolds after the first
    tight = foldshare.SharedFolds([3], cap=0)
    folds.clear()
    for _ in range(3):
        assert tight.fold((0, 0, 0), np.zeros((1, 4), np.float32), fold_of(3.0), finish_of("c")) is True
    assert folds == [3.0] * 3 and tight.refolds == 2 and tight.entries == {}


def test_more_groups_than_a_pass_holds_fold_in_several_passes(fam, tmp_path):
    root, cat = fam
    dens = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"density": dens}, "fs-six")
    res = sw.sweep(cat, reqs, tmp_path / "s", threads=1)
    assert foldshare.MAX_SET == 4 and res.fold_groups == 6 and res.fold_passes == 2  # 4 + 2
    assert res.folds_shared == 4 * _folded_blocks(cat, res.runs[0][0].plan_id)
    for plan, run in res.runs:
        alone = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "alone" / plan.name)
        assert output_digest(run.out) == output_digest(alone.out)
