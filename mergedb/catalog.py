"""The catalog: a DuckDB file holding checkpoints, block layouts, delta statistics, plans and runs.

This module owns the connection (opened briefly around each operation, or for a program's block
of them with `Catalog.hold`: DuckDB's file lock keeps every other process out while one holds it
read-write), the schema migrations, and the `Catalog`
façade that the CLI and library users call. The work behind each operation lives in its own
module: register.py (registration), planner.py (plans), plans.py (stored plans read back),
check.py (integrity), executor.py (merges).

It is long because it is that façade: one short method per operation, each importing the module
that does the work when it is called, so that `mergedb execute` loads no planner, registration or
statistics code (tests/test_help.py checks).
"""

from __future__ import annotations

import math
import numbers
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from . import attach, faults, plans, schemaversion, scores, usersql
from .errors import CatalogError, MergeDBError, PlanError, RunNotRecordedError
from .resources import migrations
from .units import BlockSizes

if TYPE_CHECKING:
    from . import forget, planner, register
    from .executor import ExecuteResult, WriteShards
    from .manifest import ExecutionPlan

DEFAULT_PATH = "mergedb.duckdb"


def default_path() -> Path:
    return Path(os.environ.get("MERGEDB_CATALOG") or DEFAULT_PATH)


@dataclass(frozen=True)
class CheckpointRow:
    """A registered checkpoint."""

    name: str
    role: str
    base: str | None
    path: str
    dtype: str
    n_tensors: int
    bytes: int
    fingerprint: str


_LOCK = re.compile(r"lock", re.IGNORECASE)
_PID = re.compile(r"PID (\d+)")
_IN_PROCESS: dict[str, threading.RLock] = {}  # per catalog file: one connection at a time in this process
_IN_PROCESS_GUARD = threading.Lock()


def _forked() -> None:
    """In a child started by fork: the parent's threads that held these locks are not in the child."""
    global _IN_PROCESS_GUARD
    _IN_PROCESS_GUARD = threading.Lock()
    _IN_PROCESS.clear()


os.register_at_fork(after_in_child=_forked)


@contextmanager
def _one_at_a_time(path: Path) -> Iterator[None]:
    """Hold this process's lock on the catalog file `path` while a connection is open. DuckDB shares
    one database between the connections of a process, so two threads planning at once collided on
    the new plan's id (a raw ConstraintException), and a user-SQL (sandboxed) connection beside any
    other was refused ("a different configuration"). Connections are short; the lock is reentrant
    (a connection may open another in the same thread)."""
    with _IN_PROCESS_GUARD:
        lock = _IN_PROCESS.setdefault(os.path.realpath(path), threading.RLock())
    with lock:
        yield


