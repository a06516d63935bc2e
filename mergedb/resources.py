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
def migrations() -> tuple[tuple[int, str, str], ...]:
    """(version, name, sql) of every `schema/NNN_name.sql`, in order (read once per process)."""
    return tuple(
        (int(p.name[:3]), p.stem, p.read_text()) for p in sorted(resource_dir("schema").glob("[0-9][0-9][0-9]_*.sql"))
    )
