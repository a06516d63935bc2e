"""One DuckDB database per process, with each catalog file attached to it while an operation uses it.

`duckdb.connect(file)` builds a new database instance each time, and most of its ~13 ms goes to
DuckDB's catalog of built-in functions, whatever the file. ATTACH and DETACH on an instance kept
for the process take ~1.5 ms, and DETACH, like closing a connection, checkpoints the file and
releases its lock, so the catalog is still held only while an operation runs. The caller
(`Catalog.duckdb_connection`) lets one thread at a time hold a file; that thread may open the file
again while it holds it, and the inner opening shares what the outer one opened, in the same mode.

An operation whose settings must be its own (a registration's memory limit and spill folder, user
SQL's locked configuration) gets a database of its own (`config`), as `duckdb.connect` gives; an
opening nested in one of those shares it through DuckDB's own cache, as before, so that one file is
never open in two databases of the process. A child started by fork does not touch the database it
inherited (DuckDB's worker threads are not in the child): it makes its own. What a query on the
shared database spills goes to a folder of the process's own under the system's temporary folder
(an in-memory database would spill into `.tmp` in the working directory), removed at exit.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading
from typing import Any

import duckdb

_GUARD = threading.Lock()
_inherited: list[duckdb.DuckDBPyConnection] = []  # databases inherited through fork: never used or closed
_host: duckdb.DuckDBPyConnection | None = None
_pid = -1
_names = itertools.count()
_attached: dict[str, list] = {}  # realpath -> [alias, read_only, openings] in the shared database
_own: dict[str, int] = {}  # realpath -> openings in databases of their own
_open: dict[int, tuple[str, bool]] = {}  # id of each open connection -> (realpath, attached)


def _database() -> duckdb.DuckDBPyConnection:
    global _host, _pid
    if _pid != os.getpid():
        if _host is not None:
            _inherited.append(_host)  # closing it here could wait on threads that exist only in the parent
        spill = os.path.join(tempfile.gettempdir(), f"mergedb-duckdb-{os.getpid()}")
        _host, _pid = duckdb.connect(":memory:", config={"temp_directory": spill}), os.getpid()
        atexit.register(shutil.rmtree, spill, ignore_errors=True)
        _attached.clear()
        _own.clear()
        _open.clear()
    assert _host is not None
    return _host


def connect(path: str, read_only: bool, config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
    """A connection to catalog file `path`, read-only or read-write: the file attached to the
    process's database (its default database), or with `config` a database of its own."""
    key = os.path.realpath(path)
    with _GUARD:
        host = _database()
        held = _attached.get(key)
        if config is not None or key in _own:
            if held is not None:
                raise duckdb.ConnectionException(
                    f"Can't open a connection to same database file with a different configuration: {path} is "
                    "open in this thread already"
                )
            con = duckdb.connect(path, read_only=read_only, config=config or {})
            _own[key] = _own.get(key, 0) + 1
            _open[id(con)] = (key, False)
            return con
        if held is None:
            alias = f"mergedb_catalog_{next(_names)}"
            quoted = str(path).replace("'", "''")
            host.execute(f"ATTACH '{quoted}' AS {alias}" + (" (READ_ONLY)" if read_only else ""))
            held = _attached[key] = [alias, read_only, 0]
        elif held[1] != read_only:
            raise duckdb.ConnectionException(
                f"Can't open a connection to same database file with a different configuration: {path} is "
                f"open {'read-only' if held[1] else 'read-write'} in this thread"
            )
        held[2] += 1
        try:
            con = host.cursor()
            con.execute(f"USE {held[0]}")
        except BaseException:
            _release(key, True)
            raise
        _open[id(con)] = (key, True)
        return con


def close(con: duckdb.DuckDBPyConnection) -> None:
    """Close `con` (closing one twice is harmless); detach the file `connect` attached for it
    (checkpoint, release the lock) when no other opening holds it."""
    try:
        con.close()
    finally:
        with _GUARD:
            key, attached = _open.pop(id(con), (None, False))
            if key is not None:
                _release(key, attached)


def _release(key: str, attached: bool) -> None:
    if _pid != os.getpid():
        return
    if not attached:
        _own[key] -= 1
        if not _own[key]:
            del _own[key]
        return
    held = _attached[key]
    held[2] -= 1
    if held[2] == 0:
        del _attached[key]
        assert _host is not None
        try:
            _host.execute(f"DETACH {held[0]}")
        except BaseException:
            _drop()
            raise


def _drop() -> None:
    """Give up the shared database (a DETACH failed: its file may still be attached); the next
    opening makes a new one."""
    global _host, _pid
    host, _host, _pid = _host, None, -1
    _attached.clear()
    for k in [k for k, (_, attached) in _open.items() if attached]:
        del _open[k]
    if host is not None:
        try:
            host.close()
        except duckdb.Error:
            pass
