"""The catalog: a DuckDB file holding checkpoints, block layouts and delta statistics.

Only this module talks to DuckDB. Connections are opened briefly around each operation (DuckDB's
file lock keeps every other process out while one holds it read-write) and never across a long
scan or merge: registration reads the files first, then writes everything in one transaction.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import executor, planner, scan, stats
from .checkpoint import Checkpoint, discover, open_checkpoint
from .errors import CatalogError, ChangedFileError, MergeDBError
from .units import parse_size

DEFAULT_PATH = "mergedb.duckdb"
DEFAULT_BLOCK_SIZE = 4 * 2**20


def resource_dir(kind: str) -> Path:
    """`schema/` or `queries/`: inside the installed package (wheel) or beside it (source checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / kind, here.parent / kind):
        if candidate.is_dir():
            return candidate
    raise CatalogError(f"cannot find mergedb's {kind}/ folder next to {here}; reinstall mergedb")


def query(name: str) -> str:
    """The text of `queries/<name>.sql`."""
    return (resource_dir("queries") / f"{name}.sql").read_text()


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every `schema/NNN_name.sql`, in order."""
    out = []
    for p in sorted(resource_dir("schema").glob("[0-9][0-9][0-9]_*.sql")):
        out.append((int(p.name[:3]), p.stem, p.read_text()))
    return out


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


@dataclass(frozen=True)
class RegisterResult:
    """What a registration did."""

    registered: tuple[str, ...]
    unchanged: tuple[str, ...]
    bytes_read: int
    seconds: float


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
    def connect(self, write: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short-lived connection; write=True creates and migrates the catalog when needed."""
        if not write and not self.path.exists():
            raise CatalogError(f"no catalog at {self.path}; create one with `mergedb register PATH`")
        con = self._open(read_only=not write)
        try:
            if write:
                self._migrate(con)
            elif self._check_version(con, allow_old=True) < migrations()[-1][0]:
                con.close()  # an older catalog: upgrade it once, briefly read-write, then read
                with self.connect(write=True):
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
        has_table = _one(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_version'")
        current = 0
        if has_table and has_table[0]:
            row = _one(con, "SELECT coalesce(max(version), 0) FROM schema_version")
            current = int(row[0]) if row else 0
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
        dim = int(_one(con, "SELECT value FROM settings WHERE key = 'sketch_dim'")[0])
        if self._sketch_dim is not None and self._sketch_dim != dim:
            raise CatalogError(f"catalog {self.path} uses sketches of dimension {dim}, not {self._sketch_dim}")
        self._sketch_dim = dim

    # -- inspection --------------------------------------------------------------------------

    def sql(self, text: str, params: Sequence[Any] | None = None) -> pa.Table:
        """Run one read-only SQL statement against the catalog; the result as an Arrow table."""
        with self.connect() as con:
            try:
                result = con.sql(text, params=list(params) if params else None)
                return result.to_arrow_table() if result is not None else pa.table({})
            except duckdb.Error as e:
                raise MergeDBError(f"SQL error: {e}") from None

    def checkpoints(self) -> list[CheckpointRow]:
        """Every registered checkpoint, bases first."""
        if not self.path.exists():
            return []
        with self.connect() as con:
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
        block_size: int | str = DEFAULT_BLOCK_SIZE,
        refresh: bool = False,
        threads: int = 2,
        progress: scan.Progress | None = None,
        on_total: Any = None,
    ) -> RegisterResult:
        """Register checkpoints: read each once, store layout and exact delta statistics.

        `paths` are model folders, .safetensors files, or folders of those. With `base=True` they
        are bases; otherwise experts of `base_model` (a registered base, or one of `paths` by name;
        the catalog's only base when omitted). Idempotent: an unchanged checkpoint is skipped.
        """
        t0 = time.perf_counter()
        block_bytes = parse_size(block_size, what="block size")
        if block_bytes <= 0:
            raise MergeDBError("--block-size must be positive, e.g. 4MiB")
        found = [open_checkpoint(p) for p in discover(list(paths))]
        if name is not None:
            if len(found) != 1:
                raise MergeDBError(f"--name applies to one checkpoint, but {len(found)} were found")
            found = [_renamed(found[0], name)]
        names = [c.name for c in found]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise MergeDBError(f"two checkpoints would be named {dupes[0]!r}; register them separately with --name")

        with self.connect(write=True) as con:
            existing = {
                r[0]: r
                for r in con.execute(
                    "SELECT name, checkpoint_id, role, base_id, fingerprint, block_size FROM checkpoints"
                ).fetchall()
            }
            base_names = {r[1]: r[0] for r in existing.values() if r[2] == "base"}
            dim = self._sketch_dim or stats.DEFAULT_SKETCH_DIM

        if base:
            bases, experts, base_ckpt_name = found, [], None
        else:
            base_ckpt_name = base_model
            if base_ckpt_name is None:
                if len(base_names) != 1:
                    raise MergeDBError(
                        "which base were these experts fine-tuned from? pass --base-model NAME "
                        + (
                            f"(registered bases: {', '.join(sorted(base_names.values()))})"
                            if base_names
                            else "or register the base first with --base"
                        )
                    )
                base_ckpt_name = next(iter(base_names.values()))
            in_paths = [c for c in found if c.name == base_ckpt_name]
            if in_paths:
                bases, experts = in_paths, [c for c in found if c.name != base_ckpt_name]
            elif base_ckpt_name in existing and existing[base_ckpt_name][2] == "base":
                bases, experts = [], found
            else:
                known = ", ".join(sorted(base_names.values())) or "none"
                raise CatalogError(
                    f"unknown --base-model {base_ckpt_name!r}: not among the paths and not a registered base "
                    f"(registered bases: {known})"
                )

        todo_bases, todo_experts, unchanged = [], [], []
        for c in bases + experts:
            role = "base" if c in bases else "expert"
            row = existing.get(c.name)
            if row is not None:
                if row[2] != role:
                    raise CatalogError(f"{c.name!r} is already registered as a {row[2]}, not a {role}")
                if row[4] == c.fingerprint and (
                    role == "base" or existing.get(base_ckpt_name or "", (0, -1))[1] == row[3]
                ):
                    unchanged.append(c.name)
                    continue
                if not refresh:
                    raise ChangedFileError(
                        f"{c.name!r} ({c.path}) changed since it was registered; "
                        "pass --refresh to re-scan it (plans made before then will ask to be made again)"
                    )
                if role == "base":
                    raise ChangedFileError(
                        f"base {c.name!r} ({c.path}) changed since it was registered; its experts' statistics "
                        "depend on it. Register the new base under a new --name"
                    )
            (todo_bases if role == "base" else todo_experts).append(c)

        total = sum(_tensor_bytes(c) for c in todo_bases) + sum(2 * _tensor_bytes(c) for c in todo_experts)
        if on_total:
            on_total(total)
        read = 0

        def tick(n: int) -> None:
            nonlocal read
            read += n
            if progress:
                progress(n)

        # Phase 1: read the files (catalog closed).
        families: dict[str, tuple[Checkpoint, list[scan.FamilyTensor], list[str]]] = {}
        for b in todo_bases:
            fam = scan.layout(b, block_bytes)
            families[b.name] = (b, fam, scan.hash_base(b, fam, threads, tick))
        if todo_experts:
            assert base_ckpt_name is not None
            if base_ckpt_name not in families:
                families[base_ckpt_name] = self._load_family(base_ckpt_name)
        results = []
        for e in todo_experts:
            b, fam, hashes = families[base_ckpt_name]  # type: ignore[index]
            keyed = {(blk.tensor_idx, blk.block_idx): h for blk, h in zip(_all_blocks(fam), hashes)}
            results.append((e, scan.scan_expert(b, e, fam, keyed, dim, threads, tick)))

        # Phase 2: one transaction. Another process may have registered some of these meanwhile:
        # identical ones are skipped, conflicting ones refused (nothing is written then).
        done: list[str] = []
        with self.connect(write=True) as con:
            con.execute("BEGIN")
            try:
                now = {
                    r[0]: r
                    for r in con.execute(
                        "SELECT name, checkpoint_id, role, base_id, fingerprint, block_size FROM checkpoints"
                    ).fetchall()
                }
                ids = {}
                for b in todo_bases:
                    _, fam, hashes = families[b.name]
                    if b.name in now:
                        if now[b.name][4] != b.fingerprint or now[b.name][5] != block_bytes:
                            raise CatalogError(
                                f"base {b.name!r} was registered by another process meanwhile with other "
                                "contents or block size; nothing was written: run the command again"
                            )
                        ids[b.name] = now[b.name][1]
                        unchanged.append(b.name)
                        continue
                    ids[b.name] = self._insert_checkpoint(con, b, "base", None, scan.content_hash(hashes), block_bytes)
                    _insert_family(con, ids[b.name], fam, hashes)
                    done.append(b.name)
                for e, st in results:
                    if base_ckpt_name in ids:
                        base_id = ids[base_ckpt_name]
                    else:
                        base_id = _one(con, "SELECT checkpoint_id FROM checkpoints WHERE name = ?", [base_ckpt_name])[0]
                    if e.name in now:
                        row = now[e.name]
                        if e.name not in existing or row[4] != existing[e.name][4]:  # someone else's write
                            if row[4] == e.fingerprint and row[3] == base_id:
                                unchanged.append(e.name)
                                continue
                            raise CatalogError(
                                f"{e.name!r} was registered by another process meanwhile with other contents; "
                                "nothing was written: run the command again"
                            )
                        _delete_checkpoint(con, row[1])  # --refresh: same id, so old plans see the change
                    cid = self._insert_checkpoint(
                        con, e, "expert", base_id, st.content_hash, None, now[e.name][1] if e.name in now else None
                    )
                    _insert_stats(con, cid, st)
                    done.append(e.name)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
        return RegisterResult(tuple(done), tuple(unchanged), read, time.perf_counter() - t0)

    def _load_family(self, base_name: str) -> tuple[Checkpoint, list[scan.FamilyTensor], list[str]]:
        """A registered base's checkpoint, layout and block hashes, after checking its files are unchanged."""
        with self.connect() as con:
            row = _one(con, "SELECT checkpoint_id, path, fingerprint FROM checkpoints WHERE name = ?", [base_name])
            cid, path, fp = row
            tensors = con.execute(
                "SELECT tensor_idx, name, dtype, shape, numel, nbytes, row_bytes, mergeable "
                "FROM family_tensors WHERE base_id = ? ORDER BY tensor_idx",
                [cid],
            ).fetchall()
            blocks = con.execute(
                "SELECT tensor_idx, block_idx, row_start, row_end, byte_start, nbytes, numel, base_hash "
                "FROM blocks WHERE base_id = ? ORDER BY tensor_idx, block_idx",
                [cid],
            ).fetchall()
        ckpt = open_checkpoint(path, name=base_name)
        if ckpt.fingerprint != fp:
            raise ChangedFileError(
                f"base {base_name!r} ({path}) changed since it was registered; register it again under a new --name"
            )
        by_tensor: dict[int, list[scan.Block]] = {}
        for t, b, r0, r1, bs, nb, ne, _ in blocks:
            by_tensor.setdefault(t, []).append(scan.Block(t, b, r0, r1, bs, nb, ne))
        fam = [
            scan.FamilyTensor(t, n, d, tuple(s), ne, nb, rb, m, tuple(by_tensor[t]))
            for t, n, d, s, ne, nb, rb, m in tensors
        ]
        return ckpt, fam, [b[7] for b in blocks]

    def _insert_checkpoint(
        self,
        con: duckdb.DuckDBPyConnection,
        c: Checkpoint,
        role: str,
        base_id: int | None,
        chash: str,
        block_size: int | None,
        cid: int | None = None,
    ) -> int:
        if cid is None:
            cid = int(_one(con, "SELECT coalesce(max(checkpoint_id), 0) + 1 FROM checkpoints")[0])
        con.execute(
            "INSERT INTO checkpoints (checkpoint_id, name, path, root, role, base_id, architecture, dtype, "
            "n_tensors, bytes, fingerprint, content_hash, block_size) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [
                cid,
                c.name,
                str(c.path.resolve()),
                str(c.root.resolve()),
                role,
                base_id,
                c.architecture,
                c.dtype,
                len(c.tensors),
                c.bytes,
                c.fingerprint,
                chash,
                block_size,
            ],
        )
        files = pa.table(
            {
                "checkpoint_id": pa.array([cid] * len(c.files), pa.int32()),
                "file_idx": pa.array(range(len(c.files)), pa.int32()),
                "relpath": [f.relpath for f in c.files],
                "bytes": pa.array([f.size for f in c.files], pa.int64()),
                "mtime_ns": pa.array([f.mtime_ns for f in c.files], pa.int64()),
                "header_len": pa.array([f.header.header_len for f in c.files], pa.int64()),
                "header_sha256": [f.header.sha256 for f in c.files],
            }
        )
        _append(con, "files", files)
        order = {t.name: i for i, (_, t) in enumerate(c.tensors)}
        if role == "expert":  # tensor_idx follows the base's order; the base's layout is already stored
            base_order = dict(
                con.execute("SELECT name, tensor_idx FROM family_tensors WHERE base_id = ?", [base_id]).fetchall()
            )
            order = {n: base_order[n] for n in order}
        tensors = pa.table(
            {
                "checkpoint_id": pa.array([cid] * len(c.tensors), pa.int32()),
                "tensor_idx": pa.array([order[t.name] for _, t in c.tensors], pa.int32()),
                "file_idx": pa.array([fi for fi, _ in c.tensors], pa.int32()),
                "data_start": pa.array([t.start for _, t in c.tensors], pa.int64()),
                "data_end": pa.array([t.end for _, t in c.tensors], pa.int64()),
            }
        )
        _append(con, "tensors", tensors)
        return cid

    # -- plans and runs ----------------------------------------------------------------------

    def plan(self, request: planner.PlanRequest, explain: bool = False) -> planner.PlanSummary:
        """Plan a merge from the catalog alone (no weights are read) and store it; one transaction."""
        with self.connect(write=True) as con:
            con.execute("BEGIN")
            try:
                plan_id, steps = planner.make_plan(con, request, query)
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            summary = planner.load_plan(con, plan_id)
        return replace(summary, explain=tuple(steps) if explain else ())

    def plans(self) -> list[planner.PlanSummary]:
        """Every stored plan, oldest first."""
        with self.connect() as con:
            ids = [r[0] for r in con.execute("SELECT plan_id FROM plans ORDER BY plan_id").fetchall()]
            return [planner.load_plan(con, i) for i in ids]

    def get_plan(self, plan: int | str) -> planner.PlanSummary:
        """A stored plan by id, name, or plan-hash prefix (at least 6 characters)."""
        with self.connect() as con:
            return planner.load_plan(con, planner.resolve_plan(con, plan))

    def execution_plan(self, plan: int | str) -> executor.ExecutionPlan:
        """Everything the executor needs for a stored plan, read in one short connection."""
        with self.connect() as con:
            return planner.execution_plan(con, planner.resolve_plan(con, plan))

    def record_run(
        self, plan_id: int, out: str, result: executor.ExecuteResult | None = None, error: str | None = None
    ) -> int:
        """Store one execution: ok with its measurements, or failed with its error."""
        r = result
        with self.connect(write=True) as con:
            rid = int(_one(con, "SELECT coalesce(max(run_id), 0) + 1 FROM runs")[0])
            con.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, current_timestamp)",
                [
                    rid,
                    plan_id,
                    out,
                    "ok" if r is not None else "failed",
                    error,
                    r.manifest["content_hash"] if r else None,
                    r.seconds if r else None,
                    r.expert_bytes if r else None,
                    r.physical_bytes if r else None,
                    r.base_bytes if r else None,
                    r.bytes_written if r else None,
                    r.peak_rss if r else None,
                ],
            )
        return rid


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] | None = None) -> Any:
    """The first row of a query, fully fetched (DuckDB 2 streams: an unfetched result blocks the connection)."""
    rows = con.execute(sql, list(params or [])).fetchall()
    return rows[0] if rows else None


