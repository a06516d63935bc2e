"""The executor against whole-tensor references, byte accounting, replay, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.check import check_output
from mergedb.errors import ChangedFileError, MergeDBError
from mergedb.planner import PlanRequest
from mergedb.tensorfile import read_header
from tests.conftest import FAMILIES
from tests.reference import cast_like, load_model, ref_merge

EXPERTS = ["expert_00", "expert_01", "expert_02"]
WEIGHTS = (1.0, 0.6, 0.3)
CASES = [  # λ ≠ 1 where a method takes it, so a coefficient that ignores λ shows
    ("linear", {}),
    ("linear", {"normalize": False}),
    ("task_arithmetic", {"lambda": 0.7}),
    ("ties", {"density": 0.2, "lambda": 0.9}),
    ("dare_linear", {"density": 0.5, "lambda": 1.3}),
    ("dare_ties", {"density": 0.3}),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.05, "lambda": 0.8}),
    ("breadcrumbs_ties", {"density": 0.7, "gamma": 0.01}),
    ("della", {"density": 0.6, "epsilon": 0.2}),
    ("della_linear", {"density": 0.5, "epsilon": 0.1, "lambda": 1.2}),
]


@pytest.fixture(scope="module")
def loaded(family):
    kind, folder, cat = family
    return {n: load_model(folder / n) for n in ["base", *EXPERTS]}


@pytest.mark.parametrize("method,params", CASES)
def test_full_budget_equals_reference_bit_for_bit(family, loaded, tmp_path, method, params):
    kind, folder, cat = family
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), method, "all", WEIGHTS, params, seed=5))
    xp = cat.execution_plan(plan.plan_id)
    res = executor.execute(xp, tmp_path / "out")
    assert res.expert_bytes == plan.selected_bytes <= plan.budget_bytes
    got = load_model(tmp_path / "out")
    checked = 0
    for name, b in loaded["base"].items():
        if b.dtype.kind != "f":
            assert np.array_equal(got[name], b)
            continue
        # the request's own weights, parameters, seed and names: the reference derives coefficients
        # and random draws itself (never from the plan)
        full = ref_merge(
            method,
            params,
            list(WEIGHTS),
            b,
            [loaded[e][name] for e in EXPERTS],
            seed=5,
            expert_names=EXPERTS,
            tensor=name,
        )
        want = cast_like(full, FAMILIES[kind][0])
        assert np.array_equal(got[name], want), (method, name, np.abs(got[name] - want).max())
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("method,params", CASES)
def test_zero_weight_expert_is_not_read(family, loaded, tmp_path, method, params):
    """A weight-0 expert (a sweep's weight grid holding 0) adds nothing to any method's merge: a
    full-budget plan reads none of it, reads what the plan without it reads, and still equals the
    reference merge with that weight 0."""
    kind, folder, cat = family
    weights = (1.0, 0.0, 0.3)
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), method, "all", weights, params, seed=5))
    without = cat.plan(PlanRequest("base", (EXPERTS[0], EXPERTS[2]), method, "all", (1.0, 0.3), params, seed=5))
    res = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    assert res.expert_bytes == plan.selected_bytes == without.selected_bytes > 0
    got = load_model(tmp_path / "out")
    for name, b in loaded["base"].items():
        if b.dtype.kind != "f":
            continue
        full = ref_merge(
            method, params, list(weights), b, [loaded[e][name] for e in EXPERTS],
            seed=5, expert_names=EXPERTS, tensor=name,
        )  # fmt: skip
        assert np.array_equal(got[name], cast_like(full, FAMILIES[kind][0])), (method, name)


@pytest.mark.parametrize("method,params", CASES)
def test_sliced_blocks_equal_reference_bit_for_bit(family, loaded, tmp_path, monkeypatch, method, params):
    """Blocks merged in slices (slicefold.py; slices of 1,000 bytes here, so they cut rows and
    blocks unevenly) give the whole-tensor reference's bytes, every method; and they are sliced."""
    from mergedb import slicefold

    kind, folder, cat = family
    monkeypatch.setattr(slicefold, "SLICE_BYTES", 1000)
    sliced = []
    merge_sliced = slicefold.merge_sliced
    monkeypatch.setattr(slicefold, "merge_sliced", lambda m, ti, b, *a: sliced.append(b) or merge_sliced(m, ti, b, *a))
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), method, "all", WEIGHTS, params, seed=5))
    res = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    assert res.expert_bytes == plan.selected_bytes  # each slice's bytes counted once
    assert len(sliced) > 10
    got = load_model(tmp_path / "out")
    for name, b in loaded["base"].items():
        if b.dtype.kind == "f":
            full = ref_merge(
                method, params, list(WEIGHTS), b, [loaded[e][name] for e in EXPERTS], seed=5, expert_names=EXPERTS,
                tensor=name,
            )  # fmt: skip
            want = cast_like(full, FAMILIES[kind][0])
            assert np.array_equal(got[name], want), (method, name, np.abs(got[name] - want).max())


