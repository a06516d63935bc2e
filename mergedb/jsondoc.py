"""JSON documents: those mergedb writes with long lists of rows (a manifest's trim row per (expert,
tensor), a layout row per tensor), written and hashed a piece at a time (json.dumps of a 15 MB
manifest held its text twice, and its indented encoder is pure Python); and those it reads from
files a user gives (indexes, configs, manifests), where every way the text can fail is one error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import FormatError

_ROWS_PER_PIECE = 1024
_ROWS_PER_LINE = 16  # write_json: lists longer than this have a row per line
_SORTED = json.JSONEncoder(sort_keys=True)  # json.dumps(x, sort_keys=True), without a new encoder a call


def compact_pieces(doc: dict[str, Any]) -> Iterator[str]:
    """The text of `json.dumps(doc, sort_keys=True)` in pieces, long lists a slice of rows at a time:
    as one string (and its bytes) a manifest with a trim row per (expert, tensor) held ~2× its
    size at once. Each piece is json's own (C) encoding of a key, a value or a slice of a list.
    The document's own keys must be strings (json would write 1 as "1": refused, not mimicked)."""
    _string_keys(doc)
    yield "{"
    for i, key in enumerate(sorted(doc)):
        yield (", " if i else "") + json.dumps(key) + ": "
        value = doc[key]
        if not isinstance(value, list) or len(value) <= _ROWS_PER_PIECE:
            yield _SORTED.encode(value)
            continue
        yield "["
        for at in range(0, len(value), _ROWS_PER_PIECE):  # "[a, b]" without its brackets
            yield (", " if at else "") + _SORTED.encode(value[at : at + _ROWS_PER_PIECE])[1:-1]
        yield "]"
    yield "}"


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """`doc` as indented JSON into `path`, keys sorted, except that a long list (a row per (expert,
    tensor), per tensor, …) has one compact row per line, and a long mapping (a hash or a shard per
    tensor) one compact entry per line (for string values, json's indented text exactly): json's
    indented encoder is pure Python (a 15 MB manifest of 80k trim rows took 0.45 s, and held its
    whole text twice), rows go through its C encoder one at a time. Written a piece at a time, so
    an error part way leaves a cut file: every caller writes into a temporary folder it installs
    only when whole. The text parses to `doc`. Its keys, and a long mapping's, must be strings."""
    _string_keys(doc)
    with open(path, "w", encoding="utf-8") as f:
        f.write("{")
        for i, key in enumerate(sorted(doc)):
            f.write(("," if i else "") + "\n  " + json.dumps(key) + ": ")
            value = doc[key]
            if isinstance(value, list) and len(value) > _ROWS_PER_LINE:
                for at in range(0, len(value), _ROWS_PER_PIECE):
                    rows = ",\n    ".join(map(_SORTED.encode, value[at : at + _ROWS_PER_PIECE]))
                    f.write(("[\n    " if at == 0 else ",\n    ") + rows)
                f.write("\n  ]")
            elif isinstance(value, dict) and len(value) > _ROWS_PER_LINE:
                _string_keys(value)
                entries = (json.dumps(k) + ": " + _SORTED.encode(value[k]) for k in sorted(value))
                f.write("{\n    " + ",\n    ".join(entries) + "\n  }")
            else:  # indented as json.dumps(doc, indent=2) indents it
                f.write(json.dumps(value, indent=2, sort_keys=True).replace("\n", "\n  "))
        f.write("\n}\n" if doc else "}\n")


def _string_keys(doc: dict[str, Any]) -> None:
    bad = [k for k in doc if not isinstance(k, str)]
    if bad:
        raise TypeError(f"JSON document keys must be strings, got {bad[0]!r}")


class DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a dict, refusing a key seen twice in one object (at any depth)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out


def parse(raw: bytes | str, unique_keys: bool = False) -> Any:
    """JSON text from a file a user gave, with every way it can fail to be read raised as ValueError:
    json's own errors, text that is not UTF-8 and an integer of more digits than Python converts are
    ValueErrors already; nesting deeper than the interpreter's recursion limit (a RecursionError,
    which no reader caught) becomes one. `unique_keys`: a key twice in one object raises DuplicateKey."""
    try:
        return json.loads(raw, object_pairs_hook=no_duplicate_keys if unique_keys else None)
    except RecursionError:
        raise ValueError("its JSON nests deeper than Python's recursion limit") from None


def weight_map(raw: bytes, index: object) -> dict[str, str]:
    """The weight_map (tensor name -> shard file) of the index file `index` (a path or URL, for
    messages) whose bytes are `raw`: a non-empty JSON object of strings, no key twice. Local, remote
    and adapter indexes are all read by this one rule."""
    try:
        found = parse(raw, unique_keys=True)["weight_map"]
        if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
            raise TypeError
    except DuplicateKey as e:
        raise FormatError(
            f"{index}: key {e.key!r} appears more than once (JSON readers keep the last one, so tools "
            "disagree on which shard holds it); regenerate the index"
        ) from None
    except (ValueError, KeyError, TypeError):  # a list or a str indexed by a str is a TypeError
        raise FormatError(f"{index}: not a valid index (expected JSON with a 'weight_map' object)") from None
    if not found:
        raise FormatError(
            f"{index}: empty checkpoint: weight_map lists no tensors; regenerate the index from the shards"
        )
    return found
