"""The machine-readable formats of the CLI's results: JSON and CSV on standard output.

Values come from Python and from DuckDB (HUGEINT, DECIMAL, BLOB, nested lists and structs, NaN), and
each format carries them as a reader of that format expects: JSON without NaN (null) and with
numbers for DuckDB's wide integers; CSV with nested values as their JSON text, bytes as hex, and a
field holding a line break of either kind quoted, so that every reader gets the rows back whole.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any


def plain(v: Any) -> Any:
    """A value as JSON can carry it: NaN and ±inf as null (JSON has neither), DuckDB's HUGEINT and
    DECIMAL (Python Decimal) as numbers, bytes as hex, nested lists and structs element by element;
    anything else (dates, intervals) as its text."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v if v is None or isinstance(v, (str, int, bool)) else str(v)


def write_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(plain(doc), allow_nan=False) + "\n")


def csv_value(v: Any) -> Any:
    """A CSV field: nested values as their JSON text (not Python's repr), bytes as hex (no quotes)."""
    if isinstance(v, (dict, list, tuple, bytes, bytearray, memoryview)):
        return json.dumps(plain(v)) if isinstance(v, (dict, list, tuple)) else bytes(v).hex()
    return v


def write_csv(rows: Iterable[Sequence[Any]]) -> None:
    """Rows as CSV lines ending in \\n. The csv module quotes a field holding a character of its line
    terminator only, so with "\\n" a bare \\r went unquoted and split the row for every reader (a
    checkpoint path may hold one; review, 2026-12-03): each row is written with "\\r\\n", which quotes
    both, and its own terminator then cut to "\\n"."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\r\n")
    lines = []
    for r in rows:
        writer.writerow([csv_value(v) for v in r])
        lines.append(buf.getvalue()[:-2] + "\n")
        buf.seek(0)
        buf.truncate()
    sys.stdout.write("".join(lines))
