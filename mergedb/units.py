"""Parsing and printing byte sizes: `4MiB`, `500MB`, `1.5GiB`, `1234`.

Sizes are exact (parsed as fractions, never through float). A plain number or a `B` size must be
a whole number of bytes (`1.5B` is refused); with a larger unit a fractional byte count is rounded
down (`0.1KiB` = 102 bytes), so a budget never exceeds what was written. Units are bytes in any
case (`kb` = `KB`), except that a capital prefix with a lowercase `b` (`Mb`, `Gib`) means bits
and is refused. Every size is at most MAX_BYTES. Also the checks of other values users give that the
CLI and the library share: thread counts, block layouts, checkpoint names, and budgets (`25%`, `all`).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction

from .errors import CatalogError, MergeDBError, PlanError

MAX_BYTES = 2**62  # 4 EiB: far above any checkpoint, and sums of such sizes stay inside int64
MAX_BLOCK_SIZE = 2**40  # 1 TiB: a block larger than this is one whole tensor anyway
MAX_THREADS = 1024
DEFAULT_BLOCK_SIZE = 4 * 2**20  # registration's block: the unit of statistics, planning and reads
AUTO = "auto"  # --block-size auto: vocabulary tensors in small row blocks, every other tensor at 4 MiB
AUTO_VOCAB_BLOCK = 64 * 2**10  # a vocabulary tensor's block under `auto`: 64 KiB of whole rows …
AUTO_VOCAB_ROWS = 64  # … and at most 64 rows (a 128-wide bf16 embedding: 16 KiB), see BlockSizes
DEFAULT_LAYOUT = AUTO  # a new base's layout when none is asked (README "Blocks"; issue 16's measurements)

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_EXAMPLE = "e.g. 4MiB, 500MB or 2GiB"


def parse_size(text: str | int, *, what: str = "size") -> int:
    """Bytes from `text`: a plain integer, or a number with a unit (B, KB, MB, GB, KiB, MiB, GiB, ...)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise MergeDBError(f"{what} must not be negative, got {text}")
        return _at_most_max(text, text, what)
    m = _SIZE.match(str(text))
    unit = m.group(2) if m else ""
    if m and len(unit) > 1 and unit[0].isupper() and unit[-1] == "b":
        raise MergeDBError(
            f"{what} {shown(text)} is in bits (lowercase b); write bytes with a capital B, "
            f"e.g. {m.group(1)}{unit[:-1]}B"
        )
    if not m or unit.lower() not in _UNITS and unit != "":
        raise MergeDBError(f"cannot read {what} {shown(text)}: write a number of bytes with a unit, {_EXAMPLE}")
    if len(m.group(1).lstrip("0").split(".")[0]) > 24:  # past any limit; keeps Fraction's parse short
        raise MergeDBError(f"{what} {shown(text)} is over the {MAX_BYTES}-byte (4 EiB) limit; {_EXAMPLE}")
    value = Fraction(m.group(1)) * _UNITS.get(unit.lower(), 1)
    if value.denominator != 1 and unit.lower() in ("", "b"):
        raise MergeDBError(f"{what} {shown(text)} is not a whole number of bytes; write e.g. {int(value)}B or 4MiB")
    return _at_most_max(int(value), text, what)  # int() rounds a fraction of a byte down


def _at_most_max(n: int, text: str | int, what: str) -> int:
    if n > MAX_BYTES:
        raise MergeDBError(f"{what} {shown(text)} is over the {MAX_BYTES}-byte (4 EiB) limit; {_EXAMPLE}")
    return n


