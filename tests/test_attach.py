"""The process's one DuckDB database (attach.py): a catalog is attached only while an operation runs.

What a user relies on, each checked from another process or against the file itself: the catalog's
lock is released and its WAL checkpointed when an operation returns or fails, a nested opening of
the same file shares its attachment, a mode clash is refused, and a child started by fork, or a
thread on another catalog, opens its catalog without touching the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pytest

from mergedb import attach, synth
from mergedb.catalog import Catalog
from mergedb.errors import CatalogError
from mergedb.planner import PlanRequest
from mergedb.synth import simulate

# another process opens the file read-write, as a second `mergedb` would, and counts the plans
_OTHER = (
    "import duckdb, sys; c = duckdb.connect(sys.argv[1]); "
    "print(c.execute('SELECT count(*) FROM plans').fetchall()[0][0]); c.close()"
)


def _other_process_count(path: Path) -> int:
    res = subprocess.run([sys.executable, "-c", _OTHER, str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return int(res.stdout)


@pytest.fixture
def cat(tmp_path) -> Catalog:
    c = Catalog(tmp_path / "c.duckdb")
    simulate(c, 2, 1, 2)
    return c


def _plan(cat: Catalog) -> int:
    base = cat.checkpoints()[0].name
    return cat.plan(PlanRequest(base, None, "task_arithmetic", "all")).plan_id


def test_an_operation_releases_the_file_and_leaves_no_wal(cat):
    before = _other_process_count(cat.path)
    _plan(cat)
    assert not Path(f"{cat.path}.wal").exists()  # the plan is in the file itself: a copy of it holds it
    assert _other_process_count(cat.path) == before + 1
    _plan(cat)  # and this process opens it again after the other one
    assert _other_process_count(cat.path) == before + 2


def test_a_failed_operation_releases_the_file(cat):
    with pytest.raises(CatalogError), cat.duckdb_connection(write=True) as con:
        con.execute("BEGIN")
        con.execute("DELETE FROM plans")
        raise CatalogError("the operation failed")  # rolled back by the connection's close
    assert _other_process_count(cat.path) == 0  # opened read-write by another process: not held here
    with cat.duckdb_connection() as con:
        assert con.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 3


def test_nested_openings_share_one_attachment_and_a_mode_clash_is_refused(cat):
    with cat.duckdb_connection() as outer, pytest.raises(CatalogError, match="cannot run inside a read-only one"):
        with cat.duckdb_connection(write=True):  # a writer inside a reader
            pass
    with cat.duckdb_connection(write=True) as outer:
        outer.execute("CREATE TEMP TABLE t AS SELECT 1 AS a")
        with cat.duckdb_connection(write=True) as inner:  # the same thread, the same file
            assert inner.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 3
        # the inner one's end did not detach the outer one's file
        assert outer.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 3
        with cat.duckdb_connection() as reader:  # a reader inside a writer reads through it
            assert reader.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 3
        with pytest.raises(CatalogError, match="different configuration"), cat.duckdb_connection(sandbox=True):
            pass
        assert outer.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 3
        # and the nested openings did not drop the lock (closing any descriptor of the file does)
        res = subprocess.run([sys.executable, "-c", _OTHER, str(cat.path)], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "lock" in res.stderr, res.stdout + res.stderr
    assert _other_process_count(cat.path) == 0


def test_two_threads_on_two_catalogs_at_once(tmp_path):
    cats = [Catalog(tmp_path / f"c{i}.duckdb") for i in range(2)]
    for c in cats:
        simulate(c, 2, 1, 2)
    errors: list[BaseException] = []

    def work(c: Catalog) -> None:
        try:
            for _ in range(5):
                _plan(c)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(c,)) for c in cats]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [_other_process_count(c.path) for c in cats] == [5, 5]


_FORKS = r"""
import os, signal, sys, threading
from mergedb import attach, catalog
from mergedb.catalog import Catalog
cat = Catalog(sys.argv[1])
cat.checkpoints()  # the parent's database exists, nothing attached
codes = []
held = {
    "forked while attach's lock was held": lambda: attach._GUARD,
    "forked while another thread held the file": lambda: catalog._IN_PROCESS[os.path.realpath(cat.path)],
}
for how in ("exits", "plans then exits", *held):
    if how in held:  # another thread inside attach.connect, or inside an operation on the file
        taken, done = threading.Event(), threading.Event()
        def hold(lock):
            with lock:
                taken.set()
                done.wait()
        other = threading.Thread(target=hold, args=(held[how](),))
        other.start()
        taken.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang shows as SIGALRM
        if how != "exits":
            cat.checkpoints()
        sys.exit(0)  # a normal exit: the interpreter's teardown runs
    if how in held:
        done.set()
        other.join()
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
cat.checkpoints()
print(codes)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_forked_children_exit_cleanly(cat):
    """A child started by fork after the parent made its database must not free it (it crashed with
    SIGSEGV at a normal exit), nor wait on a lock another thread of the parent held at the fork."""
    res = subprocess.run([sys.executable, "-c", _FORKS, str(cat.path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[-2] == "[0, 0, 0, 0]", res.stdout + res.stderr


_FULL = r"""
import os, resource, signal, sys, threading
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest
full, other = Catalog(sys.argv[1]), Catalog(sys.argv[2])
base = full.checkpoints()[0].name
ready, go, seen = threading.Event(), threading.Event(), []
def reader():  # another thread, another catalog, a connection open across the failed checkpoint
    with other.duckdb_connection() as con:
        ready.set()
        go.wait()
        seen.append(con.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0])
t = threading.Thread(target=reader)
t.start()
ready.wait()
size = os.path.getsize(full.path)
resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))  # the file cannot grow
try:
    plan = full.plan(PlanRequest(base, None, "task_arithmetic", "all"))
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    go.set()
    t.join()
print(plan.plan_id, seen, os.path.exists(f"{full.path}.wal"), full.get_plan(plan.plan_id).plan_hash == plan.plan_hash)
"""


def test_a_checkpoint_that_fails_at_release_keeps_the_committed_plan(tmp_path):
    """The file cannot grow when the operation ends (a full disk): the plan was committed (its rows
    are in the WAL), so the call returns it, as closing a connection did; another thread's connection
    to another catalog is untouched; the next opening replays the WAL."""
    full, other = Catalog(tmp_path / "full.duckdb"), Catalog(tmp_path / "other.duckdb")
    simulate(full, 2, 1, 2)
    simulate(other, 2, 1, 2)
    res = subprocess.run(
        [sys.executable, "-c", _FULL, str(full.path), str(other.path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1", "[3]", "True", "True"], res.stdout + res.stderr
    assert full.get_plan(1).method == "task_arithmetic"  # and here, another process


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_opens_its_own_database(cat):
    _plan(cat)  # the parent's database exists before the fork
    pid = os.fork()
    if pid == 0:  # the child: plans in the same catalog, then leaves without cleanup
        code = 0
        try:
            _plan(cat)
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    _plan(cat)  # the parent's database still works
    assert _other_process_count(cat.path) == 3


_FORK_WHILE_OPEN = r"""
import os, subprocess, sys
from mergedb import attach, synth
from mergedb.catalog import Catalog
attach.LARGE = int(sys.argv[2])  # -1: every file opened in a database of its own
cat = Catalog(sys.argv[1])
with cat.duckdb_connection(write=True) as con:
    con.execute("CREATE TABLE parent_t AS SELECT range AS i FROM range(10)")
    pid = os.fork()
    if pid == 0:
        try:
            with cat.duckdb_connection(write=True) as c2:
                c2.execute("CREATE TABLE child_t AS SELECT 1 AS i")
            print("child wrote", flush=True)
        except BaseException as e:
            print("child refused:", e, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    con.execute("CREATE TABLE parent_t2 AS SELECT 1 AS i")
mine = "SELECT table_name AS t FROM duckdb_tables() WHERE table_name IN ('parent_t', 'parent_t2', 'child_t')"
print(sorted(r["t"] for r in cat.sql(mine).to_pylist()))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
@pytest.mark.parametrize("large", [-1, attach.LARGE])
def test_a_child_forked_while_its_parent_has_the_file_open_is_refused_it(cat, large):
    """A child forked while the parent has the catalog open, as another thread may: a database of its
    own (a large file) came back from DuckDB's cache as the parent's, and the child's writes were lost
    without a word; an attached one was refused with "Unique file handle conflict". Both are refused
    now, saying why; the parent's work stands."""
    res = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_OPEN, str(cat.path), str(large)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0].startswith("child refused:") and "forked from" in out[0] and "'spawn'" in out[0], res.stdout
    assert out[-1] == str(["parent_t", "parent_t2"]), res.stdout


def test_a_file_replaced_between_operations_is_read_anew(cat, tmp_path):
    other = Catalog(tmp_path / "other.duckdb")
    simulate(other, 3, 1, 2)
    assert len(cat.checkpoints()) == 3
    os.replace(other.path, cat.path)  # between operations nothing holds the file: it may change
    assert len(cat.checkpoints()) == 4


def test_closing_a_connection_twice_is_harmless(cat):
    con = attach.connect(str(cat.path), read_only=True)
    attach.close(con)
    attach.close(con)
    assert _other_process_count(cat.path) == 0
    with pytest.raises(duckdb.ConnectionException):
        con.execute("SELECT 1")


def test_an_opening_nested_in_a_database_of_its_own_shares_that_database(cat):
    """A registration's transaction has a database of its own (its memory limit); an opening nested in
    it must not attach the same file to the shared database too (two databases writing one file)."""
    with cat.duckdb_connection(write=True, alone=True) as outer:
        outer.execute("BEGIN")
        outer.execute("DELETE FROM plans")
        with cat.duckdb_connection(write=True) as inner:  # DuckDB's cache: the outer one's database
            assert inner.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 3
            assert not attach._attached
        outer.execute("ROLLBACK")
    assert not attach._own and not attach._attached
    with cat.duckdb_connection(write=True), pytest.raises(CatalogError, match="different configuration"):
        with cat.duckdb_connection(write=True, alone=True):
            pass


def _interrupting(monkeypatch, word: str, after: bool, how: BaseException) -> None:
    """attach's next statement starting with `word` is interrupted (Ctrl-C: `how`, as Python or as
    DuckDB raise it) before DuckDB runs it, or after it ran (`after`)."""
    run = attach._run
    left = [1]

    def interrupted(host, sql):
        if sql.startswith(word) and left[0]:
            left[0] = 0
            if after:
                run(host, sql)
            raise how
        return run(host, sql)

    monkeypatch.setattr(attach, "_run", interrupted)


@pytest.mark.parametrize("how", [KeyboardInterrupt(), RuntimeError("Query interrupted")], ids=["python", "duckdb"])
@pytest.mark.parametrize("word,after", [("DETACH", False), ("ATTACH", True)])
def test_an_interrupted_attach_or_detach_is_detached_by_the_next_opening(cat, monkeypatch, word, after, how):
    """Ctrl-C during a DETACH (or after an ATTACH ran, before it was recorded) leaves the file attached:
    the next opening detaches it first (before: every later opening failed, "database not found" or
    "Unique file handle conflict"), and meanwhile `holds` says so, so the next opening does not read
    the file's header and drop the lock that DuckDB holds. DuckDB's form of Ctrl-C (a RuntimeError)
    ends as the KeyboardInterrupt it stands for."""
    request = PlanRequest(cat.checkpoints()[0].name, None, "task_arithmetic", "all")
    _interrupting(monkeypatch, word, after, how)
    with pytest.raises(KeyboardInterrupt):  # at the plan's ATTACH, or at its DETACH after the COMMIT
        cat.plan(request)
    assert attach.holds(str(cat.path))  # still attached: another process is kept out
    res = subprocess.run([sys.executable, "-c", _OTHER, str(cat.path)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "lock" in res.stderr, res.stdout + res.stderr
    _plan(cat)  # the next opening detaches it, then works as usual
    assert not attach.holds(str(cat.path))
    assert _other_process_count(cat.path) == (1 if word == "ATTACH" else 2)


_LEAVES = r"""
import os, sys
from mergedb.catalog import Catalog
Catalog(sys.argv[1]).checkpoints()
os._exit(0)  # no exit handlers run, as for a killed process
"""


def test_a_process_leaves_nothing_in_the_temporary_folder(cat, tmp_path):
    """The shared database's spill folder is only named: DuckDB makes it if a query spills. A folder
    made up front was left in /tmp by every process that ended without its exit handlers (84 in
    under an hour of test runs)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    res = subprocess.run([sys.executable, "-c", _LEAVES, str(cat.path)], env=env, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert list(tmp.iterdir()) == []


def _threads(con: duckdb.DuckDBPyConnection) -> int:
    return int(con.execute("SELECT current_setting('threads')").fetchall()[0][0])


def test_a_small_catalog_runs_on_the_callers_thread_and_a_large_one_on_every_core(cat, monkeypatch):
    default = _threads(duckdb.connect())  # DuckDB's own default: one per core
    with cat.duckdb_connection() as con:  # ~1 MiB: attached to the shared database
        assert con.execute("SELECT current_database()").fetchall()[0][0].startswith("mergedb_catalog_")
        assert _threads(con) == 1
    monkeypatch.setattr(attach, "LARGE", cat.path.stat().st_size - 1)  # now larger than LARGE
    with cat.duckdb_connection(write=True) as con:
        assert con.execute("SELECT current_database()").fetchall()[0][0] == "c"  # a database of its own
        assert _threads(con) == default
        with cat.duckdb_connection(write=True) as inner:  # nested: shares it
            assert inner.execute("SELECT current_database()").fetchall()[0][0] == "c"
    assert _plan(cat) == 1 and _other_process_count(cat.path) == 1  # released: another process opens it


def test_a_held_file_is_opened_where_it_is_held_whatever_its_size(cat, monkeypatch):
    with cat.duckdb_connection(write=True) as outer:
        monkeypatch.setattr(attach, "LARGE", 0)  # the file "grew" past LARGE while held
        with cat.duckdb_connection(write=True) as inner:
            name = inner.execute("SELECT current_database()").fetchall()[0][0]
            assert name == outer.execute("SELECT current_database()").fetchall()[0][0]
            assert name.startswith("mergedb_catalog_")
    assert _other_process_count(cat.path) == 0


def _statements(monkeypatch) -> list[str]:
    """The ATTACH and DETACH statements attach.py runs from now on."""
    seen: list[str] = []
    run = attach._run

    def counted(host, sql):
        seen.append(sql.split()[0])
        return run(host, sql)

    monkeypatch.setattr(attach, "_run", counted)
    return seen


@pytest.mark.parametrize("large", [False, True])
def test_a_held_catalog_stays_open_across_operations_and_each_plan_is_stored(cat, monkeypatch, large):
    """Catalog.hold: plans and reads inside share one opening (one ATTACH and one DETACH, or one
    database of its own for a large file); other processes are kept out meanwhile; every plan is
    stored, and the file is checkpointed (no WAL) when the block ends."""
    if large:
        monkeypatch.setattr(attach, "LARGE", 0)
    seen = _statements(monkeypatch)
    with cat.hold() as held:
        assert held is cat
        first = _plan(cat)
        assert (os.path.realpath(cat.path) in attach._own) == large  # a database of its own, or attached
        assert Path(f"{cat.path}.wal").exists()  # committed, and not checkpointed: the file is still open
        res = subprocess.run([sys.executable, "-c", _OTHER, str(cat.path)], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "lock" in res.stderr, res.stdout + res.stderr
        second = _plan(cat)
        assert [p.plan_id for p in cat.plans()] == [first, second]  # a read inside the hold
        assert cat.get_plan(first).plan_id == first and len(cat.checkpoints()) == 3
    assert seen == ([] if large else ["ATTACH", "DETACH"])
    assert not attach._own and not attach._attached
    assert not Path(f"{cat.path}.wal").exists()
    assert _other_process_count(cat.path) == 2


_DIE_HOLDING = r"""
import os, sys
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest
cat = Catalog(sys.argv[1])
with cat.hold():
    base = cat.checkpoints()[0].name
    cat.plan(PlanRequest(base, None, "task_arithmetic", "all"))
    os._exit(0)  # killed inside the hold: no DETACH, no checkpoint
"""


def test_a_plan_made_in_a_hold_is_kept_when_the_process_dies_inside_it(cat):
    cmd = [sys.executable, "-c", _DIE_HOLDING, str(cat.path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert Path(f"{cat.path}.wal").exists()  # committed to the WAL, never checkpointed
    assert _other_process_count(cat.path) == 1


@pytest.mark.parametrize("large", [False, True])
def test_inside_a_hold_what_needs_its_own_settings_or_writes_to_a_read_only_hold_is_refused(cat, monkeypatch, large):
    if large:  # held in a database of its own: DuckDB's cache would hand it to a registration, settings and all
        monkeypatch.setattr(attach, "LARGE", 0)
    with cat.hold():
        with pytest.raises(CatalogError, match="open read-write in this thread already: registration and user SQL"):
            cat.sql("SELECT count(*) AS n FROM plans")
        with pytest.raises(CatalogError, match="open read-write in this thread already: registration and user SQL"):
            with cat.duckdb_connection(write=True, alone=True):  # as a registration's transaction opens it
                pass
        assert _plan(cat) == 1  # the refusals left the hold as it was
    assert not attach._own and not attach._attached
    with cat.hold(write=False):
        with pytest.raises(CatalogError, match="cannot run inside a read-only one"):
            _plan(cat)
        assert len(cat.checkpoints()) == 3
        # held read-only: another process may read it meanwhile, not write it
        read = (
            "import duckdb, sys; "
            "print(duckdb.connect(sys.argv[1], read_only=True).execute('SELECT count(*) FROM plans').fetchall()[0][0])"
        )
        res = subprocess.run([sys.executable, "-c", read, str(cat.path)], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout.strip() == "1", res.stdout + res.stderr
        res = subprocess.run([sys.executable, "-c", _OTHER, str(cat.path)], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "lock" in res.stderr, res.stdout + res.stderr
    assert [p.plan_id for p in cat.plans()] == [1]


def test_an_error_raised_inside_a_hold_reaches_the_caller_as_it_was(cat):
    """A DuckDB error of the program's own (its own database, say) inside a hold is not the catalog's:
    it is not explained as a damaged or unwritable catalog, and the catalog is released."""
    mine = duckdb.connect()
    with pytest.raises(duckdb.InvalidInputException, match="checksum mismatch in my eval file"), cat.hold():
        mine.execute("SELECT error('checksum mismatch in my eval file')")
    with pytest.raises(RuntimeError, match="Query interrupted"), cat.hold():
        raise RuntimeError("Query interrupted")  # the program's, not a Ctrl-C DuckDB turned into one
    assert _other_process_count(cat.path) == 0


def test_execute_inside_a_read_only_hold_is_refused_before_it_merges(tmp_path):
    fam = synth.make_family(tmp_path / "family", experts=2, size="tiny", seed=3)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all")).plan_id
    with cat.hold(write=False), pytest.raises(CatalogError, match="open read-only in this thread.*nothing was merged"):
        cat.execute(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with cat.hold():  # held read-write, it merges and records the run
        cat.execute(plan, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert cat.sql("SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 1}]


def test_execute_is_not_refused_for_another_threads_read_only_opening(tmp_path):
    """The read-only refusal is for this thread's own hold: while another thread keeps reading the
    catalog (each read a read-only opening), every execute waits its turn and records its run."""
    fam = synth.make_family(tmp_path / "family", experts=2, size="tiny", seed=3)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all")).plan_id
    stop, reads = threading.Event(), [0]

    def reader() -> None:
        while not stop.is_set():
            Catalog(cat.path).checkpoints()
            reads[0] += 1

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(6):
            cat.execute(plan, tmp_path / f"out{i}")
    finally:
        stop.set()
        t.join()
    assert reads[0] > 0
    assert cat.sql("SELECT count(*) AS n FROM runs").to_pylist() == [{"n": 6}]


def test_a_failed_close_is_raised_even_inside_a_callers_except_block(cat, monkeypatch):
    """Whether an operation's own error is in flight was read from sys.exc_info(), which inside the
    connection's generator also sees an exception the caller is handling: a catalog operation (or a
    hold) run in an `except` block lost its closing checkpoint's failure without a word."""
    close = attach.close

    def failing(con):
        close(con)
        raise duckdb.IOException("closing failed")

    monkeypatch.setattr(attach, "close", failing)
    try:
        raise LookupError("the program's own, handled")
    except LookupError:
        with pytest.raises(duckdb.IOException, match="closing failed"), cat.hold():
            pass
        with pytest.raises(duckdb.IOException, match="closing failed"):
            cat.checkpoints()
    monkeypatch.setattr(attach, "close", close)
    assert _other_process_count(cat.path) == 0
