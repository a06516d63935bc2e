"""A fold set merged once (setmerge.py): one base read and one fold per set, every plan's output
still exactly its plan executed alone; a plan whose writer fails leaves the others of its set whole.

References: each output against the same stored plan executed alone (`executor.execute`, no sweep);
base bytes against the base file's own tensor sizes (its safetensors header); states against
`executor.merge_to_dict` of the plan alone."""

from __future__ import annotations

import errno
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mergedb import executor, grid, setmerge, synth
from mergedb import sweep as sw
from mergedb.catalog import Catalog
from mergedb.errors import MergeDBError
from mergedb.manifest import mask_digest
from mergedb.planner import PlanRequest
from tests.reference import output_digest


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    """A registered tiny bf16 family of 3 experts, sharded, with small blocks (several per tensor)."""
    root = tmp_path_factory.mktemp("sweepset")
    synth.make_family(root / "fam", experts=3, size="tiny", seed=31, shard_size=600_000)
    cat = Catalog(root / "c.duckdb")
    cat.register([root / "fam"], base_model="base", block_size="64KiB")
    return root, cat


def _base_tensor_bytes(base: Path, bf16_as_fp32: bool = False) -> int:
    """Σ of the base's tensor sizes, from each shard's safetensors header (BF16 tensors counted at
    4 bytes an element with `bf16_as_fp32`: an fp32 output's)."""
    total = 0
    for f in base.glob("*.safetensors"):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        for k, v in header.items():
            if k != "__metadata__":
                size = v["data_offsets"][1] - v["data_offsets"][0]
                total += 2 * size if bf16_as_fp32 and v["dtype"] == "BF16" else size
    return total


@pytest.mark.parametrize("dtype", [None, "fp32", "fp16"])
def test_a_set_reads_the_base_once_and_writes_each_plan_alone(fam, tmp_path, dtype):
    """TIES at 40%: untouched blocks and tensors keep the base's bytes (or its conversion); 2
    densities × 2 λ × normalize on/off = 8 plans in one set of 2 groups. Under --value norm both
    densities select the same blocks here (under the default norm-sqrt the 1-D tensors sit at the
    cut and differ), so the two groups fold each block in one pass: the path under test."""
    root, cat = fam
    points = {"density": [0.3, 0.7], "lambda": [0.5, 1.5], "normalize": [True, False]}
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "40%", value_model="norm"), points, f"set-{dtype}")
    res = sw.sweep(cat, reqs, tmp_path / "s", dtype=dtype, threads=2)
    masks = {mask_digest(cat.execution_plan(plan.plan_id).mask) for plan, _ in res.runs}
    assert len(masks) == 1  # the premise: one mask for both fold groups
    assert len(res.runs) == 8 and res.fold_groups == 2 and res.fold_passes == 1
    assert res.base_bytes_read == _base_tensor_bytes(root / "fam" / "base")  # once for 8 plans
    for plan, run in res.runs:
        alone = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "alone" / plan.name, dtype=dtype)
        assert output_digest(run.out) == output_digest(alone.out), plan.name
        assert run.expert_bytes == alone.expert_bytes == plan.selected_bytes


def test_sets_that_do_not_fit_run_plan_by_plan_and_read_the_base_per_plan(fam, tmp_path):
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 1.0]}, "set-cap")
    res = sw.sweep(cat, reqs, tmp_path / "s", cache_bytes=0, threads=1)
    assert res.base_bytes_read == 2 * _base_tensor_bytes(root / "fam" / "base")
    for plan, run in res.runs:
        alone = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "alone" / plan.name)
        assert output_digest(run.out) == output_digest(alone.out)


