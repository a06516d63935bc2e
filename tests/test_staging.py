"""Registration's rows staged on disk (staging.py): the catalog holds exactly the rows the scan made,
in the same stored order; memory does not grow with the number of experts; nothing is left behind
when a registration fails."""

from __future__ import annotations

import errno
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mergedb import scan, synth
from mergedb.catalog import Catalog
from mergedb.checkpoint import open_checkpoint
from mergedb.errors import MergeDBError
from tests.test_bad_input import snapshot


def _stored(cat: Catalog, table: str, name: str) -> list[tuple]:
    """The rows of one checkpoint in `table` as DuckDB stores them (no ORDER BY: insertion order)."""
    with cat.duckdb_connection() as con:
        return con.execute(
            f"SELECT t.* EXCLUDE (checkpoint_id) FROM {table} t JOIN checkpoints c USING (checkpoint_id) "
            "WHERE c.name = ?",
            [name],
        ).fetchall()


def _content_hash(cat: Catalog, name: str) -> str:
    return cat.sql("SELECT content_hash FROM checkpoints WHERE name = ?", [name]).column(0)[0].as_py()


def _expected(rows: list[tuple], costs: list | None = None) -> list[tuple]:
    """Named rows as DuckDB returns them: numpy arrays as lists, then schema/009's cost column (an
    adapter's costs; NULL for a dense expert)."""
    costs = costs if costs is not None else [None] * len(rows)
    return [tuple(v.tolist() if isinstance(v, np.ndarray) else v for v in r) + (c,) for r, c in zip(rows, costs)]


def _floats32(rows: list[tuple], fields: tuple[str, ...]) -> list[tuple]:
    """float32 scalars (max_abs) compared as float32, as DuckDB's FLOAT returns them widened."""
    at = [i for i, f in enumerate(fields) if f == "max_abs"]
    return [tuple(float(np.float32(v)) if i in at else v for i, v in enumerate(r)) for r in rows]


@pytest.mark.parametrize("threads", [1, 2])
def test_stored_rows_are_the_scans_rows_in_the_same_order(tmp_path, threads):
    """Every expert_blocks and expert_tensors row of every expert, in the order DuckDB stores them,
    equals the row the scan returns in memory (scan_experts without a sink: (tensor, block) order),
    with tensors of several blocks finishing out of order on two threads."""
    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=21)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True, block_size=8192)
    names = [f"expert_{k:02d}" for k in range(3)]
    cat.register([fam / n for n in names], base_model="base", threads=threads)

    from mergedb.register import _load_family

    base, family, hashes = _load_family(cat, "base")
    keyed = {(b.tensor_idx, b.block_idx): h for b, h in zip((b for ft in family for b in ft.blocks), hashes)}
    experts = [open_checkpoint(fam / n) for n in names]
    want = scan.scan_experts(base, experts, family, keyed, cat.sketch_dim(), 1)
    assert sum(len(ft.blocks) > 1 for ft in family) >= 5  # order within and across tensors is exercised
    for name, st in zip(names, want):
        blocks = _stored(cat, "expert_blocks", name)
        assert len(blocks) == len(st.blocks) > 0
        fields = scan.BlockRow._fields
        assert _floats32(blocks, fields) == _floats32(_expected(st.blocks), fields)
        assert _stored(cat, "expert_tensors", name) == _expected(st.tensors)
        assert _content_hash(cat, name) == st.content_hash


def test_adapter_rows_and_costs_are_the_scans(tmp_path):
    """A LoRA adapter goes through the same staging: its rows and read costs equal lorascan's in memory."""
    lf = pytest.importorskip("tests.lora_fixtures")
    from mergedb import lora, lorascan
    from mergedb.register import _load_family

    base_dir = lf.make_base(tmp_path / "base")
    ad_dirs = [lf.make_adapter(base_dir, tmp_path / f"ad{i}", seed=i + 1) for i in range(2)]
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([base_dir], base=True, block_size=4096)
    cat.register(ad_dirs, base_model="base", threads=2)

    base, family, hashes = _load_family(cat, "base")
    keyed = {(b.tensor_idx, b.block_idx): h for b, h in zip((b for ft in family for b in ft.blocks), hashes)}
    ads = [lora.open_adapter(d, base, None) for d in ad_dirs]
    want = lorascan.scan_adapters(base, ads, family, keyed, cat.sketch_dim(), 1)
    fields = (*scan.BlockRow._fields, "read_bytes")
    for ad, st in zip(ads, want):
        costs = [st.read_bytes[r.tensor_idx, r.block_idx] for r in st.blocks]
        blocks = _stored(cat, "expert_blocks", ad.name)
        assert _floats32(blocks, fields) == _floats32(_expected(st.blocks, costs), fields)
        fixed = [st.fixed_bytes.get(r.tensor_idx, 0) for r in st.tensors]
        assert _stored(cat, "expert_tensors", ad.name) == _expected(st.tensors, fixed)
        assert _content_hash(cat, ad.name) == st.content_hash