def _tensor_bytes(c: Checkpoint) -> int:
    return sum(t.nbytes for _, t in c.tensors)


def _renamed(c: Checkpoint, name: str) -> Checkpoint:
    return Checkpoint(name, c.path, c.root, c.files, c.tensors, c.architecture)


def _all_blocks(fam: list[scan.FamilyTensor]) -> Iterator[scan.Block]:
    for ft in fam:
        yield from ft.blocks


def _append(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> None:
    con.register("_mergedb_rows", data)
    try:
        cols = ", ".join(data.column_names)
        con.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM _mergedb_rows")
    finally:
        con.unregister("_mergedb_rows")


def _insert_family(
    con: duckdb.DuckDBPyConnection, base_id: int, fam: list[scan.FamilyTensor], hashes: list[str]
) -> None:
    _append(
        con,
        "family_tensors",
        pa.table(
            {
                "base_id": pa.array([base_id] * len(fam), pa.int32()),
                "tensor_idx": pa.array([f.tensor_idx for f in fam], pa.int32()),
                "name": [f.name for f in fam],
                "dtype": [f.dtype for f in fam],
                "shape": pa.array([list(f.shape) for f in fam], pa.list_(pa.int64())),
                "numel": pa.array([f.numel for f in fam], pa.int64()),
                "nbytes": pa.array([f.nbytes for f in fam], pa.int64()),
                "row_bytes": pa.array([f.row_bytes for f in fam], pa.int64()),
                "mergeable": [f.mergeable for f in fam],
                "n_blocks": pa.array([len(f.blocks) for f in fam], pa.int32()),
            }
        ),
    )
    blocks = list(_all_blocks(fam))
    _append(
        con,
        "blocks",
        pa.table(
            {
                "base_id": pa.array([base_id] * len(blocks), pa.int32()),
                "tensor_idx": pa.array([b.tensor_idx for b in blocks], pa.int32()),
                "block_idx": pa.array([b.block_idx for b in blocks], pa.int32()),
                "row_start": pa.array([b.row_start for b in blocks], pa.int64()),
                "row_end": pa.array([b.row_end for b in blocks], pa.int64()),
                "byte_start": pa.array([b.byte_start for b in blocks], pa.int64()),
                "nbytes": pa.array([b.nbytes for b in blocks], pa.int64()),
                "numel": pa.array([b.numel for b in blocks], pa.int64()),
                "base_hash": hashes,
            }
        ),
    )


_BLOCK_COLS = [
    ("tensor_idx", pa.int32()),
    ("block_idx", pa.int32()),
    ("identical", pa.bool_()),
    ("delta_norm", pa.float64()),
    ("max_abs", pa.float32()),
    ("nnz", pa.int64()),
    ("nonfinite", pa.int64()),
    ("content_hash", pa.string()),
    ("hist_lo", pa.list_(pa.float32())),
    ("hist_hi", pa.list_(pa.float32())),
    ("hist_count", pa.list_(pa.int64())),
    ("hist_sum", pa.list_(pa.float64())),
    ("hist_sumsq", pa.list_(pa.float64())),
    ("sketch", pa.list_(pa.float32())),
]


def _insert_stats(con: duckdb.DuckDBPyConnection, cid: int, st: scan.ExpertStats) -> None:
    cols = list(zip(*st.blocks)) if st.blocks else [[] for _ in _BLOCK_COLS]
    data = {"checkpoint_id": pa.array([cid] * len(st.blocks), pa.int32())}
    for (name, typ), values in zip(_BLOCK_COLS, cols):
        data[name] = pa.array(list(values), typ)
    _append(con, "expert_blocks", pa.table(data))
    _append(
        con,
        "expert_tensors",
        pa.table(
            {
                "checkpoint_id": pa.array([cid] * len(st.tensors), pa.int32()),
                "tensor_idx": pa.array([t[0] for t in st.tensors], pa.int32()),
                "identical": [t[1] for t in st.tensors],
                "grid_threshold": pa.array([t[2] for t in st.tensors], pa.list_(pa.float32())),
                "summary_code": pa.array([t[3] for t in st.tensors], pa.list_(pa.uint16())),
                "summary_count": pa.array([t[4] for t in st.tensors], pa.list_(pa.int64())),
            }
        ),
    )


def _delete_checkpoint(con: duckdb.DuckDBPyConnection, cid: int) -> None:
    for table in ("expert_blocks", "expert_tensors", "tensors", "files", "checkpoints"):
        con.execute(f"DELETE FROM {table} WHERE checkpoint_id = ?", [cid])


def connect(path: str | os.PathLike[str] | None = None, *, wait: float = 0.0) -> Catalog:
    """The catalog at `path` (default: $MERGEDB_CATALOG or ./mergedb.duckdb)."""
    return Catalog(path, wait=wait)


def simulate(
    cat: Catalog,
    experts: int,
    tensors: int,
    blocks_per_tensor: int,
    *,
    block_bytes: int | list[int] = 4 * 2**20,
    identical_fraction: float = 0.1,
    seed: int = 0,
) -> None:
    """Write a synthetic family's rows straight into the catalog (no checkpoint files).

    For planner tests and benchmarks at sizes no disk here could hold: `experts × tensors ×
    blocks_per_tensor` expert-block rows with lognormal delta norms, random identical blocks and
    random sketches. Files point nowhere; only planning works on such a family.
    """
    rng = np.random.default_rng(seed)
    dim = cat._sketch_dim or stats.DEFAULT_SKETCH_DIM
    with cat.connect(write=True) as con:
        con.execute("BEGIN")
        base_id = int(_one(con, "SELECT coalesce(max(checkpoint_id), 0) + 1 FROM checkpoints")[0])
        nb = tensors * blocks_per_tensor
        sizes = np.broadcast_to(np.asarray(block_bytes, np.int64), (nb,)).reshape(tensors, blocks_per_tensor)
        for k in range(experts + 1):
            con.execute(
                "INSERT INTO checkpoints (checkpoint_id, name, path, root, role, base_id, architecture, dtype, "
                "n_tensors, bytes, fingerprint, content_hash, block_size) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    base_id + k,
                    f"sim{base_id}_base" if k == 0 else f"sim{base_id}_e{k - 1:03d}",
                    "/nonexistent",
                    "/nonexistent",
                    "base" if k == 0 else "expert",
                    None if k == 0 else base_id,
                    "Simulated",
                    "BF16",
                    tensors,
                    int(sizes.sum()),
                    f"sim-{seed}-{k}",
                    f"sim-{seed}-{k}",
                    None,
                ],
            )
        _append(
            con,
            "family_tensors",
            pa.table(
                {
                    "base_id": pa.array([base_id] * tensors, pa.int32()),
                    "tensor_idx": pa.array(range(tensors), pa.int32()),
                    "name": [f"t{t}" for t in range(tensors)],
                    "dtype": ["BF16"] * tensors,
                    "shape": pa.array([[int(sizes[t].sum()) // 2] for t in range(tensors)], pa.list_(pa.int64())),
                    "numel": pa.array(sizes.sum(axis=1) // 2, pa.int64()),
                    "nbytes": pa.array(sizes.sum(axis=1), pa.int64()),
                    "row_bytes": pa.array([2] * tensors, pa.int64()),
                    "mergeable": [True] * tensors,
                    "n_blocks": pa.array([blocks_per_tensor] * tensors, pa.int32()),
                }
            ),
        )
        t_idx = np.repeat(np.arange(tensors, dtype=np.int32), blocks_per_tensor)
        b_idx = np.tile(np.arange(blocks_per_tensor, dtype=np.int32), tensors)
        starts = np.concatenate([np.r_[0, np.cumsum(s)[:-1]] for s in sizes])
        _append(
            con,
            "blocks",
            pa.table(
                {
                    "base_id": pa.array(np.full(nb, base_id, np.int32)),
                    "tensor_idx": pa.array(t_idx),
                    "block_idx": pa.array(b_idx),
                    "row_start": pa.array(starts // 2),
                    "row_end": pa.array((starts + sizes.reshape(-1)) // 2),
                    "byte_start": pa.array(starts),
                    "nbytes": pa.array(sizes.reshape(-1)),
                    "numel": pa.array(sizes.reshape(-1) // 2),
                    "base_hash": pa.array(["0"] * nb),
                }
            ),
        )
        for k in range(experts):
            ident = rng.random(nb) < identical_fraction
            norm = np.where(ident, 0.0, np.exp(rng.normal(0, 2, nb)))
            sk = (rng.standard_normal((nb, dim)) * (norm[:, None] / np.sqrt(dim))).astype(np.float32)
            lo = (norm / 100).astype(np.float32)
            _append(
                con,
                "expert_blocks",
                pa.table(
                    {
                        "checkpoint_id": pa.array(np.full(nb, base_id + 1 + k, np.int32)),
                        "tensor_idx": pa.array(t_idx),
                        "block_idx": pa.array(b_idx),
                        "identical": pa.array(ident),
                        "delta_norm": pa.array(norm),
                        "max_abs": pa.array((norm / 10).astype(np.float32)),
                        "nnz": pa.array(np.where(ident, 0, sizes.reshape(-1) // 2)),
                        "nonfinite": pa.array(np.zeros(nb, np.int64)),
                        "content_hash": pa.array(["0"] * nb),
                        "hist_lo": pa.FixedSizeListArray.from_arrays(lo, 1).cast(pa.list_(pa.float32())),
                        "hist_hi": pa.FixedSizeListArray.from_arrays(lo * 2, 1).cast(pa.list_(pa.float32())),
                        "hist_count": pa.FixedSizeListArray.from_arrays(sizes.reshape(-1) // 2, 1).cast(
                            pa.list_(pa.int64())
                        ),
                        "hist_sum": pa.FixedSizeListArray.from_arrays(norm, 1).cast(pa.list_(pa.float64())),
                        "hist_sumsq": pa.FixedSizeListArray.from_arrays(norm**2, 1).cast(pa.list_(pa.float64())),
                        "sketch": pa.FixedSizeListArray.from_arrays(sk.reshape(-1), dim).cast(pa.list_(pa.float32())),
                    }
                ),
            )
        con.execute("COMMIT")


@dataclass(frozen=True)
class Problem:
    """One thing `check` found wrong: where, what, and how to fix it."""

    where: str
    what: str
    fix: str


_ORPHANS = [
    ("files", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints)"),
    ("tensors", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints)"),
    ("expert_blocks", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'expert')"),
    ("expert_tensors", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'expert')"),
    ("blocks", "base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("family_tensors", "base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("checkpoints", "role = 'expert' AND base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("plan_experts", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("plan_mask", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("runs", "plan_id NOT IN (SELECT plan_id FROM plans)"),
]


def check_catalog(cat: Catalog, deep: bool = False) -> list[Problem]:
    """Verify the catalog against itself and the files: orphaned or missing rows, missing or
    changed files, and with `deep` every block's bytes against its registered hash."""
    problems: list[Problem] = []
    with cat.connect() as con:
        for table, cond in _ORPHANS:
            n = _one(con, f"SELECT count(*) FROM {table} WHERE {cond}")[0]
            if n:
                problems.append(Problem(f"table {table}", f"{n} orphaned rows", "re-create the catalog from the files"))
        short = con.execute(
            "SELECT c.name, count(eb.block_idx), (SELECT count(*) FROM blocks bl JOIN family_tensors ft "
            "USING (base_id, tensor_idx) WHERE bl.base_id = c.base_id AND ft.mergeable) "
            "FROM checkpoints c LEFT JOIN expert_blocks eb USING (checkpoint_id) WHERE c.role = 'expert' "
            "GROUP BY c.name, c.base_id HAVING count(eb.block_idx) != (SELECT count(*) FROM blocks bl "
            "JOIN family_tensors ft USING (base_id, tensor_idx) WHERE bl.base_id = c.base_id AND ft.mergeable)"
        ).fetchall()
        for name, have, want in short:
            problems.append(
                Problem(
                    f"checkpoint {name}",
                    f"{have} block statistics rows, expected {want}",
                    f"mergedb register --refresh {name}'s path",
                )
            )
        ckpts = con.execute("SELECT checkpoint_id, name, path, fingerprint, role, base_id FROM checkpoints").fetchall()
        hashes = {}
        if deep:
            for cid, _, _, _, role, base_id in ckpts:
                if role == "base":
                    hashes[cid] = con.execute(
                        "SELECT ft.name, bl.block_idx, bl.byte_start, bl.nbytes, bl.base_hash FROM blocks bl "
                        "JOIN family_tensors ft USING (base_id, tensor_idx) WHERE bl.base_id = ?",
                        [cid],
                    ).fetchall()
                else:
                    hashes[cid] = con.execute(
                        "SELECT ft.name, bl.block_idx, bl.byte_start, bl.nbytes, eb.content_hash FROM expert_blocks eb "
                        "JOIN blocks bl ON bl.base_id = ? AND bl.tensor_idx = eb.tensor_idx "
                        "AND bl.block_idx = eb.block_idx "
                        "JOIN family_tensors ft ON ft.base_id = bl.base_id AND ft.tensor_idx = bl.tensor_idx "
                        "WHERE eb.checkpoint_id = ?",
                        [base_id, cid],
                    ).fetchall()
    for cid, name, path, fp, _, _ in ckpts:
        try:
            ckpt = open_checkpoint(path, name=name)
        except MergeDBError as e:
            problems.append(
                Problem(f"checkpoint {name}", f"cannot be read: {e}", "restore the file, or register it anew")
            )
            continue
        if ckpt.fingerprint != fp:
            problems.append(
                Problem(
                    f"checkpoint {name}",
                    f"files at {path} changed since registration",
                    "mergedb register --refresh (experts) or register under a new name (bases)",
                )
            )
            continue
        if deep:
            problems += _rehash(ckpt, hashes[cid])
    return problems


def _rehash(ckpt: Checkpoint, rows: list[tuple]) -> list[Problem]:
    import xxhash

    from .tensorfile import pread_into

    where = {t.name: (fi, t) for fi, t in ckpt.tensors}
    out = []
    fds = [os.open(ckpt.root / f.relpath, os.O_RDONLY) for f in ckpt.files]
    try:
        for tensor, block, start, nbytes, want in rows:
            fi, t = where[tensor]
            buf = np.empty(nbytes, np.uint8)
            pread_into(fds[fi], memoryview(buf), t.start + start, ckpt.files[fi].relpath)
            if xxhash.xxh3_128_hexdigest(buf) != want:
                out.append(
                    Problem(
                        f"checkpoint {ckpt.name}",
                        f"block {block} of {tensor!r} differs from its registered hash",
                        "the file was modified in place: restore it or register --refresh",
                    )
                )
    finally:
        for fd in fds:
            os.close(fd)
    return out