def test_dare_blockwise_equals_whole_tensor_and_seeds(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=8)
    outs = {}
    for bs in ("8KiB", "64MiB"):  # many blocks per tensor vs one block per tensor
        cat = Catalog(tmp_path / f"c{bs}.duckdb")
        cat.register([fam], base_model="base", block_size=bs)
        for seed in (1, 2):
            p = cat.plan(PlanRequest("base", None, "dare_ties", "all", params={"density": 0.4}, seed=seed))
            out = tmp_path / f"o-{bs}-{seed}"
            executor.execute(cat.execution_plan(p.plan_id), out)
            outs[(bs, seed)] = (out / "model.safetensors").read_bytes()
    assert outs[("8KiB", 1)] == outs[("64MiB", 1)]
    assert outs[("8KiB", 2)] == outs[("64MiB", 2)]
    assert outs[("8KiB", 1)] != outs[("8KiB", 2)]


@pytest.mark.parametrize("budget", ["10%", "50%", "80%"])
def test_partial_budget_error_within_bound(family, loaded, tmp_path, budget):
    kind, folder, cat = family
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), "task_arithmetic", budget, WEIGHTS, {"lambda": 0.9}))
    full = cat.plan(PlanRequest("base", tuple(EXPERTS), "task_arithmetic", "all", WEIGHTS, {"lambda": 0.9}))
    r = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "b", dtype="fp32")
    executor.execute(cat.execution_plan(full.plan_id), tmp_path / "f", dtype="fp32")
    assert r.expert_bytes == plan.selected_bytes <= plan.budget_bytes
    a, f = load_model(tmp_path / "b"), load_model(tmp_path / "f")
    err = np.sqrt(sum(np.sum((a[n].astype(np.float64) - f[n]) ** 2) for n in a if a[n].dtype.kind == "f"))
    # float32 accumulation adds rounding far below the bound's scale
    assert err <= plan.bound_blockwise * (1 + 1e-4) + 1e-6
    if plan.selected_bytes < full.selected_bytes:
        assert err > 0
    else:
        assert err == 0 and plan.bound_blockwise == 0


