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

import threading
from collections.abc import Callable
from typing import Any, TypeVar

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
ALLOWED = "SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN, PIVOT … IN (…)"
T = TypeVar("T")


def interruptibly(con: duckdb.DuckDBPyConnection, work: Callable[[], T]) -> T:
    """work() (a statement on `con`) in a thread of its own while this thread waits, so that Ctrl-C
    or SIGTERM stops a query that runs for minutes: DuckDB looks for a signal only while the calling
    thread runs one of the query's tasks, and when its worker threads hold every task (a scan of one
    big range on two cores) the signal went unseen until the query ended (4 of 12 tries here). The
    wait here is Python's, which a signal ends; the query is then stopped (`_stop`) and the signal's
    exception raised once its thread has ended, whenever the signal came: before the thread ran the
    statement (it then never does), or while DuckDB was still preparing it."""
    done: dict[str, Any] = {}
    finished = threading.Event()  # not Thread.join: one interrupted by a signal (3.11) marks the thread ended
    phase = ["new"]  # new -> running, or new -> cancelled (the statement is then never run)
    lock = threading.Lock()

    def run() -> None:
        try:
            with lock:
                if phase[0] == "cancelled":
                    return
                phase[0] = "running"
            done["value"] = work()
        except BaseException as e:  # re-raised in the calling thread
            done["error"] = e
        finally:
            finished.set()

    thread = threading.Thread(target=run, name="mergedb-sql", daemon=True)
    try:
        thread.start()
        while not finished.wait(0.1):  # a signal delivered to another thread is seen within 0.1 s
            pass
    except BaseException:
        _stop(con, finished, lock, phase)
        raise
    if "error" in done:
        raise done["error"]
    return done["value"]


def _stop(con: duckdb.DuckDBPyConnection, finished: threading.Event, lock: Any, phase: list[str]) -> None:
    """Cancel interruptibly's statement if its thread has not begun it, else interrupt it until the
    thread ends: DuckDB forgets an interrupt that comes before the query executes (the first ~1.5 ms
    of a statement), so it is repeated. A second Ctrl-C meanwhile does not cut this short: the
    connection can only be closed once the thread has let go of it."""
    while True:
        try:
            with lock:
                if phase[0] == "new":
                    phase[0] = "cancelled"
            if phase[0] == "cancelled":
                return
            con.interrupt()
            if finished.wait(0.01):
                return
        except KeyboardInterrupt:
            continue


TEXT_TYPES = ("BIT", "INTERVAL")  # Arrow has them as DuckDB's own bytes (BIT) or a triple: text is what they say


