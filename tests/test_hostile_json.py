"""JSON files a user gives (indexes, configs, adapter files, an old output's manifest) that Python's
json cannot read the ordinary way: nested deeper than the recursion limit (a RecursionError, which
no reader caught) or holding an integer of more than 4,300 digits (a ValueError some readers did
not catch). Each is refused with a FormatError naming the file, or, where the file is optional
(config.json), treated as unreadable; never a traceback, and a refused registration leaves the
catalog as it was. Found by a review on 2026-12-02 (reproductions beside each case)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from mergedb import jsondoc
from mergedb.catalog import Catalog
from mergedb.checkpoint import open_checkpoint
from mergedb.errors import FormatError

DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's default recursion limit (1,000)
HUGE = "9" * 5000  # more digits than int() converts by default (4,300)


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, data, at = {}, b"", 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        data, at = data + b, at + len(b)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"layer.weight": rng.standard_normal((8, 16)), "layer.bias": rng.standard_normal(16)}


def _sharded(folder, index_text: str):
    """A checkpoint of two shards whose index is `index_text` with {WM} replaced by its weight_map."""
    folder.mkdir(parents=True)
    t = _tensors(0)
    (folder / "model-00001-of-00002.safetensors").write_bytes(_safetensors({"layer.weight": t["layer.weight"]}))
    (folder / "model-00002-of-00002.safetensors").write_bytes(_safetensors({"layer.bias": t["layer.bias"]}))
    wm = '{"layer.weight": "model-00001-of-00002.safetensors", "layer.bias": "model-00002-of-00002.safetensors"}'
    (folder / "model.safetensors.index.json").write_text(index_text.replace("{WM}", wm))
    return folder


def test_parse_raises_value_error_for_every_unreadable_text():
    for text in (DEEP, HUGE, '{"a": ', b"\xff\xfe{", '{"a": ' + DEEP + "}"):
        with pytest.raises(ValueError):
            jsondoc.parse(text)
    with pytest.raises(jsondoc.DuplicateKey):
        jsondoc.parse('{"a": 1, "a": 2}', unique_keys=True)
    assert jsondoc.parse('{"a": 1, "a": 2}') == {"a": 2}  # json's own rule where keys may repeat


@pytest.mark.parametrize(
    "index",
    [
        '{"weight_map": {WM}, "metadata": ' + DEEP + "}",
        '{"weight_map": {WM}, "metadata": {"total_size": ' + HUGE + "}}",
    ],
    ids=["deep", "huge-int"],
)
@pytest.mark.parametrize("where", ["local", "file-url"])
def test_an_unreadable_index_is_refused_by_name(tmp_path, index, where):
    folder = _sharded(tmp_path / "ck", index)
    path = str(folder) if where == "local" else f"file://{folder}"
    with pytest.raises(FormatError, match="model.safetensors.index.json: not a valid index"):
        open_checkpoint(path)


def test_a_remote_index_listing_a_tensor_twice_is_refused_as_a_local_one_is(tmp_path):
    folder = _sharded(tmp_path / "ck", '{"weight_map": {WM}}')
    index = folder / "model.safetensors.index.json"
    wm = index.read_text().removeprefix('{"weight_map": {')  # the same tensor first in the other shard
    index.write_text('{"weight_map": {"layer.bias": "model-00001-of-00002.safetensors", ' + wm)
    for path in (str(folder), f"file://{folder}"):
        with pytest.raises(FormatError, match="key 'layer.bias' appears more than once"):
            open_checkpoint(path)


@pytest.mark.parametrize("where", ["local", "file-url"])
def test_an_unreadable_config_is_taken_as_absent(tmp_path, where):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(_safetensors(_tensors(0)))
    (folder / "config.json").write_text('{"architectures": ["X"], "vocab_size": 8, "deep": ' + DEEP + "}")
    ck = open_checkpoint(str(folder) if where == "local" else f"file://{folder}")
    assert (ck.architecture, ck.vocab_size) == (None, None)
    (folder / "config.json").write_text('{"architectures": ["X"], "vocab_size": 8}')  # the probe: read when readable
    assert open_checkpoint(str(folder)).architecture == "X"


@pytest.mark.parametrize("bad", ["config-deep", "config-huge", "index-deep", "index-huge"])
def test_an_unreadable_adapter_file_is_refused_and_the_catalog_kept(tmp_path, bad):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(_safetensors(_tensors(0)))
    db = tmp_path / "c.duckdb"
    Catalog(db).register([base], base=True)
    rng = np.random.default_rng(1)
    factors = {
        "base_model.model.layer.lora_A.weight": rng.standard_normal((2, 16)),
        "base_model.model.layer.lora_B.weight": rng.standard_normal((8, 2)),
    }
    cfg = json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["layer"]})
    ad = tmp_path / "adapter"
    ad.mkdir()
    if bad.startswith("index"):
        (ad / "adapter_model-00001-of-00001.safetensors").write_bytes(_safetensors(factors))
        wm = {k: "adapter_model-00001-of-00001.safetensors" for k in factors}
        extra = DEEP if bad == "index-deep" else HUGE
        (ad / "adapter_model.safetensors.index.json").write_text(f'{{"weight_map": {json.dumps(wm)}, "x": {extra}}}')
    else:
        (ad / "adapter_model.safetensors").write_bytes(_safetensors(factors))
        cfg = cfg[:-1] + f', "x": {DEEP if bad == "config-deep" else HUGE}}}'
    (ad / "adapter_config.json").write_text(cfg)
    before = Catalog(db).sql("SELECT name FROM checkpoints ORDER BY name").to_pylist()
    what = "not a valid index" if bad.startswith("index") else "not a valid adapter config"
    with pytest.raises(FormatError, match=what):
        Catalog(db).register([ad], base_model="base")
    assert Catalog(db).sql("SELECT name FROM checkpoints ORDER BY name").to_pylist() == before == [{"name": "base"}]


def test_a_shard_whose_name_starts_with_two_dots_is_a_file_inside(tmp_path):
    """The remote index check refused any shard name starting with '..' as leaving the folder, so a
    shard named '..a.safetensors' (a file inside it) registered locally but not as file:// (review)."""
    folder = _sharded(tmp_path / "ck", '{"weight_map": {WM}}')
    os.rename(folder / "model-00001-of-00002.safetensors", folder / "..a.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("model-00001-of-00002.safetensors", "..a.safetensors"))
    local, url = open_checkpoint(str(folder)), open_checkpoint(f"file://{folder}")
    assert [t.name for _, t in url.tensors] == [t.name for _, t in local.tensors]
    index.write_text(index.read_text().replace("..a.safetensors", "../ck/..a.safetensors"))
    with pytest.raises(FormatError, match="outside the checkpoint folder"):
        open_checkpoint(f"file://{folder}")
