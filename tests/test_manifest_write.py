"""jsondoc.write_json and manifest.content_hash on documents with long row lists (a trim row per (expert,
tensor)): the text parses to the document, is json's own indented text where no list is long, has one
compact row per line where one is, and the hash is sha256 of json.dumps(part, sort_keys=True) written
out here; neither holds the whole text in memory."""

from __future__ import annotations

import hashlib
import json
import math
import tracemalloc

import pytest

from mergedb import jsondoc, manifest


def _rows(n: int) -> list[dict]:
    return [
        {"position": i % 7, "tensor_idx": i, "t_lo": i / 3, "t_hi": None, "rank_codes": [i, i + 1], "name": f"é{i}"}
        for i in range(n)
    ]


def _reference_hash(doc: dict) -> str:
    det = {k: v for k, v in doc.items() if k not in ("run", "content_hash")}
    return hashlib.sha256(json.dumps(det, sort_keys=True).encode()).hexdigest()


def test_short_documents_are_jsons_indented_text(tmp_path):
    docs = [
        {},
        {"a": 1},
        {"b": [], "a": {"z": [1, 2, {"q": None}], "y": "ü"}, "c": [1.5, float("nan")], "d": _rows(16)},
    ]
    for i, doc in enumerate(docs):
        path = tmp_path / f"{i}.json"
        jsondoc.write_json(path, doc)
        assert path.read_text(encoding="utf-8") == json.dumps(doc, indent=2, sort_keys=True) + "\n"


def test_long_mappings_of_strings_are_jsons_indented_text(tmp_path):
    """A hash per tensor (the manifest's tensor_hashes, the index's weight_map): an entry per line,
    as json indents them, through the C encoder."""
    doc = {"tensor_hashes": {f"layers.{i}.w\u00e9": f"{i:032x}" for i in range(5000, 0, -7)}, "n": 1}
    path = tmp_path / "h.json"
    jsondoc.write_json(path, doc)
    assert path.read_text(encoding="utf-8") == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    nested = {"m": {f"k{i}": {"rows": [i, i + 1], "b": None} for i in range(40)}}
    jsondoc.write_json(path, nested)
    assert json.loads(path.read_text(encoding="utf-8")) == nested
    assert '    "k0": {"b": null, "rows": [0, 1]},' in path.read_text(encoding="utf-8").splitlines()


def test_long_lists_have_a_compact_row_per_line(tmp_path):
    n = 2 * 1024 + 3  # more than one piece of rows
    doc = {"trims": _rows(n), "layout": [{"rows": [[0, 4]], "name": "w"}] * 17, "experts": _rows(3), "k": "v"}
    path = tmp_path / "m.json"
    jsondoc.write_json(path, doc)
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == doc
    lines = text.splitlines()
    start = lines.index('  "trims": [')
    want = [json.dumps(r, sort_keys=True) for r in doc["trims"]]
    got = [line.strip().rstrip(",") for line in lines[start + 1 : start + 1 + n]]
    assert got == want and lines[start + 1 + n] == "  ]"
    assert '  "layout": [' in lines and '    {"name": "w", "rows": [[0, 4]]},' in lines
    assert '  "experts": [' in lines and '      "position": 0,' in lines  # 3 rows: indented as json indents them


def test_content_hash_is_sha256_of_the_sorted_compact_text():
    for n in (0, 1, 1023, 1024, 1025, 3 * 1024 + 5):
        doc = {"trims": _rows(n), "run": {"seconds": 1.0}, "content_hash": "x", "plan_hash": "p", "stock": None}
        assert manifest.content_hash(doc) == _reference_hash(doc), n
    nan = {"a": [float("nan")] * 5000, "b": {"c": math.inf}}
    assert manifest.content_hash(nan) == _reference_hash(nan)


def test_neither_holds_the_whole_text(tmp_path):
    doc = {"trims": _rows(80_000), "plan_hash": "p"}
    path = tmp_path / "m.json"
    tracemalloc.start()
    try:
        jsondoc.write_json(path, doc)
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        manifest.content_hash(doc)
        _, hash_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = path.stat().st_size  # ~10 MB; json.dumps + write_text held ~2.5x that, the one-string hash ~2x
    assert size > 8_000_000
    assert write_peak < size / 4, (write_peak, size)
    assert hash_peak < size / 4, (hash_peak, size)


def test_documents_with_keys_json_would_rename_are_refused(tmp_path):
    """json.dumps writes a key 1 as "1": the piecewise writer and hash refuse such a document
    rather than produce other text (or a file that is not JSON)."""
    for doc in ({1: "a"}, {"a": 1, True: 2}):
        with pytest.raises(TypeError, match="keys must be strings"):
            jsondoc.write_json(tmp_path / "x.json", doc)
        with pytest.raises(TypeError, match="keys must be strings"):
            manifest.content_hash(doc)