def test_a_failing_writer_fails_its_plan_alone_and_the_set_finishes(fam, tmp_path, monkeypatch):
    """The disk fills while one plan writes (ENOSPC in its second shard): that plan fails with a
    message naming its output and nothing of it is installed; the other plans of its set are whole."""
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 1.0, 2.0]}, "set-full")
    real = executor.write_shard  # each plan's shards go through it (executor.write_shard_files)

    def write_shard(merger, xp, group, path, dtype, progress=None):
        if "set-full-lambda=1" in path.parent.name and path.name.startswith("model-00002"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(merger, xp, group, path, dtype, progress)

    monkeypatch.setattr(executor, "write_shard", write_shard)
    with pytest.raises(MergeDBError, match=r"1 plan\(s\) of the sweep failed: set-full-lambda=1: .*space"):
        sw.sweep(cat, reqs, tmp_path / "s", threads=1, max_shard_size=600_000)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["set-full-lambda=0.5", "set-full-lambda=2"]
    plans = {p["name"]: p["plan_id"] for p in cat.sql("SELECT name, plan_id FROM plans").to_pylist()}
    for name in ("set-full-lambda=0.5", "set-full-lambda=2"):
        alone = executor.execute(cat.execution_plan(plans[name]), tmp_path / "alone" / name, max_shard_size=600_000)
        assert output_digest(tmp_path / "s" / name) == output_digest(alone.out)
        assert len(list(alone.out.glob("model-*.safetensors"))) > 1


def test_a_failing_set_merge_fails_every_plan_of_the_set_and_installs_nothing(fam, tmp_path, monkeypatch):
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 1.0]}, "set-bad")

    def broken(self, u, base_f, outs):
        raise MergeDBError(f"block read failed in tensor {u.tensor_idx}")

    monkeypatch.setattr(setmerge.SetMerger, "_run_set", broken)
    with pytest.raises(MergeDBError, match=r"2 plan\(s\) of the sweep failed: .*block read failed"):
        sw.sweep(cat, reqs, tmp_path / "s", threads=1)
    assert not [p for p in (tmp_path / "s").glob("*") if not p.name.startswith(".")]
    assert not list((tmp_path / "s").glob(".*"))  # no temporary folder left either


def test_in_memory_set_states_are_each_plan_alone_and_own_their_memory(fam):
    """At 20% some tensors are untouched (the base's bytes): each state still holds its own copy."""
    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "20%"), {"lambda": [0.5, 1.0]}, "set-mem")
    (p1, s1), (p2, s2) = list(cat.sweep(reqs, threads=1))
    for plan, state in ((p1, s1), (p2, s2)):
        alone = executor.merge_to_dict(cat.execution_plan(plan.plan_id))
        assert state.keys() == alone.keys()
        for name, arr in alone.items():
            np.testing.assert_array_equal(state[name], arr, err_msg=name)
    same = [n for n in s1 if np.array_equal(s1[n], s2[n])]
    assert same  # untouched tensors exist at 20%
    assert not any(np.shares_memory(s1[n], s2[n]) for n in s1)


def test_a_sweep_larger_than_the_free_disk_is_refused_before_anything_runs(fam, tmp_path, monkeypatch):
    """Free space a byte short of the outputs' tensor bytes (3 plans × the base's tensors in fp32,
    its I64 tensor as it is): refused with both figures; no output, no run recorded."""
    import shutil
    from collections import namedtuple

    root, cat = fam
    need = 3 * _base_tensor_bytes(root / "fam" / "base", bf16_as_fp32=True)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 0, need - 1))
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 1.0, 2.0]}, "set-disk")
    runs = cat.sql("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"]
    with pytest.raises(MergeDBError, match=rf"\({need:,} bytes\) under .* has .* \({need - 1:,} bytes\) free"):
        sw.sweep(cat, reqs, tmp_path / "s", dtype="fp32")
    assert not (tmp_path / "s").exists()
    assert cat.sql("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"] == runs
    # room for the tensors alone: not for the headers, manifests, masks and side files (refused once planned)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 0, need))
    with pytest.raises(MergeDBError, match=r"outputs need .* \(nothing was stored\)"):
        sw.sweep(cat, reqs, tmp_path / "s", dtype="fp32")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 0, 2 * need))
    assert len(sw.sweep(cat, reqs, tmp_path / "s", dtype="fp32").runs) == 3  # room enough: it runs


def _ties_finish_reference(base_bits, sums, normalize, lam, scale):
    """The TIES finish in numpy float32, textbook order: elected sign's sum (tot ≥ 0: positive),
    divided by its weight when normalizing (a zero weight by 1, as mergekit), scale·base + λ·that; weighted sums
    (one row): scale·base + total."""
    f32 = np.float32
    base = (base_bits.astype(np.uint32) << 16).view(np.float32)
    if sums.shape[0] == 1:
        return f32(scale) * base + sums[0]
    tot, pos, neg, pos_w, neg_w = sums
    el = np.where(tot >= 0, pos, neg)
    if normalize:
        den = np.where(tot >= 0, pos_w, neg_w)
        el = el / np.where(den == 0, f32(1.0), den)
    return f32(scale) * base + f32(lam) * el


