"""What a DuckDB error says about the catalog file, in words a user can act on: damaged (truncated,
a block failing its checksum, not a DuckDB file), on a full disk, or in a folder that cannot be
written. Plus `rollback`, which never hides the error being handled."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from .errors import CatalogError

DAMAGED = re.compile(
    r"checksum|corrupt|Could not read enough bytes|not a valid DuckDB database|database has been invalidated|"
    r"Failed to deserialize|Serialization Error",
    re.IGNORECASE,
)
NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|File too large", re.IGNORECASE)
NO_WRITE = re.compile(r"Permission denied|Read-only file system|Not a directory|Operation not permitted", re.I)
RECOVER = (
    "restore it from a backup, or move it aside and register the checkpoints again with `mergedb register` "
    "(its plans and runs are lost with it)"
)


def diagnose(path: Path, e: BaseException) -> CatalogError | None:
    """A CatalogError when `e` (or the error it was raised while handling, e.g. "transaction is
    aborted" from clean-up code) means a damaged catalog or an unwritable folder; else None."""
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__context__
    for x in reversed(chain):  # the first cause first
        if not isinstance(x, duckdb.Error):
            continue
        text = str(x).strip().splitlines()[0] if str(x).strip() else type(x).__name__
        if NO_SPACE.search(str(x)):
            return CatalogError(
                f"cannot write catalog {path}: its disk is full or a size limit was reached ({text}); "
                "free space (or raise the limit) and run the command again"
            )
        if NO_WRITE.search(str(x)):
            return unwritable(path, f" ({text})")
        if "not a valid DuckDB database" in str(x):
            return not_duckdb(path)
        if DAMAGED.search(str(x)) or isinstance(x, duckdb.SerializationException):
            return CatalogError(f"catalog {path} is damaged ({text}); {RECOVER}")
    return None


def unwritable(path: Path, detail: str = "") -> CatalogError:
    """The catalog's folder is read-only or not a folder (`detail`: the system's words, if any)."""
    return CatalogError(
        f"cannot write catalog {path}: its folder {path.parent} is read-only or not a folder{detail}; "
        "pass --catalog with a path in a writable folder"
    )


def not_duckdb(path: Path) -> CatalogError:
    return CatalogError(
        f"{path} is not a DuckDB file, so not a mergedb catalog; pass --catalog with a mergedb catalog "
        f"(if it was one, it is damaged: {RECOVER})"
    )


def foreign(path: Path, why: str) -> CatalogError:
    return CatalogError(
        f"{path} is a DuckDB file but not a mergedb catalog ({why}); mergedb leaves it unchanged. "
        "Pass --catalog with a mergedb catalog, or a new path for `mergedb register` to create one"
    )


def rollback(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back the open transaction, if DuckDB has not already ended it. For `except` blocks: an
    error here (e.g. "no transaction is active" after a failed COMMIT) must never hide the one
    being handled."""
    try:
        con.execute("ROLLBACK")
    except duckdb.Error:
        pass