def test_output_dtype_is_the_configs_dtype(tmp_path):
    """--dtype writes the merged tensors in that dtype, and config.json says so (transformers'
    dtype="auto" reads it); without --dtype the base's config is copied byte for byte. An empty
    --dtype is refused, not taken as the default."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=3)  # bf16, torch_dtype bfloat16
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    xp = cat.execution_plan(cat.plan(PlanRequest("base", None, "task_arithmetic", "all")).plan_id)
    base_config = (fam / "base" / "config.json").read_bytes()
    assert json.loads(base_config)["torch_dtype"] == "bfloat16"
    executor.execute(xp, tmp_path / "same")
    assert (tmp_path / "same" / "config.json").read_bytes() == base_config
    for dtype, name in (("fp32", "float32"), ("fp16", "float16")):
        executor.execute(xp, tmp_path / dtype, dtype=dtype)
        config = json.loads((tmp_path / dtype / "config.json").read_text())
        assert config == {**json.loads(base_config), "torch_dtype": name}
        header = read_header(tmp_path / dtype / "model.safetensors")
        assert {t.dtype for t in header.tensors} == {dtype.replace("fp", "F"), "I64"}  # I64: a pass-through tensor
    with pytest.raises(MergeDBError, match="unknown --dtype ''"):
        executor.execute(xp, tmp_path / "empty", dtype="")
    assert not (tmp_path / "empty").exists()


def test_replay_and_output_format(family, tmp_path):
    kind, folder, cat = family
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), "ties", "40%", params={"density": 0.3}))
    xp = cat.execution_plan(plan.plan_id)
    res = executor.execute(xp, tmp_path / "out", max_shard_size=400_000)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = {t.name for t in xp.tensors}
    assert set(index["weight_map"]) == names
    assert index["metadata"]["total_size"] == res.bytes_written
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "np" if not name else "pt") as f:
            assert name in f.keys()
    for side in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / side).is_file()
    again = executor.execute(xp, tmp_path / "again", max_shard_size=400_000)
    assert again.manifest == res.manifest  # deterministic part identical
    told: list[int] = []  # a replay reports progress as execute does: the total, then each tensor's bytes
    rep = executor.replay(
        out / "mergedb_manifest.json", tmp_path / "replayed", progress=told.append, on_total=told.append
    )
    assert rep.manifest["tensor_hashes"] == res.manifest["tensor_hashes"]
    assert (
        told[0]
        == sum(told[1:])
        == sum(
            os.path.getsize(out / f) - 8 - read_header(out / f).header_len for f in set(index["weight_map"].values())
        )
        > 0
    )
    for shard in set(index["weight_map"].values()):
        assert (out / shard).read_bytes() == (tmp_path / "again" / shard).read_bytes()
        # the replay writes the same shards (it took the 5 GB default: one file)
        assert (tmp_path / "replayed" / shard).read_bytes() == (out / shard).read_bytes()
    config = folder / "base" / "config.json"
    original = config.read_bytes()
    config.write_text(original.decode().replace("}", ', "edited": true}', 1))
    try:  # a side file changed since: the replay would not be the output it claims to reproduce
        with pytest.raises(MergeDBError, match=r"side files \['config.json'\] differ"):
            executor.replay(out / "mergedb_manifest.json", tmp_path / "replayed-edited")
        assert not (tmp_path / "replayed-edited").exists()
    finally:
        config.write_bytes(original)
    # refuses a non-empty folder; --force replaces only a previous mergedb output
    with pytest.raises(MergeDBError, match="--force"):
        executor.execute(xp, out)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(MergeDBError, match="did not create"):
        executor.execute(xp, tmp_path / "foreign", force=True)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    (out / "my-notes.txt").write_text("keep me")
    executor.execute(xp, out, force=True, max_shard_size=400_000)
    assert (out / "my-notes.txt").read_text() == "keep me"  # never deletes what it did not create
    assert json.loads((out / "mergedb_manifest.json").read_text())["content_hash"] == res.manifest["content_hash"]


def _evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_cold_cache_physical_reads_match_logical(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=3, size="small", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "20%"))
    xp = cat.execution_plan(plan.plan_id)
    base_files = list((fam / "base").glob("*.safetensors"))
    for f in base_files:
        f.read_bytes()  # base warm: physical reads are then the experts' alone
    os.sync()
    _evict([p for e in EXPERTS for p in (fam / e).glob("*.safetensors")])
    res = executor.execute(xp, tmp_path / "out")
    assert res.expert_bytes == plan.selected_bytes <= plan.budget_bytes
    if res.physical_bytes == 0:
        pytest.skip("this filesystem does not report read_bytes")
    assert res.physical_bytes <= 1.05 * res.expert_bytes + 128 * 1024
    assert res.physical_bytes >= 0.5 * res.expert_bytes


def _wait_until_writing(proc: subprocess.Popen, out, timeout: float = 120.0) -> bool:
    """Poll until `proc` has made its temporary folder (or, into a new `out`, anything at `out`);
    False if it exited first."""
    fresh = not out.exists()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(out.parent.glob(f".{out.name}.mergedb-tmp-{proc.pid}-*")) or (fresh and out.exists()):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise AssertionError(f"execute wrote nothing within {timeout} s")


def _assert_whole_or_absent(out, want_hash: str) -> None:
    """After a kill: `out` is absent, or complete (manifest, `check_output` clean, the reference's
    content); a leftover temporary/old folder that passes `check_output` is the reference's merge
    too (the manifest is written last, so one killed before it fails the check)."""
    if out.exists():
        assert (out / "mergedb_manifest.json").is_file(), sorted(p.name for p in out.iterdir())
        assert check_output(out) == []
        assert json.loads((out / "mergedb_manifest.json").read_text())["content_hash"] == want_hash
    for side in out.parent.glob(f".{out.name}.mergedb-*"):
        problems = check_output(side)
        if not problems:
            assert json.loads((side / "mergedb_manifest.json").read_text())["content_hash"] == want_hash
        elif not (side / "mergedb_manifest.json").exists():
            assert "not a complete mergedb output" in problems[0]


def _small_ties_plan(tmp_path) -> tuple[Path, int, Path]:
    """(catalog, plan id, output path): a full-read TIES plan over a small 3-expert family, long enough
    to execute that a signal lands while it writes."""
    fam = synth.make_family(tmp_path / "fam", experts=3, size="small", seed=6)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam], base_model="base")
    return db, cat.plan(PlanRequest("base", None, "ties", "all")).plan_id, tmp_path / "out"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_interrupted_or_terminated_execute_leaves_nothing(tmp_path, sig, code):
    """Ctrl-C, or SIGTERM (kill, timeout, docker stop, a scheduler), while the output is written: the
    command cleans up (no output, no temporary folder, no lock) and exits with 128 + the signal (as a
    shell reports it); a second run then writes the output."""
    db, plan_id, out = _small_ties_plan(tmp_path)
    cmd = [sys.executable, "-m", "mergedb.cli", "execute", str(plan_id), "--out", str(out), "-c", str(db), "-q"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert _wait_until_writing(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c.duckdb", "fam"]
    assert subprocess.run(cmd, capture_output=True).returncode == 0 and check_output(out) == []


# the signal lands while Python runs a weakref callback (as an import's module lock's is), where the
# exception it raises is printed and dropped; the `mergedb` process (cli.entry's signal set-up) sends it
# again, to end the command
_DROPPED = (
    "import os, signal, sys, time, weakref\n"
    "from mergedb import cli\n"
    "cli._take_signals()\n"
    "class X: pass\n"
    "x = X()\n"
    "ref = weakref.ref(x, lambda _: (os.kill(os.getpid(), int(sys.argv[1])), time.sleep(0.2)))\n"
    "del x\n"
    "for _ in range(200): time.sleep(0.01)\n"
    "print('went on as if never signalled')\n"
)


# an uncaught KeyboardInterrupt ends Python by SIGINT (-2 here, 130 in a shell); commands catch it first
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_a_signal_dropped_in_a_callback_still_ends_the_command(sig, code):
    res = subprocess.run([sys.executable, "-c", _DROPPED, str(int(sig))], capture_output=True, text=True, timeout=60)
    assert res.returncode == code and "went on" not in res.stdout, res.stdout + res.stderr
    assert "Exception ignored" not in res.stderr, res.stderr


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_an_interrupted_execute_does_not_wait_for_a_stuck_worker(tmp_path, sig, code):
    """A merge worker that never finishes (as one loading numba's cache does when Ctrl-C left the
    import lock held in the main thread, seen twice in this suite): the interrupted command used to
    wait for it forever, holding its output's lock. Here the kernels' warm-up task blocks for good:
    the command still cleans up and exits 130 / 143."""
    db, plan_id, out = _small_ties_plan(tmp_path)
    stuck = (
        "import sys, threading; from mergedb import kernels, cli; "
        "kernels.warm = lambda *a: threading.Event().wait(); "
        "sys.argv = ['mergedb', *sys.argv[1:]]; cli.entry()"
    )
    args = ["execute", str(plan_id), "--out", str(out), "-c", str(db), "-q"]
    proc = subprocess.Popen([sys.executable, "-c", stuck, *args], stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_until_writing(proc, out)
        deadline = time.monotonic() + 60  # until the merge writes (the pools and the stuck task exist)
        while not any(out.parent.glob(f".{out.name}.mergedb-tmp-*/*.safetensors")) and time.monotonic() < deadline:
            time.sleep(0.002)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c.duckdb", "fam"]


def test_killed_execute_leaves_no_complete_output(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=3, size="small", seed=6)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "ties", "all"))
    t0 = time.perf_counter()
    ref = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "ref")
    run_s = time.perf_counter() - t0  # the merge alone; a subprocess adds seconds of start-up first
    want = ref.manifest["content_hash"]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mergedb.cli", "execute", str(plan.plan_id), "--out", str(out), "-c", str(db), "-q"]

    def kill_during_run(extra: list[str], fraction: float) -> bool:
        """Start execute, kill it `fraction` of a run after it starts writing; True when the kill
        landed mid-run (it installed nothing: no new `out`, or its temp folder is left beside one)."""
        before = out.exists()
        proc = subprocess.Popen(cmd + extra)
        started = _wait_until_writing(proc, out)
        time.sleep(fraction * run_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        _assert_whole_or_absent(out, want)
        left = list(out.parent.glob(f".{out.name}.mergedb-tmp-{proc.pid}-*"))
        return started and proc.returncode == -signal.SIGKILL and (bool(left) if before else not out.exists())

    # kills into a new folder: as soon as it starts writing, then a third and two thirds of a run in
    mid_run = [kill_during_run([], f) for f in (0.0, 0.3, 0.7)]
    assert sum(mid_run) >= 2, mid_run  # the kills really landed while the merge was being written
    res = subprocess.run(cmd + ["--force"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    _assert_whole_or_absent(out, want)
    assert out.exists() and not list(tmp_path.glob(".out.mergedb-tmp-*"))  # killed runs' temps removed
    # a kill while replacing a previous output with --force keeps the old one whole (tried earlier
    # into the write when a run ended before the kill: run_s can include the first run's slow start)
    assert any(kill_during_run(["--force"], f) for f in (0.4, 0.1, 0.0))
    assert out.exists()


def _open_under(folder: Path) -> list[str]:
    """The files under `folder` this process holds open (other threads' files do not count)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(folder) + os.sep):
            found.append(target)
    return found


def test_changed_input_refused(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=7)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "linear"))
    xp = cat.execution_plan(plan.plan_id)
    os.utime(fam / "expert_00" / "model.safetensors", ns=(5, 5))
    with pytest.raises(ChangedFileError, match="changed since it was registered"):
        executor.execute(xp, tmp_path / "out")
    assert _open_under(tmp_path) == []  # the base's files, opened first, are closed again
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if "mergedb-tmp" in p.name]


