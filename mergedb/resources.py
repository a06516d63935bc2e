"""SQL shipped with mergedb: numbered migrations in `schema/` and planner statements in `queries/`.

Both folders live beside the package in a source checkout and inside it in an installed wheel
(pyproject's force-include); this module finds them either way.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from .errors import CatalogError


def resource_dir(kind: str) -> Path:
    """`schema/` or `queries/`: inside the installed package (wheel) or beside it (source checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / kind, here.parent / kind):
        if candidate.is_dir():
            return candidate
    raise CatalogError(f"cannot find mergedb's {kind}/ folder next to {here}; reinstall mergedb")


@cache
def query(name: str) -> str:
    """The text of `queries/<name>.sql`."""
    return (resource_dir("queries") / f"{name}.sql").read_text()


@cache
def statement(name: str) -> str:
    """queries/<name>.sql without its header comment lines, for con.sql(): DuckDB's Python layer
    tokenizes the text of every con.sql() call one character at a time (~3 ms a statement with
    the header, a small plan's largest cost after the connection)."""
    return "\n".join(line for line in query(name).splitlines() if not line.lstrip().startswith("--"))


def positions(first: int) -> str:
    """The `_plan_positions(checkpoint_id, position)` the candidate queries read: the plan's experts in
    plan order, from two list parameters ($first: checkpoint ids, $first+1: 0, 1, …) zipped by unnest.
    Not a registered Arrow table: registering and unregistering one cost ~1 ms per plan."""
    return (
        f"WITH _plan_positions AS (SELECT unnest(${first}::INTEGER[]) AS checkpoint_id, "
        f"unnest(${first + 1}::INTEGER[]) AS position) "
    )


@cache
def migrations() -> tuple[tuple[int, str, str], ...]:
    """(version, name, sql) of every `schema/NNN_name.sql`, in order (read once per process)."""
    return tuple(
        (int(p.name[:3]), p.stem, p.read_text()) for p in sorted(resource_dir("schema").glob("[0-9][0-9][0-9]_*.sql"))
    )