class _Elsewhere:
    """A Catalog method defined as function `name(cat, ...)` of module `module`, imported when first
    looked up (Catalog.sweep is sweep.in_memory), so importing the catalog does not import it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __get__(self, cat: Catalog | None, owner: type) -> Any:
        fn = getattr(import_module(f".{self.module}", __package__), self.name)
        return fn if cat is None else fn.__get__(cat, owner)


class Catalog:
    """A mergedb catalog file. Cheap to create: nothing is opened until an operation needs it."""

    RECORD_WAIT = 30.0  # seconds a finished merge (execute, sweep) waits at least for the catalog to record its run

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        wait: float = 0.0,
        sketch_dim: int | None = None,
        on_wait: Callable[[str], None] | None = None,
    ):
        """`wait`: seconds to wait for a catalog another process holds; `on_wait(message)` is told
        once per opening that has to wait (which process holds it, for how long it will wait)."""
        if on_wait is not None and not callable(on_wait):
            raise CatalogError(f"on_wait is a function or None, got {type(on_wait).__name__}")
        self._on_wait = on_wait
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise CatalogError(f"a catalog path is a str or a path, got {type(path).__name__}")
        given = Path(path) if path is not None else default_path()
        if "\x00" in os.fsdecode(given):  # os calls raise a bare ValueError for it
            raise CatalogError(f"the catalog path {os.fsdecode(given)!r} holds a NUL byte; pass one without it")
        self.path = Path(os.path.abspath(given))  # as given, the catalog would follow a later os.chdir
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:  # NaN fails >= too
            raise CatalogError(f"--wait must be a number of seconds ≥ 0 (inf: as long as it takes), got {wait!r}")
        try:
            float(wait)
        except OverflowError:  # an int past float's range (10**400): the deadline's sum would overflow
            wait = math.inf
        self.wait = wait
        if sketch_dim is not None:
            from .summary import MAX_SKETCH_DIM

            if not (type(sketch_dim) is int and 0 < sketch_dim <= MAX_SKETCH_DIM):
                raise CatalogError(f"sketch_dim must be a whole number from 1 to {MAX_SKETCH_DIM}: {sketch_dim!r}")
        self._sketch_dim = sketch_dim

    def __repr__(self) -> str:
        return f"Catalog({str(self.path)!r})"

    # -- connections -------------------------------------------------------------------------

    @contextmanager
    def duckdb_connection(
        self, write: bool = False, *, create: bool = False, sandbox: bool = False, alone: bool = False
    ) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short-lived DuckDB connection to a mergedb catalog, one at a time per file in this
        process (`_one_at_a_time`).

        write=True migrates an older catalog; create=True (registration only) also opens a new file or
        an empty DuckDB file, which the caller makes a catalog in its first rows' transaction
        (`make_if_blank`). sandbox=True opens it with `usersql.SANDBOX` (for user SQL). The file is
        attached to the process's one DuckDB database (attach.py) unless sandbox, create or alone=True
        ask for a database of its own, whose settings are the operation's alone (a registration's
        memory limit and its spill folder CATALOG.tmp/, user SQL's locked configuration): a setting
        SET on a shared connection stays for the process's later operations, so an embedding program
        that changes one passes alone=True. A file
        that is not a mergedb catalog is never changed; DuckDB errors that mean the file is damaged,
        or its folder read-only or full, become CatalogErrors saying so.
        """
        with _one_at_a_time(self.path), self._connection(write, create, sandbox, alone or create) as con:
            yield con

    @contextmanager
    def hold(self, write: bool = True) -> Iterator[Catalog]:
        """Keep the catalog open, in this thread, for the operations of a `with` block: for a program
        that plans or reads in a loop (a search choosing its next plans). Each operation inside skips
        opening the file and DuckDB's checkpoint at its end (a repeated TIES plan of the bench family:
        ~28 ms alone, ~19 ms held); the file is checkpointed once, when the block ends. Each operation
        still commits on its own: a plan made inside is stored when `plan` returns, whatever the block
        does next (a process killed inside leaves it in the catalog's `.wal`, which the next opening reads).

        While it is held, other processes wait for the catalog (their `wait`) or are refused, and this
        process's other threads wait until the block ends, whatever their `wait`: hold it for a burst of
        work, not across a long merge. write=False holds it read-only: other processes may read it too,
        and what writes (`plan`, `execute`, which records its run) is refused inside, before it starts.
        What opens the file with settings of its own is refused inside a hold too: registration, and user
        SQL (`sql`, and `tensor_summary` and `sweep`, which run it). An error raised inside the block
        reaches the caller as it was raised.
        """
        opened = self.duckdb_connection(write=write)
        opened.__enter__()
        try:
            yield self
        except BaseException:  # the block's own error, not one of the catalog's to explain: closed, then raised
            try:
                opened.__exit__(None, None, None)
            except BaseException:  # (closing failed too: the block's error says more, and is raised)
                pass
            raise
        opened.__exit__(None, None, None)

    @contextmanager
    def _connection(self, write: bool, create: bool, sandbox: bool, alone: bool) -> Iterator[duckdb.DuckDBPyConnection]:
        # a nested opening leaves the file alone: closing any descriptor of it drops this process's
        # lock on it (POSIX locks), and another process could then open it while it is written
        nested = attach.holds(str(self.path))
        if not nested:
            _created_meanwhile(self.path)
        if write and create and self.path.is_file() and self.path.stat().st_size == 0:
            self.path.unlink()  # a creation cut before DuckDB wrote its header (or a `touch`): nothing to keep
        new = write and create and not self.path.exists()
        if not nested:
            self._check_path(create=write and create)
        try:
            con = self._open(read_only=not write, sandbox=sandbox, alone=alone)
        except BaseException as e:  # an interrupt, or DuckDB could not even write the new file's header
            if new and (not isinstance(e, Exception) or "disk is full" in str(e)):
                self._remove_new()
            if _interrupted(e):  # Ctrl-C during ATTACH (attach.py)
                raise KeyboardInterrupt from None
            raise
        version = -1
        try:
            version, dim, missing = schemaversion.read(con, self.path, create=write and create)
            if write:
                if not (create and version == 0):  # a blank one is made in its first rows' transaction
                    self._migrate(con, version, dim, missing)
            elif version < migrations()[-1][0] or missing:
                attach.close(con)  # an older catalog: upgrade it once, briefly read-write, then read
                with self.duckdb_connection(write=True):
                    pass
                con = self._open(read_only=True, sandbox=sandbox, alone=alone)
        except BaseException as e:
            attach.close(con)
            if new and version <= 0:  # creating the catalog failed (-1: while reading it): no half-made file
                self._remove_new()
            if _interrupted(e):
                raise KeyboardInterrupt from None
            if not isinstance(e, duckdb.Error):
                raise
            err = self._explain(e)
            if err is e:
                raise
            raise err from None
        failed = False  # the operation's own error (sys.exc_info() would also see one a caller is handling)
        try:
            yield con
        except BaseException as e:
            failed = True
            if new:  # the registration that made it failed or was interrupted before writing a checkpoint
                self.discard_if_empty(con)
            if isinstance(e, duckdb.Error):
                err = self._explain(e)
                if err is e:
                    raise
                raise err from None
            if isinstance(e, RuntimeError) and _interrupted(e):
                raise KeyboardInterrupt from None
            raise
        finally:
            try:
                attach.close(con)
            except BaseException as e:
                if isinstance(e, KeyboardInterrupt) or _interrupted(e):  # Ctrl-C during DETACH's checkpoint
                    raise KeyboardInterrupt from None
                if not failed:  # else the operation's own error, which says more, goes on
                    raise

    def wait_while_created(self) -> None:
        """Wait while another process is making this catalog's file right now (`_created_meanwhile`)."""
        _created_meanwhile(self.path)

    def check_creatable(self) -> None:
        """Refuse a path where there is no catalog and none can be made (its folder missing or
        read-only): a registration into a new catalog checks it before reading anything (the catalog
        is made when its rows are written)."""
        folder = self.path.parent
        if self.path.exists():
            return
        if not folder.exists():
            raise CatalogError(
                f"cannot create catalog {self.path}: its folder {folder} does not exist; create it, or pass "
                "--catalog with a path in a writable folder"
            )
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise faults.unwritable(self.path)

    def discard_if_empty(self, con: duckdb.DuckDBPyConnection) -> None:
        """Remove the catalog `con` has open read-write when it holds no checkpoint: a registration that
        made it failed before writing any. Removed while `con` holds the file's lock, so no other
        process has it open; one that opens the path afterwards finds no file and makes a new one."""
        try:
            empty = self.is_blank(con) or con.execute("SELECT count(*) FROM checkpoints").fetchall()[0][0] == 0
        except duckdb.Error:  # the connection cannot tell: leave the file
            return
        if empty:
            self._remove_new()

    def _remove_new(self) -> None:
        for p in (self.path, Path(f"{self.path}.wal")):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass

    def _check_path(self, create: bool) -> None:
        p = self.path
        if not p.exists():
            if create:
                return
            raise CatalogError(f"no catalog at {p}; create one with `mergedb register PATH`")
        if p.is_dir():
            raise CatalogError(f"{p} is a folder, not a mergedb catalog; pass --catalog with a catalog file")
        if p.stat().st_size == 0:
            raise CatalogError(
                f"{p} is an empty file, not a mergedb catalog; remove it (`mergedb register` then creates a catalog "
                "there) or pass --catalog with another path"
            )
        try:
            with open(p, "rb") as f:
                magic = f.read(12)[8:]
        except OSError:
            return  # DuckDB's own error follows, and says why
        if magic != b"DUCK":  # DuckDB would read a .json or .csv file as data, not refuse it
            raise faults.not_duckdb(p)

    def _explain(self, e: duckdb.Error) -> Exception:
        """`faults.diagnose`'s CatalogError for a damaged file or unwritable folder; else `e`."""
        return faults.diagnose(self.path, e) or e

    def _open(self, read_only: bool, sandbox: bool = False, alone: bool = False) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + self.wait
        delay = 0.05
        config = dict(usersql.SANDBOX) if sandbox else {}
        told = self._on_wait is None
        while True:
            try:
                return attach.connect(str(self.path), read_only, config if sandbox or alone else None)
            except duckdb.IOException as e:
                if not _LOCK.search(str(e)) or faults.DAMAGED.search(str(e)):
                    raise self._not_opened(e) from None
                pid = _PID.search(str(e))
                who = f"process {pid.group(1)}" if pid else "another process"
                if not told and time.monotonic() < deadline:
                    told = True
                    self._on_wait(f"catalog {self.path} is locked by {who}; waiting for it (up to {self.wait:g} s)")
                if time.monotonic() >= deadline:
                    raise CatalogError(
                        f"catalog {self.path} is still locked by {who} after waiting {self.wait:g} s; wait for it "
                        "to finish, or pass a longer --wait"
                        if self.wait > 0
                        else f"catalog {self.path} is locked by {who}; wait for it to finish, or pass --wait SECONDS"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except duckdb.Error as e:
                raise self._not_opened(e) from None

    def _not_opened(self, e: duckdb.Error) -> CatalogError:
        return faults.diagnose(self.path, e) or CatalogError(f"cannot open catalog {self.path}: {e}")

    def _migrate(
        self, con: duckdb.DuckDBPyConnection, current: int, dim: int | None = None, missing: tuple[int, ...] = ()
    ) -> None:
        """Apply the pending migrations (those above `current`, and `missing` ones below it, in
        order); check the sketch dimension (`dim`: already read, if known)."""
        pending = [m for m in migrations() if m[0] > current or m[0] in missing]
        if pending:
            con.execute("BEGIN")
            try:
                self._apply(con, pending, current)
                con.execute("COMMIT")
            except BaseException:
                faults.rollback(con)
                raise
        if pending or dim is None:
            dim = int(con.execute("SELECT value FROM settings WHERE key = 'sketch_dim'").fetchall()[0][0])
        if self._sketch_dim is not None and self._sketch_dim != dim:
            raise CatalogError(f"catalog {self.path} uses sketches of dimension {dim}, not {self._sketch_dim}")
        self._sketch_dim = dim

    def _apply(self, con: duckdb.DuckDBPyConnection, pending: list[tuple[int, str, str]], current: int) -> None:
        """The migrations `pending`, in the caller's transaction."""
        con.execute(
            "CREATE TABLE IF NOT EXISTS schema_version "
            "(version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)"
        )
        for version, name, sql in pending:
            try:
                con.execute(sql)
            except duckdb.CatalogException as e:  # e.g. "already exists": the tables are newer than
                raise CatalogError(  # schema_version says
                    f"catalog {self.path}: upgrading it to schema {name} failed ({str(e).splitlines()[0]}): "
                    f"its tables do not match its schema_version table; it is damaged: {faults.RECOVER}"
                ) from None
            con.execute("INSERT INTO schema_version VALUES (?, ?, current_timestamp)", [version, name])
        if current == 0:
            from .summary import DEFAULT_SKETCH_DIM

            con.execute("INSERT INTO settings VALUES ('sketch_dim', ?)", [str(self._sketch_dim or DEFAULT_SKETCH_DIM)])

    @staticmethod
    def is_blank(con: duckdb.DuckDBPyConnection) -> bool:
        """Whether `con`'s database is not a catalog yet: a new file, or an empty DuckDB file, opened with
        create=True (any other database without mergedb's schema_version table is refused on opening)."""
        return not con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = 'main' AND table_name = 'schema_version'"
        ).fetchall()[0][0]

    def make_if_blank(self, con: duckdb.DuckDBPyConnection) -> None:
        """Inside the caller's transaction: give a blank database (`is_blank`) mergedb's schema. A catalog
        is made with its first rows or not at all: a registration that fails rolls it back, and an empty
        DuckDB file it was refused into is left as it was."""
        if self.is_blank(con):
            self._apply(con, migrations(), 0)

    def sketch_dim(self) -> int:
        """Dimension of the catalog's linear sketches (fixed when the catalog is created)."""
        from .summary import DEFAULT_SKETCH_DIM

        return self._sketch_dim or DEFAULT_SKETCH_DIM

    # -- inspection --------------------------------------------------------------------------

    def sql(self, text: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run one read-only SQL statement against the catalog; the result as an Arrow table.

        One query (SELECT, WITH, FROM …, VALUES, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN) on a read-only,
        sandboxed connection: the catalog's tables and views only (usersql.py says exactly what)."""
        if not isinstance(text, str):
            raise MergeDBError(f"sql() takes the query as a str, got {type(text).__name__}")
        if params is not None and not isinstance(params, (list, tuple, dict)):
            raise MergeDBError(
                f"sql() params are a list ($1, ?) or a dict ($name) of values, got {type(params).__name__}"
            )
        with self.duckdb_connection(sandbox=True) as con:
            usersql.check_statement(con, text)
            try:
                values = (params if isinstance(params, dict) else list(params)) if params else None

                def run() -> pa.Table:
                    result = con.sql(text, params=values)
                    return usersql.as_text(result).to_arrow_table() if result is not None else pa.table({})

                return usersql.interruptibly(con, run)
            except duckdb.Error as e:  # the file's faults are told by its reading, the query's by its text:
                storage = isinstance(e, usersql.STORAGE_ERRORS)  # a typo naming 'checksum' is not damage
                raise ((faults.diagnose(self.path, e) if storage else None) or usersql.sql_error(e)) from None
            except MemoryError:  # Arrow's copy of the rows is outside DuckDB's memory limit
                raise MergeDBError(usersql.TOO_BIG) from None

    def checkpoints(self) -> list[CheckpointRow]:
        """Every registered checkpoint, bases first (no catalog at the path: CatalogError, as for
        every other reading, so that a mistyped path does not look like an empty catalog)."""
        with self.duckdb_connection() as con:
            rows = con.execute(
                "SELECT c.name, c.role, b.name, c.path, c.dtype, c.n_tensors, c.bytes, c.fingerprint "
                "FROM checkpoints c LEFT JOIN checkpoints b ON b.checkpoint_id = c.base_id "
                "ORDER BY c.role, c.name"
            ).fetchall()
        return [CheckpointRow(*r) for r in rows]

    def checkpoint(self, name: str) -> CheckpointRow:
        self._check_path(create=False)
        for row in self.checkpoints():
            if row.name == name:
                return row
        raise CatalogError(f"no checkpoint named {name!r} in {self.path}; `mergedb ls` lists them")

    def tensor_summary(self, name: str) -> pa.Table:
        """Per-tensor delta summary of expert `name` (the tensor_summary view)."""
        self.checkpoint(name)
        return self.sql("SELECT * EXCLUDE (expert) FROM tensor_summary WHERE expert = ?", [name])

    # -- registration ------------------------------------------------------------------------

    def register(
        self,
        paths: Sequence[str | os.PathLike[str]],
        *,
        base: bool = False,
        base_model: str | None = None,
        name: str | None = None,
        block_size: int | str | BlockSizes | None = None,
        vocab_block_size: int | str | None = None,
        refresh: bool = False,
        threads: int | None = None,
        progress: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
        scanner: Callable[..., list[Any]] | None = None,
    ) -> register.RegisterResult:
        """Register checkpoints: read each once, store layout and exact delta statistics.

        `paths` are model folders, .safetensors files, or folders of those. With `base=True` they
        are bases; otherwise experts of `base_model` (a registered base, or one of `paths` by name;
        the catalog's only base when omitted). Idempotent: an unchanged checkpoint is skipped.
        `block_size`: a new base's blocks, a size or "auto" (vocabulary tensors in 64 KiB blocks of
        at most 64 rows, others 4 MiB; the default); `vocab_block_size` sets the vocabulary
        tensors' block exactly. A layout given for a base registered with another is refused.
        `scanner`: see register.register (rayexec.expert_scanner fans the scans out on Ray).
        """
        from . import register

        return register.register(
            self,
            paths,
            base=base,
            base_model=base_model,
            name=name,
            block_size=block_size,
            vocab_block_size=vocab_block_size,
            refresh=refresh,
            threads=threads,
            progress=progress,
            on_total=on_total,
            scanner=scanner,
        )

    # -- plans and runs ----------------------------------------------------------------------

    def plan(self, request: planner.PlanRequest, explain: bool = False) -> plans.PlanSummary:
        """Plan a merge from the catalog alone (no weights are read) and store it; one transaction."""
        from . import planner

        with self.duckdb_connection(write=True) as con:
            con.execute("BEGIN")
            try:
                summary, steps = planner.make_plan(con, request)
                con.execute("COMMIT")
            except BaseException:
                faults.rollback(con)
                raise
        return replace(summary, explain=tuple(steps) if explain else ())

    def plan_from_config(self, cfg: Any, budget: str = "all", name: str | None = None, **kw: Any) -> plans.PlanSummary:
        """Plan a mergekit YAML config (text, a path, or a `configs.MergeConfig`); see mkplan.plan_from_config."""
        from . import mkplan

        return mkplan.plan_from_config(self, cfg, budget, name, **kw)

    def frontier(
        self,
        request: planner.PlanRequest,
        budgets: Sequence[str] | None = None,
        *,
        keep: bool = False,
    ) -> list[plans.PlanSummary]:
        """Plan `request` at each budget from the catalog alone (no weights read): bytes against bounds.

        All plans are made in one transaction, rolled back unless `keep`, so by default nothing is
        stored (their summaries' plan_id is None). Kept plans of a named request are named
        `NAME@BUDGET`. `budgets` default: frontier.BUDGETS."""
        from . import frontier

        return frontier.make_plans(self, request, frontier.BUDGETS if budgets is None else budgets, keep=keep)

    def forget(self, names: Sequence[str], with_plans: bool = False) -> forget.Forgotten:
        """Remove checkpoints from the catalog (a base with all its experts); plans that merge them
        are refused unless `with_plans`, which removes them too. Reads no weights; see forget.py."""
        from . import forget

        return forget.forget(self, names, with_plans)

    def plans(self) -> list[plans.PlanSummary]:
        """Every stored plan, oldest first."""
        with self.duckdb_connection() as con:
            return plans.load_plans(con)

    def get_plan(self, plan: int | str | plans.PlanSummary) -> plans.PlanSummary:
        """A stored plan by id, name, or plan-hash prefix (at least 6 characters)."""
        with self.duckdb_connection() as con:
            return plans.load_plan(con, plans.resolve_plan(con, plan))

    def execution_plan(self, plan: int | str | plans.PlanSummary, *, merge: bool = True) -> ExecutionPlan:
        """Everything the executor needs for a stored plan, read in one short connection; `merge`
        False: read for another use than merging it (its random stream is not checked)."""
        with self.duckdb_connection() as con:
            return plans.execution_plan(con, plans.resolve_plan(con, plan), merge)

    def execute(
        self,
        plan: int | str | plans.PlanSummary,
        out: str | os.PathLike[str],
        *,
        max_shard_size: int = 5 * 10**9,
        dtype: str | None = None,
        verify: bool = False,
        force: bool = False,
        progress: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
        threads: int | None = None,
        write_shards: WriteShards | None = None,
        as_lora: bool = False,
        rank: int | None = None,
    ) -> ExecuteResult:
        """Execute a stored plan into `out` and record the run (ok, or failed with its error).

        `as_lora`: write a PEFT adapter folder instead of a model (linear / task arithmetic over
        adapters only; loraout.py), exact, or cut to `rank` per module by a truncated SVD
        (`verify` and `threads` are refused with it; `max_shard_size` and the progress callbacks
        apply to models only).

        The catalog is open only to read the plan and to record the run, never during the merge.
        `out` may not be, hold or lie inside any registered checkpoint's folder. A run whose merge
        succeeded but whose record cannot be written raises RunNotRecordedError, which says the
        output is complete; a failed merge's own error is raised even if recording it fails.
        `write_shards`: see executor.execute (rayexec.shard_writer runs the shards on Ray)."""
        from . import executor, outdir  # the merge kernels are heavy to import; planning does not need them

        if isinstance(max_shard_size, numbers.Integral) and not isinstance(max_shard_size, bool):
            max_shard_size = int(max_shard_size)  # a numpy whole number is one
        outdir.check_run_args(
            "execute()",
            out,
            max_shard_size,
            flags={"verify": verify, "force": force, "as_lora": as_lora},
            calls={"progress": progress, "on_total": on_total, "write_shards": write_shards},
        )
        if rank is not None and not as_lora:
            raise PlanError("a rank applies to a LoRA output only: pass as_lora=True (--as-lora) with it")
        if as_lora and (verify or threads is not None):  # refused, not ignored: an adapter is neither
            raise PlanError(
                f"{'verify (--verify)' if verify else 'threads (--threads)'} applies to a model output (--out): an "
                "--as-lora adapter is written on one thread from the adapters' factors, which are not re-hashed; "
                "drop it, or write a model"
            )
        with self.duckdb_connection() as con:  # one opening for the plan and the paths
            xp = plans.execution_plan(con, plans.resolve_plan(con, plan))
            registered = con.execute("SELECT path, root FROM checkpoints").fetchall()
        plans.refuse_gone(xp)
        executor.refuse_lost_side_files(xp)  # before a run is recorded: nothing merged, nothing recorded
        with outdir.named("--as-lora" if as_lora else "--out"):  # the option its messages name
            outdir.check_clear_of(Path(out), [p for row in registered for p in row], "a registered checkpoint")
        if self.path.exists() and not os.access(self.path, os.W_OK):
            if os.statvfs(self.path).f_flag & os.ST_RDONLY:
                raise CatalogError(
                    f"catalog {self.path} is on a read-only file system, so this run could not be recorded; copy "
                    "it to a writable folder and pass --catalog COPY (nothing was merged)"
                )
            raise CatalogError(
                f"catalog {self.path} is read-only, so this run could not be recorded; make it writable "
                "(chmod u+w) and retry"
            )
        with _one_at_a_time(self.path):  # (so that the mode is this thread's: another thread's opening waits)
            held_read_only = attach.mode(str(self.path))
        if held_read_only:  # read-only, around this call (Catalog.hold(write=False))
            raise CatalogError(
                f"catalog {self.path} is open read-only in this thread (Catalog.hold(write=False)), so this run "
                "could not be recorded; execute outside that block, or hold it read-write (nothing was merged)"
            )
        try:
            if as_lora:
                from . import loraout

                with outdir.named("--as-lora"):
                    res = loraout.execute(xp, out, rank=rank, dtype=dtype, force=force)
            else:
                res = executor.execute(
                    xp,
                    out,
                    max_shard_size=max_shard_size,
                    dtype=dtype,
                    verify=verify,
                    force=force,
                    progress=progress,
                    on_total=on_total,
                    threads=threads,
                    write_shards=write_shards,
                )
        except MergeDBError as e:
            try:
                wait = max(self.wait, self.RECORD_WAIT)
                self.record_run(xp.plan_id, out, error=str(e), wait=wait, plan_hash=xp.plan_hash)
            except MergeDBError as rec:  # the merge's error is the one to see
                e.args = (f"{e} (recording this failed run in the catalog failed too: {rec})",)
            raise
        try:
            self.record_run(xp.plan_id, out, res, wait=max(self.wait, self.RECORD_WAIT), plan_hash=xp.plan_hash)
        except (KeyboardInterrupt, SystemExit) as stop:  # waiting for the catalog: the output is whole all the same
            stop.add_note(
                f"the merge into {out} is complete and good (`mergedb check --output {out}` verifies it), but its "
                "run was not recorded in the catalog (interrupted while recording it)"
            )
            raise
        except MergeDBError as rec:
            raise RunNotRecordedError(
                f"the merge into {out} is complete and good (`mergedb check --output {out}` verifies it), "
                f"but the run could not be recorded in the catalog: {rec}"
            ) from None
        return res

    def record_run(
        self,
        plan_id: int,
        out: str | os.PathLike[str],
        result: ExecuteResult | None = None,
        error: str | None = None,
        *,
        wait: float | None = None,
        plan_hash: str | None = None,
    ) -> int:
        """Store one execution: ok with its measurements, or failed with its error. Waits up to
        `wait` seconds (default: the catalog's) for a catalog another process holds. `plan_hash`
        (default: the result's manifest's): the plan executed, refused if `plan_id` is another now."""
        cat = self if wait is None else self.waiting(wait)
        return scores.record_run(cat, plan_id, out, result, error, plan_hash)

    def waiting(self, seconds: float) -> Catalog:
        """This catalog, waiting `seconds` for a lock another process holds (this one's own wait if
        longer): where work is done already and only its rows are left to write (a run's record,
        registration's commit)."""
        if self.wait >= seconds:
            return self
        return Catalog(self.path, wait=seconds, sketch_dim=self._sketch_dim, on_wait=self._on_wait)

    plan_candidates = _Elsewhere("frontier", "candidates")  # a request's scored candidates, nothing stored
    sweep = _Elsewhere("sweep", "in_memory")  # many plans merged in memory, each expert block read once
    record_score = scores.record  # a measurement of a stored plan, for searches (scores.py)


CREATING = 1.0  # seconds a file without DuckDB's header may be another process's catalog being made


def _created_meanwhile(path: Path) -> None:
    """Wait while `path` looks like a catalog another process is creating right now: shorter than
    DuckDB's header or without its magic, and modified in the last CREATING seconds. (A second
    registration into the same new catalog read the first one's file before DuckDB wrote the header,
    and was told it was not a DuckDB file; or removed it as a 0-byte leftover, under the first.) A
    file that stays so is then judged as it is."""
    deadline = time.monotonic() + CREATING
    while time.monotonic() < deadline:
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime > CREATING:
                return
            with open(path, "rb") as f:
                if f.read(12)[8:] == b"DUCK":
                    return
        except OSError:
            return
        time.sleep(0.02)


def _interrupted(e: BaseException) -> bool:
    """DuckDB's answer to Ctrl-C or a signal handler's exception during a statement: a plain
    RuntimeError, which Catalog connections raise as the KeyboardInterrupt it stands for (the
    transaction is rolled back, or was committed just before; never half of it)."""
    return isinstance(e, RuntimeError) and str(e) == "Query interrupted"


def connect(path: str | os.PathLike[str] | None = None, *, wait: float = 0.0) -> Catalog:
    """The catalog at `path` (default: $MERGEDB_CATALOG or ./mergedb.duckdb)."""
    return Catalog(path, wait=wait)