def _peak_register(catalog: Path, fam: Path, experts: int) -> int:
    """Peak bytes traced (Python objects and numpy arrays) while `experts` experts of `fam` register
    into a new catalog."""
    cat = Catalog(catalog)
    cat.register([fam / "base"], base=True)
    paths = [fam / f"expert_{k:02d}" for k in range(experts)]
    tracemalloc.start()
    try:
        cat.register(paths, base_model="base", threads=2)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_experts_rows(tmp_path):
    """Issue 11: registration's peak memory stays flat in K. Registering 4 experts of 1500 tiny tensors
    peaks above registering 1 by less than half the rows of the 3 more experts: before rows were staged
    on disk, every expert's rows were held until the transaction (3 more experts: 3 × their rows more,
    plus their headers). What still grows is per (expert, tensor) bookkeeping: its header entry
    (~260 bytes: tensorfile.TensorInfo without a __dict__, names and shapes shared between files), its
    entry in the scan's lookup and its block hashes (~130): ~390 bytes measured, under 600. Before
    (a dict per TensorInfo, a list of reads and a dict entry per unit in readahead, a list of units, a
    dict of hashes) it was ~1,040: 330 MB for 16 experts of 20,000 tensors."""
    n = 1500
    fam = synth.many_tensors(tmp_path / "fam", 4, n)
    cat = Catalog(tmp_path / "rows.duckdb")
    cat.register([fam / "base"], base=True)
    from mergedb.register import _load_family

    base, family, hashes = _load_family(cat, "base")
    keyed = {(b.tensor_idx, b.block_idx): h for b, h in zip((b for ft in family for b in ft.blocks), hashes)}
    expert = open_checkpoint(fam / "expert_00")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = scan.scan_experts(base, [expert], family, keyed, cat.sketch_dim(), 1)
        one_expert_rows = tracemalloc.get_traced_memory()[0] - before  # one expert's rows, held
    finally:
        tracemalloc.stop()
    assert len(held[0].blocks) == n and one_expert_rows > n * 1000  # rows, not noise, are measured
    del held
    _peak_register(tmp_path / "warm.duckdb", fam, 1)  # numba's and DuckDB's first-use allocations, once
    one, four = _peak_register(tmp_path / "k1.duckdb", fam, 1), _peak_register(tmp_path / "k4.duckdb", fam, 4)
    assert four - one < 3 * one_expert_rows / 2, (one, four, one_expert_rows)
    assert (four - one) / (3 * n) < 600, (one, four)  # bytes per (expert, tensor) beyond the first expert


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _open_in(folder: Path) -> list[str]:
    """Files this process holds open in `folder` (an unlinked one reads "NAME (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(str(folder) + os.sep):
            out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_a_scan_failing_after_rows_were_staged_leaves_nothing(tmp_path, monkeypatch):
    """An expert whose scan fails after other units' rows were staged (here: its 40th tensor) leaves
    the catalog as it was, no file in the catalog's folder and no file open."""
    from mergedb import blockgroups, staging

    monkeypatch.setattr(staging, "BATCH_ROWS", 8)  # rows go to the file early and often
    monkeypatch.setattr(staging, "MIN_BATCH", 1)
    fam = synth.many_tensors(tmp_path / "fam", 2, 60)
    (tmp_path / "cat").mkdir()
    cat = Catalog(tmp_path / "cat" / "c.duckdb")
    cat.register([fam / "base"], base=True)
    before, entries = snapshot(cat), _entries(tmp_path / "cat")
    staged = []
    real_add, real_stats = staging.Stage.add, blockgroups.expert_stats
    monkeypatch.setattr(staging.Stage, "add", lambda self, *a: (staged.append(a[0]), real_add(self, *a))[1])
    calls = [0]

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 80:
            raise MergeDBError("simulated: a block that cannot be read")
        return real_stats(*a, **k)

    monkeypatch.setattr(blockgroups, "expert_stats", failing)
    with pytest.raises(MergeDBError, match="simulated"):
        cat.register([fam / "expert_00", fam / "expert_01"], base_model="base", threads=2)
    assert {"expert_00", "expert_01"} <= set(staged)  # both experts' rows had been staged
    assert snapshot(cat) == before
    assert _entries(tmp_path / "cat") == entries
    assert _open_in(tmp_path / "cat") == []

    # a new catalog: not made at all
    new = Catalog(tmp_path / "cat" / "new.duckdb")
    calls[0] = 0
    with pytest.raises(MergeDBError, match="simulated"):
        new.register([fam], base_model="base")
    assert _entries(tmp_path / "cat") == entries
    assert _open_in(tmp_path / "cat") == []


