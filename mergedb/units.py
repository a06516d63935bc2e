"""Parsing and printing byte sizes: `4MiB`, `500MB`, `2GiB`, `1234`."""

from __future__ import annotations

import re

from .errors import MergeDBError

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Bytes from `text`: a plain integer, or a number with a unit (B, KB, MB, GB, KiB, MiB, GiB, ...)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise MergeDBError(f"{what} must not be negative, got {text}")
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS and unit != "":
        raise MergeDBError(
            f"cannot read {what} {text!r}: write a number of bytes with a unit, e.g. 4MiB, 500MB or 2GiB"
        )
    value = float(m.group(1)) * _UNITS.get(unit, 1)
    if value != int(value) and not unit:
        raise MergeDBError(f"{what} {text!r} is not a whole number of bytes; e.g. 4MiB")
    return int(value)


def format_size(n: float) -> str:
    """`1.5 GiB`-style rendering for humans."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