def finite(value: object) -> float | None:
    """`value` as a float when it is a finite real number (an int or a float, not a bool); None for
    NaN, ±inf, an int past float's range, or anything else (a str, a list)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def shown(value: object) -> str:
    """`value` quoted for a message, shortened when it is long (a pasted number of 5000 digits)."""
    text = repr(value)
    return text if len(text) <= 48 else f"{text[:40]}…' ({len(str(value))} characters)"


def parse_block_size(text: str | int, *, what: str = "block size") -> int:
    """A registration block size: 1 byte (blocks are whole rows, so: one row per block) to 1 TiB."""
    if isinstance(text, str) and not _SIZE.match(text):  # a word (`autox`): say what is accepted
        raise MergeDBError(
            f"cannot read {what} {shown(text)}: write auto or a number of bytes with a unit, e.g. 4MiB or 64KiB"
        )
    n = parse_size(text, what=what)
    if not 1 <= n <= MAX_BLOCK_SIZE:
        example = "--block-size 4MiB or auto" if what == "block size" else "--vocab-block-size 64KiB"
        raise MergeDBError(f"{what} {shown(text)} must be between 1B and 1TiB; e.g. {example}")
    return n


@dataclass(frozen=True)
class BlockSizes:
    """How a new base's tensors split into blocks (layout.family_layout): `size` bytes of whole rows
    per block, except the vocabulary-indexed tensors (2-D, dim 0 = the vocabulary size:
    layout.vocab_size), whose blocks are `vocab` bytes and at most `vocab_rows` rows. `vocab` None:
    one size for every tensor. Stored per base in checkpoints (block_size, vocab_block_size,
    vocab_block_rows; schema/012)."""

    size: int = DEFAULT_BLOCK_SIZE
    vocab: int | None = None
    vocab_rows: int | None = None

    def __str__(self) -> str:
        if self.vocab is None:
            return format_size(self.size)
        rows = f", at most {self.vocab_rows} rows" if self.vocab_rows else ""
        return f"{format_size(self.size)}, vocabulary tensors {format_size(self.vocab)}{rows}"


def block_sizes(block_size: str | int | BlockSizes, vocab_block_size: str | int | None = None) -> BlockSizes:
    """The layout rule of `--block-size` and `--vocab-block-size`.

    `auto`: vocabulary tensors in blocks of 64 KiB and at most 64 rows, every other tensor in 4 MiB
    blocks; a size: that size for every tensor. `vocab_block_size` sets the vocabulary tensors' block
    exactly (no row cap), next to `auto` (then 4 MiB elsewhere) or a size."""
    if isinstance(block_size, BlockSizes):
        rule = block_size
    elif isinstance(block_size, str) and block_size.strip().lower() == AUTO:
        rule = BlockSizes(DEFAULT_BLOCK_SIZE, AUTO_VOCAB_BLOCK, AUTO_VOCAB_ROWS)
    else:
        rule = BlockSizes(parse_block_size(block_size))
    if vocab_block_size is not None:
        rule = BlockSizes(rule.size, parse_block_size(vocab_block_size, what="vocabulary block size"))
    return rule


def utf8(text: str) -> bool:
    """Whether `text` can be stored as UTF-8 (a file name in another encoding reaches Python as lone
    surrogates, which DuckDB refuses only when a row is inserted, after a whole scan)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_name(name: str, what: str) -> None:
    """Refuse checkpoint names that commands could not address (`--experts a,b` splits on commas
    and strips spaces)."""
    if not isinstance(name, str):
        raise MergeDBError(f"{what} {shown(name)} is not a str; give a name, e.g. expert-a")
    why = None
    if not name.strip():
        why = "is empty"
    elif name != name.strip():
        why = "has leading or trailing spaces"
    elif "," in name:
        why = "contains a comma"
    elif any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        why = "contains a control character"
    elif not any(ch.isprintable() and not ch.isspace() for ch in name):  # e.g. a zero-width space alone
        why = "has no visible character"
    elif not utf8(name):  # a folder named in another encoding: the catalog stores text
        why = "is not valid UTF-8"
    if why:
        raise MergeDBError(f"{what}, {name!r}, {why}, so commands could not refer to it; pass --name NAME")


def check_same_layout(base: str, have: BlockSizes, asked: BlockSizes) -> None:
    """Refuse a layout asked for a base registered with another (its experts' rows are per block)."""
    if have != asked:
        raise CatalogError(
            f"base {base!r} is registered with blocks of {have}, not {asked}; a base's layout cannot change "
            "in place (its experts' statistics are stored per block): leave out --block-size/"
            "--vocab-block-size to use its layout, or register the family into a new catalog"
        )


def check_threads(n: int) -> int:
    """A worker-thread count: 1 to MAX_THREADS (a numpy whole number as an int)."""
    if isinstance(n, numbers.Integral) and not isinstance(n, bool):
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise MergeDBError(f"threads must be a whole number from 1 to {MAX_THREADS}, got {n!r}; e.g. --threads 4")
    return n


def format_size(n: float) -> str:
    """`1.5 GiB`-style rendering for humans."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- budgets: how much of the experts a plan may read -------------------------------------------

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_budget(spec: str, full_bytes: int) -> int:
    """Budget bytes from `500MB`, `2GiB`, `25%`, `all` or `0`."""
    text = str(spec).strip()
    example = "write a size with a unit (500MB, 2GiB), a percentage of all expert bytes (25%), or all"
    if text.lower() == "all":
        return full_bytes
    m = _PERCENT.match(text)
    if m:
        pct = float(m.group(1))
        if pct > 100:
            raise PlanError(f"budget {shown(spec)} is over 100%; {example}")
        return full_bytes if pct == 100 else int(full_bytes * pct / 100)
    if text.startswith("-"):
        raise PlanError(f"budget {shown(spec)} is negative; {example}")
    if re.fullmatch(r"\d+\.?\d*|\.\d+", text) and text.strip("0."):  # 1, 1.0, .5: bytes? a fraction? refused
        raise PlanError(f"budget {shown(spec)} has no unit; {example}")
    try:
        return parse_size(text, what="budget")  # at most units.MAX_BYTES; more than the full read means all
    except MergeDBError as e:
        raise PlanError(f"{e}; or a percentage of all expert bytes (25%), or all") from None


def reads_everything(spec: str) -> bool:
    """Whether a budget spec is the full read by its form (`all`, `100%`): such a plan selects every
    candidate whatever the scores, so the planner need not compute trimmed values (the histogram
    fetch and its arithmetic, ~40% of a TIES plan): they order the cut and sum the omitted blocks'
    bound and estimate, which are 0. The stored plan is the same either way (tests/test_planner)."""
    text = str(spec).strip()
    m = _PERCENT.match(text)
    return text.lower() == "all" or (m is not None and float(m.group(1)) == 100)