def test_model_stock_full_equals_reference_and_partial_uses_sketches(family, loaded, tmp_path):
    from tests.reference import ref_model_stock

    kind, folder, cat = family
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), "model_stock", "all"))
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "full")
    got = load_model(tmp_path / "full")
    for name, b in loaded["base"].items():
        if b.dtype.kind != "f":
            continue
        want = cast_like(ref_model_stock(b, [loaded[e][name] for e in EXPERTS]), FAMILIES[kind][0])
        assert np.array_equal(got[name], want), name
    half = cat.plan(PlanRequest("base", tuple(EXPERTS), "model_stock", "50%"))
    xp = cat.execution_plan(half.plan_id)
    assert xp.stock is not None and xp.stock.num_rows > 0
    res = executor.execute(xp, tmp_path / "half")
    assert res.expert_bytes == half.selected_bytes <= half.budget_bytes
    rep = executor.replay(tmp_path / "half" / "mergedb_manifest.json", tmp_path / "half2")
    assert rep.manifest["tensor_hashes"] == res.manifest["tensor_hashes"]


def test_della_keeps_by_magnitude_rank(tmp_path):
    """DELLA keeps about `density` of the changed elements, larger |Δ| more often, rescaled by 1/p."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", dtype="fp32", seed=12)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "della_linear", "all", params={"density": 0.5, "epsilon": 0.3}, seed=3))
    got = executor.merge_to_dict(cat.execution_plan(plan.plan_id), dtype="fp32")
    base, exp = load_model(fam / "base"), load_model(fam / "expert_00")
    name = "lm_head.weight"
    d = (exp[name] - base[name]).reshape(-1)
    dp = (got[name] - base[name]).reshape(-1)
    changed = d != 0
    kept = changed & (dp != 0)
    assert abs(kept.sum() / changed.sum() - 0.5) < 0.02
    a = np.abs(d[changed])
    k = kept[changed]
    lo, hi = np.quantile(a, [0.25, 0.75])
    assert k[a >= hi].mean() > k[a <= lo].mean() + 0.3  # keep probability rises with rank (0.2 → 0.8)
    ratio = dp[kept] / d[kept]  # 1/p with p in [0.2, 0.8]
    assert ratio.min() >= 1 / 0.8 - 1e-3 and ratio.max() <= 1 / 0.2 + 1e-3


@pytest.mark.parametrize("in_kernel", [True, False])
def test_untouched_tensors_are_the_bases_bytes_copied_file_to_file(family, tmp_path, monkeypatch, in_kernel):
    """A budgeted merge at the base's dtype copies each tensor it leaves untouched from the base file
    (os.copy_file_range, or chunked reads and writes where the file systems cannot): the output holds
    the base's bytes (read by the safetensors library) and the manifest the xxh3 of what was written."""
    import xxhash

    from tests.reference import load_raw

    kind, folder, cat = family
    copied = []
    real = os.copy_file_range

    def spy(src, dst, n, off_src=None, off_dst=None):
        if not in_kernel:
            raise OSError(18, "Invalid cross-device link")  # EXDEV: the chunked fallback
        copied.append(real(src, dst, n, off_src, off_dst))
        return copied[-1]

    monkeypatch.setattr(os, "copy_file_range", spy)
    plan = cat.plan(PlanRequest("base", tuple(EXPERTS), "task_arithmetic", "10%", WEIGHTS, {"lambda": 0.9}))
    xp = cat.execution_plan(plan.plan_id)
    touched = {xp.tensors[ti].name for ti in xp.selected()}
    res = executor.execute(xp, tmp_path / "out")
    base, out = load_raw(folder / "base"), load_raw(tmp_path / "out")
    untouched = set(base) - touched
    assert untouched and touched and set(out) == set(base)  # both paths run
    for name, data in out.items():
        assert res.manifest["tensor_hashes"][name] == xxhash.xxh3_128_hexdigest(data), name
        assert (data == base[name]) if name in untouched else len(data) == len(base[name]), name
    assert sum(copied) == (sum(len(base[n]) for n in untouched) if in_kernel else 0)


