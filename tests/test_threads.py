"""Determinism across threads and unit order; the fused kernels against the per-step path."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from mergedb import executor, kernels, merger, synth
from mergedb.catalog import Catalog
from mergedb.methods import METHODS
from mergedb.planner import PlanRequest
from tests.conftest import FAMILIES

EXPERTS = ("expert_00", "expert_01", "expert_02", "expert_03")  # more than one READ_AHEAD group
WEIGHTS = (1.0, 0.6, -0.3, 0.8)
PARAMS = {"linear": {"normalize": False}, "ties": {"density": 0.3}, "dare_ties": {"density": 0.4}, "slerp": {"t": 0.3}}


def _request(method: str, budget: str, seed: int) -> PlanRequest:
    if method == "slerp":  # the base and one expert
        return PlanRequest("base", EXPERTS[:1], method, budget, None, PARAMS[method], seed=seed)
    # sign election takes weights ≥ 0 and model_stock none: the negative weight for the others
    weights = None if method == "model_stock" else tuple(map(abs, WEIGHTS)) if METHODS[method].consensus else WEIGHTS
    return PlanRequest("base", EXPERTS, method, budget, weights, PARAMS.get(method, {}), seed=seed)


@pytest.fixture(scope="module", params=["bf16", "fp16-sharded"])
def fam(request, tmp_path_factory) -> Catalog:
    """A tiny family of 4 experts in 16 KiB blocks: several blocks per tensor."""
    dtype, shard = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"threads-{request.param}")
    synth.make_family(root / "family", experts=len(EXPERTS), size="tiny", dtype=dtype, seed=11, shard_size=shard)
    cat = Catalog(root / "catalog.duckdb")
    cat.register([root / "family"], base_model="base", block_size="16KiB")
    return cat


def _digest(out: Path) -> tuple[dict[str, str], str]:
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir()) if p.name != executor.MANIFEST
    }
    return files, json.loads((out / executor.MANIFEST).read_text())["content_hash"]


@pytest.mark.parametrize("budget", ["all", "40%"])
@pytest.mark.parametrize("method", list(METHODS))
def test_output_independent_of_threads_and_unit_order(fam, tmp_path, method, budget):
    plan = fam.plan(_request(method, budget, 3))
    xp = fam.execution_plan(plan.plan_id)
    runs = [
        executor.execute(xp, tmp_path / "t1", threads=1),
        executor.execute(xp, tmp_path / "t2", threads=2),
        executor.execute(xp, tmp_path / "t2-shuffled", threads=2, unit_order_seed=7),
        executor.execute(xp, tmp_path / "t3-shuffled", threads=3, unit_order_seed=1),
    ]
    want = _digest(runs[0].out)
    for r in runs[1:]:
        assert _digest(r.out) == want, (method, budget, r.out.name)
        assert r.expert_bytes == runs[0].expert_bytes == plan.selected_bytes


@pytest.mark.parametrize("dtype", [None, "fp32", "fp16", "bf16"])
@pytest.mark.parametrize("method", [m for m, s in METHODS.items() if s.sparsify in kernels.MODE])
def test_fused_kernels_equal_per_step_path(fam, tmp_path, monkeypatch, method, dtype):
    """The fused path (decode, Δ, trim, fold in one pass) against `sparsify` + `Accumulator`, bit for bit."""
    plan = fam.plan(_request(method, "60%", 4))
    xp = fam.execution_plan(plan.plan_id)
    fused = executor.execute(xp, tmp_path / "fused", dtype=dtype, threads=2)
    monkeypatch.setattr(kernels, "MODE", {})  # every method on the per-step path
    slow = executor.execute(xp, tmp_path / "slow", dtype=dtype, threads=2)
    assert _digest(fused.out) == _digest(slow.out)


def test_f16_decode_is_exact():
    h = np.arange(1 << 16, dtype=np.uint16)
    got = np.empty(h.size, np.uint32)
    kernels.decode_bits(h, kernels.IN_KIND["F16"], got)
    assert np.array_equal(got, h.view(np.float16).astype(np.float32).view(np.uint32))


def test_units_are_plain_independent_values(fam, monkeypatch):
    """Units are disjoint: one per block, or (by default) spans of consecutive blocks with one
    expert set of at most SPAN_BYTES, which cover the same blocks."""
    plan = fam.plan(PlanRequest("base", EXPERTS, "ties", "all", tuple(map(abs, WEIGHTS)), {"density": 0.3}))
    xp = fam.execution_plan(plan.plan_id)

    def units():
        m = merger.Merger(xp, threads=1)
        try:
            return [u for ti in range(len(m.xp.tensors)) for u in m.units(ti)]
        finally:
            m.close()

    spans = units()
    monkeypatch.setattr(merger, "SPAN_BYTES", 0)
    single = units()
    assert single and all(len(u.blocks) == 1 for u in single)
    assert len({(u.tensor_idx, u.blocks) for u in single}) == len(single)
    assert max(sum(1 for u in single if u.tensor_idx == ti) for ti in range(len(xp.tensors))) > 1
    assert any(len(u.blocks) > 1 for u in spans) and len(spans) < len(single)
    assert all(list(u.blocks) == list(range(u.blocks[0], u.blocks[-1] + 1)) for u in spans)  # consecutive
    assert sorted((u.tensor_idx, b) for u in spans for b in u.blocks) == sorted(
        (u.tensor_idx, u.blocks[0]) for u in single
    )


def test_cli_threads_option(fam, tmp_path):
    from typer.testing import CliRunner

    from mergedb.cli import app

    plan = fam.plan(PlanRequest("base", EXPERTS, "dare_ties", "all", tuple(map(abs, WEIGHTS)), {"density": 0.4}))
    runner = CliRunner()
    outs = []
    for n in ("1", "2"):
        out = tmp_path / f"cli-{n}"
        args = ["execute", str(plan.plan_id), "--out", str(out), "--threads", n, "-c", str(fam.path), "-q"]
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        outs.append(_digest(out))
    assert outs[0] == outs[1]
    bad = ["execute", str(plan.plan_id), "-o", str(tmp_path / "bad"), "--threads", "0", "-c", str(fam.path)]
    r = runner.invoke(app, bad)
    assert r.exit_code != 0 and "threads" in r.output
    assert not (tmp_path / "bad").exists()


def test_trims_are_kept_only_while_their_tensor_merges(fam, monkeypatch):
    """A tensor's per-expert trims (stream keys, thresholds) are built once for its blocks and dropped
    when the tensor is handed out: with 16 experts of 20k tensors they were ~64 MB held to the end."""
    plan = fam.plan(PlanRequest("base", EXPERTS, "dare_ties", "all", tuple(map(abs, WEIGHTS)), {"density": 0.3}))
    xp = fam.execution_plan(plan.plan_id)
    m = merger.Merger(xp, threads=2)
    built, held = [], []
    make = m._make_trim
    monkeypatch.setattr(m, "_make_trim", lambda *a: built.append(a[:2]) or make(*a))
    try:
        for _ in m.tensors(list(range(len(xp.tensors)))):
            held.append(len(m._trim_cache))
    finally:
        m.close()
    assert built and max(held) < len(set(built)) and m._trim_cache == {}


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_ties", "della"])
def test_small_blocks_read_on_the_merge_thread_same_output(fam, tmp_path, monkeypatch, method):
    """Small blocks are folded as many experts a group as fit in SMALL_GROUP_BYTES, and such a group
    is read on the merge thread; larger ones on the I/O threads: the same bytes either way (groups of
    all four experts against groups of READ_AHEAD), and each way really taken (where _read_one ran)."""
    plan = fam.plan(_request(method, "60%", 5))
    xp = fam.execution_plan(plan.plan_id)
    where: list[str] = []
    read_one = merger.Merger._read_one

    def recording(self, *args, **kwargs):
        where.append(threading.current_thread().name.split("_")[0])
        return read_one(self, *args, **kwargs)

    monkeypatch.setattr(merger.Merger, "_read_one", recording)
    runs = {}
    for label, limit in (("inline", 1 << 30), ("pool", 0)):
        monkeypatch.setattr(merger, "SMALL_GROUP_BYTES", limit)
        where.clear()
        runs[label] = executor.execute(xp, tmp_path / label, threads=2)
        assert where and set(where) == {"mergedb-merge" if label == "inline" else "mergedb-io"}, (label, set(where))
    assert _digest(runs["inline"].out) == _digest(runs["pool"].out)
    assert runs["inline"].expert_bytes == runs["pool"].expert_bytes == plan.selected_bytes


def test_small_block_groups_bounded_in_bytes_and_della_in_experts(fam):
    """A group of small blocks holds as many experts as fit in SMALL_GROUP_BYTES; DELLA's stay at
    READ_AHEAD (each expert in a call brings a 256 KiB rank table); large blocks READ_AHEAD."""
    sizes = {}
    for method in ("ties", "della"):
        plan = fam.plan(_request(method, "all", 6))
        m = merger.Merger(fam.execution_plan(plan.plan_id), threads=1)
        try:
            ti = next(t for t, blocks in m.sel.items() if any(len(v) == len(EXPERTS) for v in blocks.values()))
            b = next(b for b, v in m.sel[ti].items() if len(v) == len(EXPERTS))
            sizes[method] = [[len(g) for g in m._groups(ti, b, n)] for n in (256, merger.SMALL_GROUP_BYTES)]
        finally:
            m.close()
    assert merger.READ_AHEAD < len(EXPERTS) <= merger.SMALL_GROUP_BYTES // 256
    assert sizes["ties"] == [[len(EXPERTS)], [merger.READ_AHEAD, len(EXPERTS) - merger.READ_AHEAD]]
    assert sizes["della"] == [[merger.READ_AHEAD, len(EXPERTS) - merger.READ_AHEAD]] * 2
