"""The catalog: a DuckDB file holding checkpoints, block layouts, delta statistics, plans and runs.

This module owns the connection (opened briefly around each operation: DuckDB's file lock keeps
every other process out while one holds it read-write), the schema migrations, and the `Catalog`
façade that the CLI and library users call. The work behind each operation lives in its own
module: register.py (registration), planner.py (plans), plans.py (stored plans read back),
check.py (integrity), executor.py (merges).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from . import planner, plans, register, stats
from .errors import CatalogError, MergeDBError
from .resources import migrations

if TYPE_CHECKING:
    from .executor import ExecuteResult
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


class Catalog:
    """A mergedb catalog file. Cheap to create: nothing is opened until an operation needs it."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, wait: float = 0.0, sketch_dim: int | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.wait = wait
        self._sketch_dim = sketch_dim

    def __repr__(self) -> str:
        return f"Catalog({str(self.path)!r})"

    # -- connections -------------------------------------------------------------------------

    @contextmanager
    def duckdb_connection(self, write: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short-lived DuckDB connection; write=True creates and migrates the catalog when needed."""
        if not write and not self.path.exists():
            raise CatalogError(f"no catalog at {self.path}; create one with `mergedb register PATH`")
        con = self._open(read_only=not write)
        try:
            if write:
                self._migrate(con)
            elif self._check_version(con, allow_old=True) < migrations()[-1][0]:
                con.close()  # an older catalog: upgrade it once, briefly read-write, then read
                with self.duckdb_connection(write=True):
                    pass
                con = self._open(read_only=True)
            yield con
        finally:
            con.close()

    def _open(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + self.wait
        delay = 0.05
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=read_only)
            except duckdb.IOException as e:
                if not _LOCK.search(str(e)):
                    raise CatalogError(f"cannot open catalog {self.path}: {e}") from None
                if time.monotonic() >= deadline:
                    pid = _PID.search(str(e))
                    who = f"process {pid.group(1)}" if pid else "another process"
                    raise CatalogError(
                        f"catalog {self.path} is locked by {who}; wait for it to finish, or pass --wait SECONDS"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except duckdb.Error as e:
                raise CatalogError(f"cannot open catalog {self.path}: {e}") from None

    def _check_version(self, con: duckdb.DuckDBPyConnection, allow_old: bool) -> int:
        latest = migrations()[-1][0]
        has_table = con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_version'"
        ).fetchall()[0][0]
        current = 0
        if has_table:
            current = int(con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchall()[0][0])
        if current > latest:
            raise CatalogError(
                f"catalog {self.path} was written by a newer mergedb (schema version {current}, this mergedb "
                f"knows up to {latest}); upgrade mergedb: pip install -U mergedb"
            )
        if current < latest and not allow_old:
            raise CatalogError(
                f"catalog {self.path} has schema version {current}, this mergedb needs {latest}; "
                "any writing command (e.g. `mergedb register`) upgrades it"
            )
        return current

    def _migrate(self, con: duckdb.DuckDBPyConnection) -> None:
        current = self._check_version(con, allow_old=True)
        pending = [m for m in migrations() if m[0] > current]
        if pending:
            con.execute("BEGIN")
            try:
                con.execute(
                    "CREATE TABLE IF NOT EXISTS schema_version "
                    "(version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)"
                )
                for version, name, sql in pending:
                    con.execute(sql)
                    con.execute("INSERT INTO schema_version VALUES (?, ?, current_timestamp)", [version, name])
                if current == 0:
                    dim = self._sketch_dim or stats.DEFAULT_SKETCH_DIM
                    con.execute("INSERT INTO settings VALUES ('sketch_dim', ?)", [str(dim)])
                con.execute("COMMIT")
            except Exception:
                con.execute("ROLLBACK")
                raise
        dim = int(con.execute("SELECT value FROM settings WHERE key = 'sketch_dim'").fetchall()[0][0])
        if self._sketch_dim is not None and self._sketch_dim != dim:
            raise CatalogError(f"catalog {self.path} uses sketches of dimension {dim}, not {self._sketch_dim}")
        self._sketch_dim = dim

    def sketch_dim(self) -> int:
        """Dimension of the catalog's linear sketches (fixed when the catalog is created)."""
        return self._sketch_dim or stats.DEFAULT_SKETCH_DIM

    # -- inspection --------------------------------------------------------------------------

    def sql(self, text: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run one read-only SQL statement against the catalog; the result as an Arrow table."""
        with self.duckdb_connection() as con:
            try:
                result = con.sql(text, params=list(params) if params else None)
                return result.to_arrow_table() if result is not None else pa.table({})
            except duckdb.Error as e:
                raise MergeDBError(f"SQL error: {e}") from None

    def checkpoints(self) -> list[CheckpointRow]:
        """Every registered checkpoint, bases first."""
        if not self.path.exists():
            return []
        with self.duckdb_connection() as con:
            rows = con.execute(
                "SELECT c.name, c.role, b.name, c.path, c.dtype, c.n_tensors, c.bytes, c.fingerprint "
                "FROM checkpoints c LEFT JOIN checkpoints b ON b.checkpoint_id = c.base_id "
                "ORDER BY c.role, c.name"
            ).fetchall()
        return [CheckpointRow(*r) for r in rows]

    def checkpoint(self, name: str) -> CheckpointRow:
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
        block_size: int | str = register.DEFAULT_BLOCK_SIZE,
        refresh: bool = False,
        threads: int = 2,
        progress: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ) -> register.RegisterResult:
        """Register checkpoints: read each once, store layout and exact delta statistics.

        `paths` are model folders, .safetensors files, or folders of those. With `base=True` they
        are bases; otherwise experts of `base_model` (a registered base, or one of `paths` by name;
        the catalog's only base when omitted). Idempotent: an unchanged checkpoint is skipped.
        """
        return register.register(
            self,
            paths,
            base=base,
            base_model=base_model,
            name=name,
            block_size=block_size,
            refresh=refresh,
            threads=threads,
            progress=progress,
            on_total=on_total,
        )

    # -- plans and runs ----------------------------------------------------------------------

    def plan(self, request: planner.PlanRequest, explain: bool = False) -> plans.PlanSummary:
        """Plan a merge from the catalog alone (no weights are read) and store it; one transaction."""
        with self.duckdb_connection(write=True) as con:
            con.execute("BEGIN")
            try:
                plan_id, steps = planner.make_plan(con, request)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            summary = plans.load_plan(con, plan_id)
        return replace(summary, explain=tuple(steps) if explain else ())

    def plans(self) -> list[plans.PlanSummary]:
        """Every stored plan, oldest first."""
        with self.duckdb_connection() as con:
            ids = [r[0] for r in con.execute("SELECT plan_id FROM plans ORDER BY plan_id").fetchall()]
            return [plans.load_plan(con, i) for i in ids]

    def get_plan(self, plan: int | str) -> plans.PlanSummary:
        """A stored plan by id, name, or plan-hash prefix (at least 6 characters)."""
        with self.duckdb_connection() as con:
            return plans.load_plan(con, plans.resolve_plan(con, plan))

    def execution_plan(self, plan: int | str) -> ExecutionPlan:
        """Everything the executor needs for a stored plan, read in one short connection."""
        with self.duckdb_connection() as con:
            return plans.execution_plan(con, plans.resolve_plan(con, plan))

    def execute(
        self,
        plan: int | str,
        out: str | os.PathLike[str],
        *,
        max_shard_size: int = 5 * 10**9,
        dtype: str | None = None,
        verify: bool = False,
        force: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> ExecuteResult:
        """Execute a stored plan into `out` and record the run (ok, or failed with its error).

        The catalog is open only to read the plan and to record the run, never during the merge."""
        from . import executor  # the merge kernels are heavy to import; planning does not need them

        xp = self.execution_plan(plan)
        try:
            res = executor.execute(
                xp, out, max_shard_size=max_shard_size, dtype=dtype, verify=verify, force=force, progress=progress
            )
        except MergeDBError as e:
            self.record_run(xp.plan_id, str(out), error=str(e))
            raise
        self.record_run(xp.plan_id, str(out), res)
        return res

    def record_run(self, plan_id: int, out: str, result: ExecuteResult | None = None, error: str | None = None) -> int:
        """Store one execution: ok with its measurements, or failed with its error."""
        r = result
        with self.duckdb_connection(write=True) as con:
            rid = int(con.execute("SELECT coalesce(max(run_id), 0) + 1 FROM runs").fetchall()[0][0])
            row = {
                "run_id": rid,
                "plan_id": plan_id,
                "out": out,
                "status": "ok" if r is not None else "failed",
                "error": error,
                "manifest_hash": r.manifest["content_hash"] if r else None,
                "seconds": r.seconds if r else None,
                "expert_bytes": r.expert_bytes if r else None,
                "physical_bytes": r.physical_bytes if r else None,
                "base_bytes": r.base_bytes if r else None,
                "bytes_written": r.bytes_written if r else None,
                "peak_rss_bytes": r.peak_rss if r else None,
            }
            con.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
        return rid


def connect(path: str | os.PathLike[str] | None = None, *, wait: float = 0.0) -> Catalog:
    """The catalog at `path` (default: $MERGEDB_CATALOG or ./mergedb.duckdb)."""
    return Catalog(path, wait=wait)
