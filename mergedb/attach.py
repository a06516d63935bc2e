"""One DuckDB database per process, with each catalog file attached to it while an operation uses it.

`duckdb.connect(file)` builds a new database instance each time, and most of its ~13 ms goes to
DuckDB's catalog of built-in functions, whatever the file. ATTACH and DETACH on an instance kept
for the process take ~1.5 ms, and DETACH, like closing a connection, checkpoints the file and
releases its lock, so the catalog is still held only while an operation runs.

The caller (`Catalog.duckdb_connection`) lets one thread at a time open a given file; that thread
may open it again while it holds it, and the inner opening shares what the outer one opened: a
read-only opening inside a read-write one reads through it (`Catalog.hold` keeps a file open
read-write across a program's operations), a read-write one inside a read-only one is refused.
ATTACH and DETACH run outside this module's lock, so one thread's checkpoint does
not hold up another thread's catalog. Settings a caller SETs on a shared connection stay for the
process's later operations: an operation whose settings must be its own (a registration's memory
limit and spill folder, user SQL's locked configuration) gets a database of its own (`config`), as
`duckdb.connect` gives; an opening nested in one of those shares it through DuckDB's own cache, so
that one file is never open in two databases of the process.

A child started by fork never uses or frees the database it inherited (DuckDB's worker threads
exist only in the parent: freeing it at the child's exit crashed the child); it makes its own on
its first opening. What a query on the shared database spills goes to a folder of the process's
own under the system's temporary folder (an in-memory database would spill into `.tmp` in the
working directory), made by DuckDB only if a query spills and removed when the process exits.

The shared database runs each statement on the thread that asks (`threads = 1`): a small catalog's
statements take well under a millisecond, and DuckDB's hand-off to a worker thread and back cost
~10% of a small plan's call (bench catalog: 30 → 27 ms for TIES). A catalog file larger than
`LARGE` gets a database of its own with DuckDB's default threads (one per core), where a plan's
statements scan hundreds of thousands of rows or more: on simulated catalogs here (2 cores), one
thread planned 20k- and 100k-row catalogs (9 and 30 MiB) 3–12% faster and a 300k-row one (84 MiB) 12%
slower at a 10% budget.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import duckdb

LARGE = 64 * 2**20  # bytes: a catalog file larger than this is opened in a database of its own
_GUARD = threading.Lock()  # this module's state; never held across a DuckDB statement
_inherited: list[duckdb.DuckDBPyConnection] = []  # databases inherited through fork: never used or freed
_host: duckdb.DuckDBPyConnection | None = None
_names = itertools.count()
_attached: dict[str, list] = {}  # realpath -> [alias, read_only, openings] in the shared database
_stale: dict[str, str] = {}  # realpath -> alias of a DETACH that failed with the file still attached
_own: dict[str, list] = {}  # realpath -> [openings, read_only, configured] in databases of their own
_open: dict[int, tuple[str, bool]] = {}  # id of each open connection -> (realpath, attached)
_parents: set[str] = set()  # files open in the process this one was forked from, at the fork


def _database() -> duckdb.DuckDBPyConnection:
    """The shared database (made on first use; the caller holds _GUARD)."""
    global _host
    if _host is None:
        # named, not made: DuckDB makes it only if a query spills (a folder made here was left behind
        # by every process that ended without its exit handlers: os._exit, a kill); the random part
        # keeps another user of a shared /tmp from placing something at that name first
        spill = os.path.join(tempfile.gettempdir(), f"mergedb-duckdb-{os.getpid()}-{secrets.token_hex(8)}")
        atexit.register(_remove_spill, spill, os.getpid())
        _host = duckdb.connect(":memory:", config={"temp_directory": spill, "threads": 1})
    return _host


def _remove_spill(folder: str, pid: int) -> None:
    if os.getpid() == pid:  # not a forked child's exit: the folder is its parent's
        shutil.rmtree(folder, ignore_errors=True)


def _forked() -> None:
    """In a child started by fork: forget the parent's database and state (another thread may have
    held _GUARD at the fork), and keep the inherited database from ever being freed."""
    global _GUARD, _host
    _GUARD = threading.Lock()
    if _host is not None:
        _inherited.append(_host)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_host))  # not freed even at the interpreter's exit
    _host = None
    # a file the parent had open stays open in this process's copy of its memory, for good: DuckDB would
    # hand a database of its own back from its cache (the parent's, whose writes would be lost) or refuse
    # an attachment with "Unique file handle conflict"; refused here, saying why (`connect`)
    _parents.update(_attached, _stale, _own)
    for d in (_attached, _stale, _own, _open):
        d.clear()


os.register_at_fork(after_in_child=_forked)


def holds(path: str) -> bool:
    """Whether this process has catalog file `path` open (attached, or in a database of its own)."""
    key = os.path.realpath(path)
    with _GUARD:
        return key in _attached or key in _own or key in _stale


def mode(path: str) -> bool | None:
    """How this process has catalog file `path` open: read-only (True), read-write (False), or not (None)."""
    key = os.path.realpath(path)
    with _GUARD:
        held = _attached.get(key) or _own.get(key)
        return None if held is None else held[1]


def connect(path: str, read_only: bool, config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
    """A connection to catalog file `path`, read-only or read-write: the file attached to the
    process's database (its default database), or with `config`, or when the file is larger than
    LARGE, a database of its own."""
    key = os.path.realpath(path)
    if key in _parents:
        raise duckdb.ConnectionException(
            "it was open in the process this one was forked from when it forked, and DuckDB's state for it here "
            "is a copy of that process's; open it in a process started after that operation ended, or with the "
            "'spawn' start method (multiprocessing.get_context('spawn'))"
        )
    large = config is None and _size(path) > LARGE
    with _GUARD:
        host = _database()
        held = _attached.get(key)
        mine = _own.get(key)
        # a file this thread holds already is opened where it is held, whatever its size now, and in
        # the mode it is held in: a reader inside a read-write opening reads through it
        own = config is not None or mine is not None or (large and held is None)
        was = held[1] if held is not None else mine[1] if mine is not None else None  # read_only, if open
        # settings of its own (a registration's, user SQL's) are not had inside an opening without them
        unset = config is not None and (held is not None or (mine is not None and not mine[2]))
        if unset or (was and not read_only):
            raise duckdb.ConnectionException(
                f"Can't open a connection to same database file with a different configuration: {path} is "
                f"open {'read-only' if was else 'read-write'} in this thread already"
                + (
                    ": registration and user SQL open it with settings of their own, so they cannot run inside "
                    "another operation on it or a Catalog.hold block; run them outside it"
                    if unset
                    else ": an operation that writes cannot run inside a read-only one"
                )
            )
        read_only = read_only if was is None else was
        if mine is not None:
            mine[0] += 1
        elif own:  # [openings, read_only, opened with settings of its own]
            _own[key] = [1, read_only, config is not None]
        elif held is not None:
            held[2] += 1
        stale = _stale.pop(key, None)
    if stale is not None:  # a failed DETACH left the file attached: detach it before opening it again
        try:
            _detach(host, key, stale)
        except BaseException:
            if own:  # (a stale file is in no attachment: nothing else was counted)
                _release(key, False)
            raise
    if own:
        return _counted(key, False, lambda: duckdb.connect(path, read_only=read_only, config=config or {}))
    if held is None:  # the first opening: attach (outside the lock; the caller serialises this file)
        alias = f"mergedb_catalog_{next(_names)}"
        quoted = str(path).replace("'", "''")
        try:
            _run(host, f"ATTACH '{quoted}' AS {alias}" + (" (READ_ONLY)" if read_only else ""))
        except BaseException:
            if _still_attached(host, alias):  # interrupted after DuckDB attached it: detached next time
                with _GUARD:
                    _stale[key] = alias
            raise
        held = [alias, read_only, 1]
        with _GUARD:
            _attached[key] = held
    alias = held[0]
    return _counted(key, True, lambda: host.cursor().execute(f"USE {alias}"))


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # not made yet: DuckDB makes it, or says why not
        return 0


def _counted(key: str, attached: bool, make: Callable[[], duckdb.DuckDBPyConnection]) -> duckdb.DuckDBPyConnection:
    """make()'s connection, recorded for `close`; the opening counted for `key` is given back if it fails."""
    try:
        con = make()
    except BaseException:
        _release(key, attached)
        raise
    with _GUARD:
        _open[id(con)] = (key, attached)
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
    with _GUARD:
        if not attached:
            _own[key][0] -= 1
            if not _own[key][0]:
                del _own[key]
            return
        held = _attached[key]
        held[2] -= 1
        if held[2]:
            return
        del _attached[key]
        host = _host
    assert host is not None
    _detach(host, key, held[0])


def _detach(host: duckdb.DuckDBPyConnection, key: str, alias: str) -> None:
    """DETACH `alias` (file `key`). DuckDB detaches before it checkpoints: when the checkpoint fails
    (a full disk) the file is detached with its committed rows in its WAL, as when a close's
    checkpoint failed, and the operation stands. An interrupt is the caller's to handle; if the file
    is still attached then, its next opening (or `holds`) sees it in _stale and detaches it first."""
    try:
        _run(host, f"DETACH DATABASE IF EXISTS {alias}")
    except BaseException as e:
        still = _still_attached(host, alias)
        if still:
            with _GUARD:
                _stale[key] = alias
        if still or not isinstance(e, duckdb.Error):
            raise


def _still_attached(host: duckdb.DuckDBPyConnection, alias: str) -> bool:
    try:
        return alias in {r[0] for r in _run(host, "SELECT database_name FROM duckdb_databases()")}
    except BaseException:  # cannot tell: assume so (detaching it again is harmless: IF EXISTS)
        return True


def _run(host: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    """`sql` on a connection of its own to the shared database: DuckDB refuses a second statement on
    a connection another thread is using."""
    con = host.cursor()
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()
