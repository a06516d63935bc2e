"""Which mergedb schema version a DuckDB file holds, or why it is not a mergedb catalog.

Read on every catalog connection (catalog.Catalog.duckdb_connection), so the usual case is one
statement; a file it does not recognise is looked at table by table to say what it is.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from . import faults
from .errors import CatalogError
from .resources import migrations


def read(con: duckdb.DuckDBPyConnection, path: Path, create: bool) -> tuple[int, int | None, tuple[int, ...]]:
    """The catalog's schema version (0: a new, empty database that `create` allows to become one),
    its sketch dimension when read on the way (settings), and the versions below it that were never
    applied (a catalog made by code of a branch that lacked a migration, e.g. 010 before 009 existed
    there: they are applied when the catalog is next opened for writing).

    A mergedb catalog is recognised by its `schema_version` table, whose first row is mergedb's
    first migration; any other DuckDB file is refused, never migrated. One statement answers
    for a mergedb catalog; only a file it does not recognise takes the slow path below, which
    says what it found."""
    latest, first = migrations()[-1][0], migrations()[0][1]
    try:  # one statement for the usual case, with no aggregate or subquery: each cost DuckDB ~0.15 ms
        rows = con.execute(
            "SELECT true, version, name FROM schema_version "
            "UNION ALL SELECT false, NULL, value FROM settings WHERE key = 'sketch_dim'"
        ).fetchall()
    except duckdb.Error:
        rows = []
    versions = [(v, name) for is_version, v, name in rows if is_version]
    applied = dict(versions)  # mergedb's version column is an INTEGER PRIMARY KEY; a table edited by hand
    ours = all(type(v) is int for v in applied) and len(applied) == len(versions)  # takes the slow path
    if ours and applied and min(applied) == 1 and applied[1] == first and max(applied) <= latest:
        current = max(applied)
        dims = [value for is_version, _, value in rows if not is_version and value is not None]
        missing = tuple(v for v in range(1, current) if v not in applied)
        return current, int(max(dims)) if dims else None, missing
    return _checked(con, path, create, latest, first), None, ()


# what a DuckDB file holds besides main's tables: a file with any of these is someone's, not empty
_USER_OBJECTS = """
SELECT 'schema ' || schema_name FROM duckdb_schemas()
 WHERE database_name = current_database() AND NOT internal AND schema_name <> 'main'
UNION ALL SELECT 'table ' || schema_name || '.' || table_name FROM duckdb_tables()
 WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'view ' || schema_name || '.' || view_name FROM duckdb_views()
 WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'sequence ' || sequence_name FROM duckdb_sequences() WHERE database_name = current_database()
UNION ALL SELECT 'macro ' || function_name FROM duckdb_functions()
 WHERE database_name = current_database() AND NOT internal
UNION ALL SELECT 'type ' || type_name FROM duckdb_types() WHERE database_name = current_database() AND NOT internal
"""


def _checked(con: duckdb.DuckDBPyConnection, path: Path, create: bool, latest: int, first: str) -> int:
    """read() for a file the one-statement check did not recognise: which tables it has, and why
    it is not (or not yet) a catalog this mergedb can open."""
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_catalog = current_database() AND table_schema = 'main' ORDER BY 1"
        ).fetchall()
    ]
    if "schema_version" not in tables:
        others = [] if tables else [r[0] for r in con.execute(_USER_OBJECTS).fetchall()]
        if others:  # no table in main, but a schema, macro or sequence of someone's: not empty
            raise faults.foreign(path, f"it holds {', '.join(others[:5])}{', …' if len(others) > 5 else ''}")
        if not tables and create:
            return 0
        if not tables:
            raise CatalogError(
                f"{path} is an empty DuckDB file, not a mergedb catalog yet; create one there with "
                "`mergedb register PATH`"
            )
        raise faults.foreign(
            path, f"it has tables {', '.join(tables[:5])}{', …' if len(tables) > 5 else ''} but no schema_version table"
        )
    cols = {
        r[0]
        for r in con.execute(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_catalog = current_database() AND table_schema = 'main' AND table_name = 'schema_version'"
        ).fetchall()
    }
    if not {"version", "name"} <= cols:
        raise faults.foreign(path, "its schema_version table is not mergedb's")
    rows = con.execute("SELECT version, name FROM schema_version ORDER BY version LIMIT 1").fetchall()
    if not rows or (rows[0][0], rows[0][1]) != (1, first):
        raise faults.foreign(path, f"its schema_version table does not start with mergedb's {first!r}")
    current = int(con.execute("SELECT max(version) FROM schema_version").fetchall()[0][0])
    if current > latest:
        raise CatalogError(
            f"catalog {path} was written by a newer mergedb (schema version {current}, this mergedb "
            f"knows up to {latest}); upgrade mergedb: pip install -U mergedb"
        )
    return current