@pytest.mark.parametrize("where", ["make", "write"])
def test_a_scratch_file_that_cannot_be_made_or_written_is_a_clear_error(tmp_path, monkeypatch, where):
    """A full disk or a folder that refuses the scratch file: a MergeDBError naming the folder and the
    fix, before the catalog is opened (it is unchanged; a new one is not made)."""
    from mergedb import staging

    fam = synth.many_tensors(tmp_path / "fam", 2, 30)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    before = snapshot(cat)
    full = OSError(errno.ENOSPC, "No space left on device")
    real = staging.tempfile.TemporaryFile

    class Full:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def write(self, data):
            raise full

        def __getattr__(self, name):
            return getattr(self.f, name)

    def refused(*a, **k):
        raise full

    monkeypatch.setattr(staging, "BATCH_ROWS", 8)
    monkeypatch.setattr(staging, "MIN_BATCH", 1)
    monkeypatch.setattr(staging.tempfile, "TemporaryFile", refused if where == "make" else Full)
    said = r"scratch file in .*: its disk is full .*\(No space left on device\); nothing was written to the catalog"
    for c, paths in ((cat, [fam / "expert_00", fam / "expert_01"]), (Catalog(tmp_path / "new.duckdb"), [fam])):
        with pytest.raises(MergeDBError, match=said):
            c.register(paths, base_model="base")
    assert snapshot(cat) == before
    assert not (tmp_path / "new.duckdb").exists()


def test_interrupted_registration_closes_its_scratch_file(tmp_path, monkeypatch):
    """Ctrl-C during the scan: the catalog is unchanged and the scratch file (unlinked from the start,
    so never visible) is closed, which frees its space."""
    from mergedb import staging

    fam = synth.many_tensors(tmp_path / "fam", 2, 40)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    before = snapshot(cat)
    made = []
    real_init = staging.Stage.__init__

    def init(self, folder):
        real_init(self, folder)
        made.append(self)

    real_add, adds = staging.Stage.add, []

    def interrupt(self, *a, **k):  # Ctrl-C once rows went to the file
        real_add(self, *a, **k)
        adds.append(1)
        if len(adds) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(staging, "BATCH_ROWS", 1)
    monkeypatch.setattr(staging, "MIN_BATCH", 1)
    monkeypatch.setattr(staging.Stage, "__init__", init)
    monkeypatch.setattr(staging.Stage, "add", interrupt)
    with pytest.raises(KeyboardInterrupt):
        cat.register([fam / "expert_00", fam / "expert_01"], base_model="base")
    assert made and all(s._file is not None and s._file.closed for s in made)
    assert snapshot(cat) == before
    assert _open_in(tmp_path) == []