def _hand_family(tmp_path, base: dict, expert: dict) -> Catalog:
    """A catalog of a base and one expert "e0" written here from torch tensors (Llama configs)."""
    from safetensors.torch import save_file

    for name, tensors in (("base", base), ("e0", expert)):
        (tmp_path / "fam" / name).mkdir(parents=True)
        save_file(tensors, str(tmp_path / "fam" / name / "model.safetensors"))
        (tmp_path / "fam" / name / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base")
    return cat


@pytest.mark.parametrize("shape", [(0, 8), (0,)])
def test_zero_size_tensors_merge_with_every_unit_path(tmp_path, shape):
    """A zero-size tensor beside a real one: with another output dtype or with SLERP every block is a
    unit of the fused pass, the empty one included (it raised a reshape ValueError, unrecorded); the
    outputs hold the empty tensor and the other's merge, computed here in torch."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    base = {"model.layers.0.w": torch.randn(8, 8, generator=g), "model.empty": torch.zeros(shape)}
    delta = 0.3 * torch.randn(8, 8, generator=g)
    expert = {"model.layers.0.w": base["model.layers.0.w"] + delta, "model.empty": torch.zeros(shape)}
    cat = _hand_family(tmp_path, base, expert)
    ta = cat.plan(PlanRequest("base", ("e0",), "task_arithmetic", "all", params={"lambda": 0.5}))
    sl = cat.plan(PlanRequest("base", ("e0",), "slerp", "all", params={"t": 0.3}))
    cat.execute(ta.plan_id, tmp_path / "bf16", dtype="bf16")
    cat.execute(sl.plan_id, tmp_path / "slerp")
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert got["model.empty"].shape == shape and got["model.empty"].dtype == torch.bfloat16
    want = (base["model.layers.0.w"] + 0.5 * delta).to(torch.bfloat16)
    assert torch.equal(got["model.layers.0.w"], want)
    slerped = load_file(str(tmp_path / "slerp" / "model.safetensors"))
    assert slerped["model.empty"].shape == shape
    a, b = base["model.layers.0.w"].double().flatten(), expert["model.layers.0.w"].double().flatten()
    omega = torch.arccos(torch.clamp(a @ b / (a.norm() * b.norm()), -1, 1))
    ref = (torch.sin(0.7 * omega) * a + torch.sin(0.3 * omega) * b) / torch.sin(omega)
    assert torch.allclose(slerped["model.layers.0.w"].double().flatten(), ref, rtol=1e-5, atol=1e-6)
    assert check_output(tmp_path / "bf16") == [] and check_output(tmp_path / "slerp") == []


def test_ties_off_the_density_grid_keeps_at_least_the_top_k(tmp_path):
    """A density off the catalog's grid takes its threshold from the magnitude summary: every |Δ| ≥
    the k-th largest is kept (k = max(1, int(density·n)), computed here in numpy), a larger density
    never keeps fewer, and bf16 deltas keep exactly what the k-th-largest rule keeps. The bin's
    middle, used before, kept nothing of a four-element tensor at 0.237 and fewer at 0.0505 than
    at 0.05."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(3)
    bw = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    base = {"model.layers.0.small": torch.ones(4), "model.layers.0.w": bw}
    expert = {
        "model.layers.0.small": torch.ones(4) + torch.tensor([0.297, 0.1, 0.05, 0.01]),
        "model.layers.0.w": (bw.float() + torch.randn(256, 256, generator=g) * 5e-4).to(torch.bfloat16),
    }
    cat = _hand_family(tmp_path, base, expert)
    kept_before = {}
    for d in (0.05, 0.0505, 0.2, 0.237, 0.25):  # off the grid: 0.0505, 0.237
        plan = cat.plan(PlanRequest("base", ("e0",), "ties", "all", params={"density": d}))
        cat.execute(plan.plan_id, tmp_path / f"d{d}")
        got = load_file(str(tmp_path / f"d{d}" / "model.safetensors"))
        for name in base:
            a = (expert[name].float() - base[name].float()).abs().flatten()
            k = max(1, int(d * a.numel()))
            kth = torch.topk(a, k).values[-1]
            kept = (got[name].float() - base[name].float()).flatten() != 0
            assert bool(kept[a >= kth].all()), (name, d)  # never fewer than the top k
            if name == "model.layers.0.w":  # bf16: exactly the k-th-largest rule, ties kept
                assert torch.equal(kept, a >= kth), (d, int(kept.sum()), int((a >= kth).sum()))
            assert int(kept.sum()) >= kept_before.get(name, 0), (name, d)  # monotone in density
            kept_before[name] = int(kept.sum())


def test_a_tensor_of_nine_dimensions_merges_checks_and_replays(tmp_path):
    """The header reader took up to 16 dimensions but the manifest's check only 8: a merge of a
    9-dimensional tensor succeeded and then check and replay called its manifest damaged."""
    import torch
    from safetensors.torch import load_file

    shape = (1,) * 8 + (2, 4)
    base = {"model.w": torch.zeros(shape)}
    expert = {"model.w": torch.arange(8.0).reshape(shape)}
    cat = _hand_family(tmp_path, base, expert)
    plan = cat.plan(PlanRequest("base", ("e0",), "task_arithmetic", "all", params={"lambda": 0.5}))
    cat.execute(plan.plan_id, tmp_path / "out")
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["model.w"], 0.5 * expert["model.w"])
    assert check_output(tmp_path / "out") == []
    executor.replay(tmp_path / "out" / "mergedb_manifest.json", tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (
        tmp_path / "out" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
def test_a_disjoint_mean_divides_by_tiny_agreeing_weights(tmp_path, method):
    """TIES's disjoint mean divides by the sum of the agreeing weights; only a zero sum counts as 1
    (mergekit: divisor[divisor == 0] = 1). Sums under 1e-8 were taken as 1, so an element backed by an
    expert of weight 5e-9 alone was scaled by 5e-9, and weights (1e-9, 1e-9) merged nearly nothing,
    although the normalised mean does not depend on the weights' scale. Expected values by hand."""
    import torch
    from safetensors.torch import load_file, save_file

    rows = {"base": [0, 0, 0, 0], "e0": [0.5, 0, 0.5, 0], "e1": [0, 0.25, 0.5, 0]}
    for name, row in rows.items():
        (tmp_path / "fam" / name).mkdir(parents=True)
        tensors = {"model.layers.0.w": torch.tensor([row], dtype=torch.float32)}
        save_file(tensors, str(tmp_path / "fam" / name / "model.safetensors"))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base")
    want = np.array([[0.5, 0.25, 0.5, 0.0]], np.float32)
    plans = [
        cat.plan(PlanRequest("base", ("e0", "e1"), method, "all", params={"density": 1.0}, weights=w))
        for w in ((1.0, 5e-9), (1e-9, 1e-9), (1.0, 1.0))
    ]
    for plan in plans:
        cat.execute(plan.plan_id, tmp_path / f"out-{plan.plan_id}")
        got = load_file(str(tmp_path / f"out-{plan.plan_id}" / "model.safetensors"))["model.layers.0.w"].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(plan.plan_id))
    swept = list(cat.sweep([p.plan_id for p in plans]))  # the plans merged together (multifold's finish)
    assert [s.plan_id for s, _ in swept] == [p.plan_id for p in plans]
    for _, state in swept:
        np.testing.assert_allclose(state["model.layers.0.w"], want, rtol=1e-6)


@pytest.mark.parametrize("terminated, interrupt, code", [(15, SystemExit(143), 143), (0, KeyboardInterrupt(), 130)])
def test_an_interrupt_that_breaks_a_lock_as_it_unwinds_exits_as_the_interrupt(monkeypatch, terminated, interrupt, code):
    """SIGTERM landing in Thread.start (the executor's prefetch) raised inside a Condition's wait, and
    its release then raised "RuntimeError: release unlocked lock" over it: the clean-up ran, but the
    command printed a traceback and exited 1 (seen once in a test run here). It exits as the signal."""
    import types

    from typer.testing import CliRunner

    from mergedb import cli

    def broken(*args):
        try:
            raise interrupt
        except BaseException:
            raise RuntimeError("release unlocked lock")  # noqa: B904  (its __context__ is the interrupt, as there)

    monkeypatch.setattr(cli, "_TERMINATED", terminated)
    monkeypatch.setattr(cli, "_catalog", lambda *args: types.SimpleNamespace(sql=broken))
    assert CliRunner().invoke(cli.app, ["sql", "SELECT 1"]).exit_code == code
    monkeypatch.setattr(cli, "_TERMINATED", 0)
    monkeypatch.setattr(cli, "_catalog", lambda *args: types.SimpleNamespace(sql=lambda *a: [][1]))
    other = CliRunner().invoke(cli.app, ["sql", "SELECT 1"])
    assert other.exit_code == 1 and isinstance(other.exception, IndexError)  # any other error is itself


def test_a_merge_waiting_to_record_its_run_says_so_and_an_interrupt_then_says_the_output_is_whole(tmp_path):
    """A finished execute waited up to 30 s for a catalog another process held, saying nothing; Ctrl-C
    then exited 130 silently, though the output was complete (a rerun was refused: "exists and is not
    empty") (concurrency review). It says whom it waits for, and the interrupt says what is complete."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=5)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "ties", "all"))
    hold = (
        "import duckdb, sys, time; con = duckdb.connect(sys.argv[1], read_only=True); "
        "print(1, flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(db)], stdout=subprocess.PIPE, text=True)
    out = tmp_path / "out"
    try:
        assert holder.stdout.readline().strip() == "1"
        cmd = [
            sys.executable,
            "-m",
            "mergedb.cli",
            "execute",
            str(plan.plan_id),
            "--out",
            str(out),
            "-c",
            str(db),
            "-q",
        ]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (out / "mergedb_manifest.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # the run is recorded after the output is installed: it waits for the catalog now
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        holder.kill()
        holder.wait()
    text = " ".join(err.split())
    assert proc.returncode == 130, err
    assert f"is locked by process {holder.pid}; waiting for it (up to 30 s)" in text, err
    assert f"the merge into {out} is complete and good" in text and "run was not recorded" in text, err
    assert check_output(out) == [] and cat.sql("SELECT count(*) AS n FROM runs").column("n")[0].as_py() == 0