def _to_bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even, NaN as 0x7FC0."""
    b = x.view(np.uint32)
    r = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where((b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), np.uint16(0x7FC0), r)


@pytest.mark.parametrize("rows", [5, 1])
def test_finish_many_is_the_finish_formula_for_every_plan(rows):
    """5 plans over 3 groups of sums (ties with zeros, tiny weights, a NaN; n not a multiple of the
    chunk), each with its own λ and normalize, into float32 rows and into bfloat16 rows of a flat
    buffer (the block in the middle of each row)."""
    from mergedb import kernels

    rng = np.random.default_rng(7)
    n = kernels.CHUNK + 517
    sums = rng.standard_normal((3, rows, n)).astype(np.float32)
    sums[:, 0, :40] = 0.0  # tot = 0 elects the positive sign
    if rows == 5:
        sums[:, 3:, 40:60] = 1e-9  # tiny weights divide as they are
        sums[:, 3:, 60:80] = 0.0  # zero weights divide by 1
    sums[1, 0, 90] = np.nan
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    base[(base & 0x7F80) == 0x7F80] = 0x3F80  # finite base values
    group = np.array([0, 1, 2, 0, 1])
    normalize = np.array([True, False, True, False, True])
    lam = np.array([0.5, 1.0, 1.3, 2.0, 0.7])
    for scale in (1.0, 0.8):
        want = np.stack(
            [_ties_finish_reference(base, sums[g], normalize[p], lam[p], scale) for p, g in enumerate(group)]
        )
        stride, at = n + 300, 100  # each plan's row longer than the block, the block inside it
        res = np.full(5 * stride, np.nan, np.float32)
        empty16 = np.empty(0, np.uint16)
        kernels.finish_many(base, kernels.IN_KIND["BF16"], sums, group, normalize, lam, scale, res, empty16, stride, at)
        rows = res.reshape(5, stride)
        np.testing.assert_array_equal(rows[:, at : at + n].view(np.uint32), want.view(np.uint32))
        assert np.isnan(rows[:, :at]).all() and np.isnan(rows[:, at + n :]).all()  # nothing outside the block
        bf = np.zeros(5 * stride, np.uint16)
        kernels.finish_many(base, kernels.IN_KIND["BF16"], sums, group, normalize, lam, scale, res[:0], bf, stride, at)
        rows16 = bf.reshape(5, stride)
        np.testing.assert_array_equal(rows16[:, at : at + n], _to_bf16_bits(want))
        assert not rows16[:, :at].any() and not rows16[:, at + n :].any()


@pytest.mark.parametrize("at", [1, 2, 3, 4])
def test_ctrl_c_while_a_wave_submits_its_plans_stops_the_sweep(fam, tmp_path, monkeypatch, at):
    """Ctrl-C landing between two submits of a wave (simulated: the at-th submit raises) hung for ever:
    a set's merge filled a feed no writer would read, or a writer waited on a feed no merge would
    fill, and the pool's exit waited for them (search review; about 1 in 15 random Ctrl-Cs). The
    sweep now raises at once and leaves no thread and no output."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mergedb import sweepwave

    root, cat = fam
    reqs = grid.grid_requests(PlanRequest("base", None, "ties", "all"), {"lambda": [0.5, 1.0, 2.0]}, f"ctrlc{at}")
    calls = []

    class Pool(ThreadPoolExecutor):
        def submit(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                raise KeyboardInterrupt
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(sweepwave, "ThreadPoolExecutor", Pool)
    got: list[BaseException] = []

    def run() -> None:
        try:
            sw.sweep(cat, reqs, tmp_path / "s", threads=1)
        except BaseException as e:  # noqa: BLE001  (the interrupt, caught to be looked at)
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the sweep hung after Ctrl-C"
    assert len(got) == 1 and isinstance(got[0], KeyboardInterrupt), got
    assert not [th.name for th in threading.enumerate() if th.name.startswith("mergedb-sweep")]
    assert not [p for p in (tmp_path / "s").glob("*") if not p.name.startswith(".")]