def test_a_registration_with_nothing_to_scan_makes_no_scratch_file(tmp_path, monkeypatch):
    """Registering an unchanged expert again (a pipeline's idempotent step) must not need a new file
    in the catalog's folder (second-look review: a read-only folder refused it once staging came)."""
    from mergedb import staging

    fam = synth.many_tensors(tmp_path / "fam", 1, 20)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    before = snapshot(cat)

    def refused(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(staging.tempfile, "TemporaryFile", refused)
    res = cat.register([fam / "expert_00"], base_model="base")
    assert res.unchanged == ("expert_00",) and snapshot(cat) == before


def test_many_experts_side_by_side_stage_batches_of_many_rows(tmp_path):
    """Units run tensor by tensor over all experts: flushing every BATCH_ROWS rows over all experts
    wrote batches of a row or two per expert at K = 400 (second-look review: a pread and an IPC
    decode per row at the insert). Each (expert, table) batch but its last now holds ≥ MIN_BATCH rows,
    and every row comes back in order."""
    from mergedb import staging

    k, tensors = 100, 300
    stage = staging.Stage(tmp_path)
    dim = 4
    for t in range(tensors):  # as the scan hands them over: tensor t of every expert
        for e in range(k):
            block = scan.BlockRow(t, 0, False, 1.0 + e, 1.0, 3, 0, f"h{e}-{t}", [0.0], [1.0], [3], [1.0], [1.0],
                                  [0.5] * dim, 0.0)  # fmt: skip
            stage.add(f"e{e}", [block], [scan.TensorRow(t, False, [0.1], [1], [3])])
    stage.finish()
    for (key, table), batches in stage._batches.items():
        sizes = [staging.pa.ipc.read_record_batch(staging.pa.py_buffer(os.pread(stage._file.fileno(), n, o)),
                                                  stage._schemas[key, table]).num_rows for o, n in batches]  # fmt: skip
        assert sum(sizes) == tensors and min(sizes[:-1], default=staging.MIN_BATCH) >= staging.MIN_BATCH, sizes
    rows = stage._read("e7", "expert_blocks").read_all()
    assert rows.column("tensor_idx").to_pylist() == list(range(tensors))
    assert rows.column("content_hash").to_pylist() == [f"h7-{t}" for t in range(tensors)]
    stage.close()


def test_the_transaction_runs_under_a_memory_limit_and_again_where_duckdb_cannot_spill(tmp_path, monkeypatch):
    """DuckDB held a registration's inserted rows in memory until COMMIT, so peak memory grew with K
    (~60 MB per expert of 20k tensors). The transaction now runs under register.TRANSACTION_MEMORY:
    what DuckDB holds stays near it (the rest spills into CATALOG.tmp/, gone afterwards) and the
    catalog is the same. Where it cannot (CATALOG.tmp cannot be made; a limit too small for what does
    not spill), the transaction runs again under the connection's own limit: the same catalog again."""
    import importlib

    from mergedb import staging

    register = importlib.import_module("mergedb.register")  # the package exports a register() too
    fam = synth.many_tensors(tmp_path / "fam", 2, 8000)
    seen: list[tuple[str, int]] = []  # (memory_limit, bytes DuckDB holds) after each expert's rows
    insert = staging.Stage.insert

    def spy(self, con, key, cid):
        insert(self, con, key, cid)
        held = con.execute("SELECT sum(memory_usage_bytes)::BIGINT FROM duckdb_memory()").fetchall()[0][0]
        seen.append((con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0], held))

    monkeypatch.setattr(staging.Stage, "insert", spy)
    monkeypatch.setattr(register, "TRANSACTION_MEMORY", 2**60)  # above any machine's: the old behaviour
    ref = Catalog(tmp_path / "ref.duckdb")
    ref.register([fam], base_model="base")
    base_limit = 32 * 2**20
    with ref.duckdb_connection(alone=True) as con:  # a database of its own, as the registration's
        threads = con.execute("SELECT current_setting('threads')").fetchall()[0][0]
    # 2 experts × (a block and a tensor row) × 8000 tensors
    limit = base_limit + register.THREAD_MEMORY * threads + register.SKETCH_MEMORY * ref.sketch_dim()
    limit += register.KEY_BYTES * 2 * 2 * 8000
    assert seen[-1][1] > limit  # what this transaction holds without the limit
    for name, setting, blocked in (
        ("spilled", base_limit, False),
        ("blocked", base_limit, True),
        ("tiny", 2**20, False),
    ):
        monkeypatch.setattr(register, "TRANSACTION_MEMORY", setting)
        if blocked:  # DuckDB makes CATALOG.tmp/ to spill into: a file of that name refuses it
            (tmp_path / f"{name}.duckdb.tmp").write_text("not a folder")
        seen.clear()
        cat = Catalog(tmp_path / f"{name}.duckdb")
        assert cat.register([fam], base_model="base").registered == ("base", "expert_00", "expert_01")
        limits = [register._limit_bytes(v) for v, _ in seen]
        if name == "spilled":
            # shown as "42.7 MiB" with 2 threads and sketches of 64
            assert len(seen) == 2 and all(abs(v - limit) < 2**20 / 10 for v in limits), seen
            assert max(h for _, h in seen) <= limit, seen
            assert not (tmp_path / f"{name}.duckdb.tmp").exists()
        else:  # the try under the limit failed (before or after the first expert's rows); the next ran
            assert min(limits[-2:]) > 100 * limit, seen  # under the process's own limit, to the end
        for table in ("expert_blocks", "expert_tensors"):
            for e in ("expert_00", "expert_01"):
                assert _stored(cat, table, e) == _stored(ref, table, e)
        with cat.duckdb_connection() as con:  # the limit is the connection's own again
            own = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
            assert register._limit_bytes(own) > 100 * limit