def as_text(rel: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """`rel` with its BIT and INTERVAL columns as text (a BIT's bits '1010…', not the hex of DuckDB's
    encoding, which read like another bit string; an INTERVAL as '3 days'). A result whose column names
    repeat is left as it is (a projection could not tell them apart)."""
    types = [str(t) for t in rel.types]
    if not any(t in TEXT_TYPES for t in types) or len(set(rel.columns)) < len(rel.columns):
        return rel
    quoted = ['"' + c.replace('"', '""') + '"' for c in rel.columns]
    return rel.project(", ".join(f"{q}::VARCHAR AS {q}" if t in TEXT_TYPES else q for q, t in zip(quoted, types)))


def check_statement(con: duckdb.DuckDBPyConnection, text: str) -> None:
    """Refuse anything but exactly one query (see the module's docstring)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes in another encoding (a shell argument): DuckDB raised a TypeError
        raise MergeDBError(f"the SQL text {text!r} is not valid UTF-8; write it in UTF-8") from None
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
    kind = _kind(statements[0])
    if kind == duckdb.StatementType.EXPLAIN:  # EXPLAIN ANALYZE runs its statement: that one must be a query
        inner = _explained(con, statements[0].query)
        if inner not in (duckdb.StatementType.SELECT,):
            what = f"a {inner.name} statement" if inner is not None else "that statement"
            raise MergeDBError(f"mergedb sql explains queries only, and {what} is not one; allowed: {ALLOWED}")
    if kind == duckdb.StatementType.MULTI:  # a PIVOT without IN, whatever comment or WITH comes first
        raise MergeDBError(
            "mergedb sql runs PIVOT with its values listed, e.g. PIVOT plans ON method IN ('ties', 'linear') "
            "USING count(*): without IN, DuckDB first creates a type, which the read-only catalog refuses"
        )
    if kind not in STATEMENTS:
        what = f"a {kind.name} statement" if kind is not None else "that statement"
        if kind in (duckdb.StatementType.LOAD, duckdb.StatementType.CALL, duckdb.StatementType.SET):
            word = _first_word(text)  # DuckDB's kind of CHECKPOINT is CALL, of USE and RESET SET, of INSTALL LOAD
            what = f"{'an' if word[:1] in 'AEIO' else 'a'} {word} statement"  # a USE, an INSTALL
        raise MergeDBError(f"mergedb sql only reads the catalog, and {what} is not a query; allowed: {ALLOWED}")


def _kind(statement: Any) -> duckdb.StatementType | None:
    """The statement's type; None for one this DuckDB's Python layer has no name for (UPDATE
    EXTENSIONS raised ValueError)."""
    try:
        return statement.type
    except ValueError:
        return None


def _explained(con: duckdb.DuckDBPyConnection, text: str) -> duckdb.StatementType | None:
    """The type of the statement an EXPLAIN [ANALYZE] [(options)] text explains (None: unknown)."""
    words = _words(text)
    i = 1  # after EXPLAIN
    if i < len(words) and words[i][1].strip() == "ANALYZE":
        i += 1
    if i < len(words) and words[i][1].strip().startswith("("):  # (FORMAT json): up to its closing parenthesis
        start, depth = i, 0
        while i < len(words):
            depth += words[i][1].count("(") - words[i][1].count(")")
            i += 1
            if depth <= 0:
                break
        if i >= len(words):  # nothing after it: the parentheses held the statement, EXPLAIN (SELECT 1)
            i = start
    if i >= len(words):
        return None
    try:
        inner = con.extract_statements(text[words[i][0] :])
    except duckdb.Error:
        return None
    return _kind(inner[0]) if len(inner) == 1 else None


def _words(text: str) -> list[tuple[int, str]]:
    """(offset, upper-cased text) of each token of `text` that is not a comment (DuckDB's tokenizer)."""
    tokens = duckdb.tokenize(text)
    return [(at, text[at:end].upper()) for (at, kind), end in zip(tokens, [t[0] for t in tokens[1:]] + [len(text)])
            if kind != duckdb.token_type.comment]  # fmt: skip


def _first_word(text: str) -> str:
    """The statement's first keyword, past comments (what the user typed, not DuckDB's kind of it)."""
    words = _words(text)
    return words[0][1].strip().rstrip(";") if words else "?"


TOO_BIG = "the query's result does not fit in memory: add a LIMIT, select fewer or shorter columns, or aggregate"
# what DuckDB raises when the catalog file itself fails (damage, a full disk, permissions); anything
# else a query raises is about its own text or values, whatever words those hold
STORAGE_ERRORS = (duckdb.IOException, duckdb.SerializationException, duckdb.FatalException, duckdb.InternalException)


def sql_error(e: duckdb.Error) -> MergeDBError:
    hint = ""
    if isinstance(e, duckdb.PermissionException) or "configuration has been locked" in str(e):
        hint = " (mergedb sql reads the catalog only: other files, extensions and settings are off limits)"
    if "arrow_large_buffer_size" in str(e):  # DuckDB suggests a SET, which the sandbox refuses
        return MergeDBError(f"SQL error: a column's text adds up to more than 2 GB; {TOO_BIG}")
    if isinstance(e, duckdb.OutOfMemoryException):  # its advice (SET memory_limit, threads) is refused here
        return MergeDBError(f"SQL error: {str(e).splitlines()[0]}; {TOO_BIG}")
    if "INSTALL " in str(e) and "LOAD " in str(e):  # a function of an extension: its advice is refused here
        first = str(e).split("\n")[0].rstrip(".")
        return MergeDBError(f"SQL error: {first} (extensions are off limits in mergedb sql, which reads the catalog)")
    return MergeDBError(f"SQL error: {e}{hint}")


def table_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    """The rows of an Arrow table as tuples of Python values, by position (so two columns of one
    name stay apart). A column Python cannot hold (DuckDB's infinite dates, timestamps past year
    9999) comes back as DuckDB's own text for its values, e.g. 'infinity'."""
    columns = []
    try:
        for col in table.columns:
            try:
                columns.append(col.to_pylist())
            except (OverflowError, ValueError, pa.ArrowException):
                columns.append(_as_text(col))
        return list(zip(*columns)) if columns else []
    except MemoryError:
        raise MergeDBError(TOO_BIG) from None


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
