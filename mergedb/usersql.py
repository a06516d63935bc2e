"""User SQL against the catalog (`mergedb sql`, `Catalog.sql`): which statements run, in what
sandbox, and how results become Python rows.

Allowed: exactly one statement whose type is in `STATEMENTS` — SELECT (which in DuckDB also
covers WITH, FROM-first queries, VALUES, DESCRIBE, SHOW, SUMMARIZE and PIVOT with an IN list) or
EXPLAIN. It runs
on a read-only connection opened with `SANDBOX`: no file but the catalog can be read or written
(read_csv, read_text, glob, COPY, EXPORT, ATTACH), no extension installed or loaded, and SET,
RESET or PRAGMA cannot change that because the configuration is locked.
"""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa

from .errors import MergeDBError

SANDBOX = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}
STATEMENTS = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)
ALLOWED = "SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN"


def check_statement(con: duckdb.DuckDBPyConnection, text: str) -> None:
    """Refuse anything but exactly one query (see the module's docstring)."""
    try:
        statements = con.extract_statements(text)
    except duckdb.Error as e:
        raise MergeDBError(f"SQL error: {e}") from None
    if not statements:
        raise MergeDBError(f"mergedb sql needs one statement ({ALLOWED}), e.g. SELECT * FROM expert_costs")
    if len(statements) > 1:
        raise MergeDBError(
            f"mergedb sql runs exactly one statement; this text has {len(statements)}: run them one at a time"
        )
    kind = statements[0].type
    if kind == duckdb.StatementType.MULTI and text.lstrip().upper().startswith("PIVOT"):
        raise MergeDBError(
            "mergedb sql runs PIVOT with its values listed, e.g. PIVOT plans ON method IN ('ties', 'linear') "
            "USING count(*): without IN, DuckDB first creates a type, which the read-only catalog refuses"
        )
    if kind not in STATEMENTS:
        raise MergeDBError(
            f"mergedb sql only reads the catalog, and a {kind.name} statement is not a query; allowed: {ALLOWED}"
        )


def sql_error(e: duckdb.Error) -> MergeDBError:
    hint = ""
    if isinstance(e, duckdb.PermissionException) or "configuration has been locked" in str(e):
        hint = " (mergedb sql reads the catalog only: other files, extensions and settings are off limits)"
    return MergeDBError(f"SQL error: {e}{hint}")


def table_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    """The rows of an Arrow table as tuples of Python values, by position (so two columns of one
    name stay apart). A column Python cannot hold (DuckDB's infinite dates, timestamps past year
    9999) comes back as DuckDB's own text for its values, e.g. 'infinity'."""
    columns = []
    for col in table.columns:
        try:
            columns.append(col.to_pylist())
        except (OverflowError, ValueError, pa.ArrowException):
            columns.append(_as_text(col))
    return list(zip(*columns)) if columns else []


def distinct_names(names: list[str]) -> list[str]:
    """Column names made distinct for JSON objects: a repeated name gets a suffix (name, name_2)."""
    seen: set[str] = set()
    out = []
    for n in names:
        key, i = n, 1
        while key in seen:
            i += 1
            key = f"{n}_{i}"
        seen.add(key)
        out.append(key)
    return out


def _as_text(col: pa.ChunkedArray) -> list[str | None]:
    con = duckdb.connect(config=SANDBOX)
    try:
        con.register("col", pa.table({"v": col}))
        return [r[0] for r in con.execute("SELECT CAST(v AS VARCHAR) FROM col").fetchall()]
    finally:
        con.close()
