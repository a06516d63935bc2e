"""Parity with the safetensors format: every upstream dtype (packed sub-byte ones included), the
header-size limit, duplicate keys; and what a checkpoint folder means (side files, ambiguous and
empty folders)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.checkpoint import open_checkpoint
from mergedb.errors import FormatError, MergeDBError
from mergedb.planner import PlanRequest
from mergedb.sidefiles import side_files
from mergedb.tensorfile import DTYPE_BITS, MAX_HEADER_BYTES, SafetensorsWriter, read_header, tensor_nbytes

# Bits per element, written out for the test from the safetensors specification (not from mergedb).
SPEC_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "C64": 64,
}


def st_bytes(entries: dict, data: bytes = b"", pad: int = 0, raw_header: bytes | None = None) -> bytes:
    """A safetensors file built by hand: 8-byte LE header length, JSON header, data."""
    header = raw_header if raw_header is not None else json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * pad
    return struct.pack("<Q", len(header)) + header + data


def write(path: Path, entries: dict, data: bytes = b"", **kw) -> Path:
    path.write_bytes(st_bytes(entries, data, **kw))
    return path


def upstream_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
        return True
    except Exception:
        return False


# --- dtypes ---------------------------------------------------------------------------------------


def test_dtype_table_matches_upstream_enum(tmp_path):
    """The installed safetensors names its whole Dtype enum when it meets an unknown dtype."""
    p = write(tmp_path / "x.safetensors", {"t": {"dtype": "NOPE", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(Exception) as e:
        with safe_open(str(p), "pt") as f:
            f.keys()
    listed = re.findall(r"`([A-Z0-9_]+)`", str(e.value).split("expected one of", 1)[-1])
    if not listed:
        pytest.skip(f"upstream's message no longer lists its dtypes: {e.value}")
    assert set(listed) == set(DTYPE_BITS) == set(SPEC_BITS)
    assert all(DTYPE_BITS[d] == SPEC_BITS[d] for d in SPEC_BITS)


@pytest.mark.parametrize("dtype", sorted(SPEC_BITS))
def test_every_dtype_is_read_with_its_byte_size(tmp_path, dtype):
    shape = [2, 4]  # 8 elements: whole bytes for 4- and 6-bit dtypes too
    nbytes = SPEC_BITS[dtype]  # 8 elements * bits / 8
    entries = {
        "x": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]},
        "y": {"dtype": "U8", "shape": [3], "data_offsets": [nbytes, nbytes + 3]},
    }
    data = bytes(range(nbytes)) + b"abc"
    p = write(tmp_path / "d.safetensors", entries, data)
    h = read_header(p)
    x, y = h.tensors
    assert (x.name, x.dtype, x.shape, x.nbytes, x.bits) == ("x", dtype, (2, 4), nbytes, SPEC_BITS[dtype])
    assert (x.start, x.end, y.start) == (h.data_start, h.data_start + nbytes, h.data_start + nbytes)
    assert p.read_bytes()[x.start : x.end] == bytes(range(nbytes))
    assert tensor_nbytes(dtype, shape) == nbytes
    assert x.is_float == (dtype in ("BF16", "F16", "F32"))  # everything else passes through
    assert upstream_accepts(p)


@pytest.mark.parametrize(
    "dtype,shape,nbytes",
    [
        ("F4", [2], 1),
        ("F4", [3, 2], 3),
        ("F6_E2M3", [4], 3),
        ("F6_E3M2", [2, 4], 6),
        ("F4", [0, 5], 0),
        ("F4", [], None),
    ],
)
def test_packed_sizes(dtype, shape, nbytes):
    if nbytes is None:  # a scalar F4 is half a byte
        with pytest.raises(FormatError, match="whole number of bytes"):
            tensor_nbytes(dtype, shape)
    else:
        assert tensor_nbytes(dtype, shape) == nbytes


@pytest.mark.parametrize("dtype,shape", [("F4", [3]), ("F6_E2M3", [2]), ("F6_E3M2", [1, 3])])
def test_packed_tensor_of_fractional_bytes_is_refused(tmp_path, dtype, shape):
    bits = int(np.prod(shape)) * SPEC_BITS[dtype]
    for claimed in (bits // 8, bits // 8 + 1):  # the byte count rounded down, and up
        entries = {"w.q": {"dtype": dtype, "shape": shape, "data_offsets": [0, claimed]}}
        p = write(tmp_path / "f.safetensors", entries, b"\0" * claimed)
        with pytest.raises(FormatError) as e:
            read_header(p)
        msg = str(e.value)
        assert str(p) in msg and "'w.q'" in msg and "whole number of bytes" in msg
        assert not upstream_accepts(p)


def test_unknown_dtype_is_refused_by_name(tmp_path):
    p = write(tmp_path / "u.safetensors", {"w": {"dtype": "F8_E4M3FN", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(FormatError, match=r"'w' has unknown dtype 'F8_E4M3FN'; known: .*F8_E4M3"):
        read_header(p)
    with pytest.raises(FormatError, match="unknown dtype 'Q3'"):
        tensor_nbytes("Q3", (1,))
    p = write(tmp_path / "l.safetensors", {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(FormatError, match="unknown dtype"):
        read_header(p)


def test_row_bytes_of_packed_tensors(tmp_path):
    entries = {
        "aligned": {"dtype": "F4", "shape": [4, 8], "data_offsets": [0, 16]},  # rows of 4 bytes
        "odd": {"dtype": "F4", "shape": [2, 3], "data_offsets": [16, 19]},  # rows of 1.5 bytes
        "six": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [19, 22]},
        "bf": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [22, 52]},
        "f8": {"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [52, 58]},
    }
    t = {x.name: x for x in read_header(write(tmp_path / "r.safetensors", entries, b"\0" * 58)).tensors}
    assert (t["aligned"].rows_aligned, t["aligned"].row_bytes) == (True, 4)
    assert (t["odd"].rows_aligned, t["odd"].row_bytes, t["odd"].nbytes) == (False, 3, 3)  # one block
    assert (t["six"].rows_aligned, t["six"].row_bytes) == (True, 3)
    assert (t["bf"].row_bytes, t["bf"].itemsize, t["f8"].row_bytes) == (10, 2, 3)


def test_writer_writes_packed_dtypes_golden_bytes(tmp_path):
    p = tmp_path / "w.safetensors"
    with SafetensorsWriter(p, [("p", "F4", (2, 4)), ("e", "F8_E8M0", (2,))]) as w:
        w.write("p", bytes([0x12, 0x34, 0x56, 0x78]))
        w.write("e", bytes([127, 128]))
    header = (
        b'{"p":{"dtype":"F4","shape":[2,4],"data_offsets":[0,4]},'
        b'"e":{"dtype":"F8_E8M0","shape":[2],"data_offsets":[4,6]}}'
    )
    header += b" " * (-len(header) % 8)
    assert p.read_bytes() == struct.pack("<Q", len(header)) + header + bytes([0x12, 0x34, 0x56, 0x78, 127, 128])
    assert upstream_accepts(p)
    with pytest.raises(MergeDBError, match="cannot write tensor 'h'.*whole number of bytes"):
        SafetensorsWriter(tmp_path / "h.safetensors", [("h", "F4", (3,))])


# --- header limit, duplicate keys -------------------------------------------------------------------


def test_header_exactly_at_the_limit_and_one_byte_over(tmp_path):
    assert MAX_HEADER_BYTES == 100_000_000  # upstream's MAX_HEADER_SIZE
    entry = b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    at = write(tmp_path / "at.safetensors", {}, b"\x07\x08", raw_header=entry, pad=MAX_HEADER_BYTES - len(entry))
    h = read_header(at)
    assert h.header_len == MAX_HEADER_BYTES and [t.name for t in h.tensors] == ["w"]
    assert at.read_bytes()[h.tensors[0].start :] == b"\x07\x08"
    assert upstream_accepts(at)
    at.unlink()
    over = write(
        tmp_path / "over.safetensors", {}, b"\x07\x08", raw_header=entry, pad=MAX_HEADER_BYTES + 1 - len(entry)
    )
    with pytest.raises(FormatError) as e:
        read_header(over)
    assert str(over) in str(e.value) and f"header length {MAX_HEADER_BYTES + 1} exceeds" in str(e.value)
    assert not upstream_accepts(over)


def test_duplicate_tensor_key_is_refused(tmp_path):
    raw = (
        b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"layers.0.q":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},'
        b'"layers.0.q":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}'
    )
    p = write(tmp_path / "dup.safetensors", {}, b"\0\0", raw_header=raw)
    assert upstream_accepts(p)  # upstream silently keeps one of them: the reason to refuse
    with pytest.raises(FormatError) as e:
        read_header(p)
    msg = str(e.value)
    assert str(p) in msg and "'layers.0.q' appears more than once" in msg and "re-export" in msg


def test_duplicate_key_inside_an_entry_or_metadata_is_refused(tmp_path):
    raw = b'{"w":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    with pytest.raises(FormatError, match="'dtype' appears more than once"):
        read_header(write(tmp_path / "a.safetensors", {}, b"\0", raw_header=raw))
    raw = b'{"__metadata__":{"format":"pt","format":"np"},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    with pytest.raises(FormatError, match="'format' appears more than once"):
        read_header(write(tmp_path / "b.safetensors", {}, b"\0", raw_header=raw))


# --- pass-through of exotic dtypes, end to end ------------------------------------------------------

PASS_THROUGH = [  # (name, dtype, shape, nbytes)
    ("model.layers.0.mlp.q8", "F8_E4M3", (8, 16), 128),
    ("model.layers.0.mlp.q8_e5", "F8_E5M2", (4, 4), 16),
    ("model.layers.0.mlp.scale", "F8_E8M0", (8,), 8),
    ("model.layers.0.mlp.q4", "F4", (8, 16), 64),  # rows of 8 bytes: byte-aligned
    ("model.layers.0.mlp.q4_odd", "F4", (2, 3), 3),  # rows of 1.5 bytes: one block
    ("model.layers.0.mlp.q6", "F6_E2M3", (4, 4), 12),
    ("model.layers.0.mlp.c", "C64", (2,), 16),
    ("model.layers.0.mlp.f64", "F64", (3,), 24),
]
FLOATS = [("model.embed.weight", "F32", (16, 8)), ("model.norm.weight", "BF16", (8,))]


def _model(folder: Path, seed: int) -> dict[str, bytes]:
    """A model of FLOATS (random) and PASS_THROUGH tensors (random bytes, different per model)."""
    rng = np.random.default_rng(seed)
    raw: dict[str, bytes] = {}
    for name, dt, shape in FLOATS:
        x = rng.standard_normal(shape).astype(np.float32)
        raw[name] = x.tobytes() if dt == "F32" else (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    for name, _, _, nbytes in PASS_THROUGH:
        raw[name] = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    folder.mkdir(parents=True)
    specs = FLOATS + [(n, dt, s) for n, dt, s, _ in PASS_THROUGH]
    with SafetensorsWriter(folder / "model.safetensors", specs) as w:
        for name, _, _ in specs:
            w.write(name, raw[name])
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return raw


@pytest.mark.parametrize("block_size", ["64", "4MiB"])  # many blocks per tensor vs one
def test_exotic_dtypes_pass_through_byte_exact(tmp_path, block_size):
    fam = tmp_path / "fam"
    base = _model(fam / "base", 1)
    expert = _model(fam / "expert", 2)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size=block_size)
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all"))
    out = tmp_path / "out"
    executor.execute(cat.execution_plan(plan.plan_id), out)
    h, data = read_header(out / "model.safetensors"), (out / "model.safetensors").read_bytes()
    got = {t.name: data[t.start : t.end] for t in h.tensors}
    assert upstream_accepts(out / "model.safetensors")
    assert {t.name: t.dtype for t in h.tensors} == {n: dt for n, dt, *_ in FLOATS + PASS_THROUGH}
    for name, _, _, _ in PASS_THROUGH:
        assert got[name] == base[name] != expert[name], name  # the base's bytes, never merged
    # the float tensors are merged: base + 1.0 * (expert - base) in float32, rounded by torch to the
    # tensor's dtype (torch cannot load the F4 [2, 3] tensor, so the output is decoded here by hand)
    import torch

    tdt = {"F32": torch.float32, "BF16": torch.bfloat16}
    for name, dt, _ in FLOATS:
        b, e = (torch.frombuffer(bytearray(m[name]), dtype=tdt[dt]).float() for m in (base, expert))
        want = (b + (e - b)).to(tdt[dt])
        assert torch.equal(torch.frombuffer(bytearray(got[name]), dtype=tdt[dt]), want), name
    assert (out / "config.json").is_file()


# --- checkpoint folders ------------------------------------------------------------------------------


def _tiny(path: Path, name: str = "w", value: float = 1.0) -> Path:
    with SafetensorsWriter(path, [(name, "F32", (2,))]) as w:
        w.write(name, np.full(2, value, np.float32))
    return path


def test_side_files_are_an_allow_list(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    _tiny(home / "weights.safetensors")
    for name in ("id_rsa", "passwords.txt", "pytorch_model.bin", "model.pt", "optimizer.pth", "train.ckpt", "x.pkl"):
        (home / name).write_bytes(b"secret")
    (home / "video.mp4").write_bytes(b"\0" * 10)
    (home / ".env").write_text("TOKEN=1")
    (home / "README.md").write_text("# the base model's card")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (home / "config.json").symlink_to(outside)  # resolves outside the checkpoint folder
    (home / "generation_config.json").symlink_to("/etc/hostname")
    (home / "tokenizer.json").symlink_to(home / "missing.json")  # dangling
    (home / "vocab.txt").mkdir()  # not a regular file
    (home / "tokenizer_config.json").write_text("{}")
    (home / "merges.txt").write_text("a b")
    (home / "real_special.json").write_text("{}")
    (home / "special_tokens_map.json").symlink_to("real_special.json")  # a link inside the folder is fine
    ckpt = open_checkpoint(home / "weights.safetensors")
    assert ckpt.root == home
    assert side_files(ckpt.root) == ["merges.txt", "special_tokens_map.json", "tokenizer_config.json"]


def test_side_files_of_a_model_folder(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    _tiny(m / "model.safetensors")
    names = ["config.json", "generation_config.json", "tokenizer.model", "chat_template.jinja", "LICENSE"]
    for n in names + ["model.safetensors.index.json", "training_args.bin", "trainer_state.json"]:
        (m / n).write_text("{}")
    assert side_files(m) == sorted(names)


def test_single_file_wins_over_a_stale_index(tmp_path):
    """transformers loads model.safetensors when both it and an index are present; so do we."""
    m = tmp_path / "m"
    m.mkdir()
    _tiny(m / "model.safetensors", "fresh", 2.0)
    _tiny(m / "model-00001-of-00001.safetensors", "stale")
    (m / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"stale": "model-00001-of-00001.safetensors"}})
    )
    ckpt = open_checkpoint(m)
    assert [f.relpath for f in ckpt.files] == ["model.safetensors"]
    assert [t.name for _, t in ckpt.tensors] == ["fresh"]
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([m], base=True)
    assert [r.n_tensors for r in cat.checkpoints()] == [1]


def test_index_with_empty_weight_map_is_refused(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    _tiny(m / "model-00001-of-00001.safetensors")
    (m / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(FormatError) as e:
        open_checkpoint(m)
    assert "model.safetensors.index.json" in str(e.value) and "empty checkpoint" in str(e.value)


@pytest.mark.parametrize("layout", ["folder", "file"])
def test_checkpoint_without_tensors_is_refused(tmp_path, layout):
    m = tmp_path / "m"
    m.mkdir()
    p = write(m / "model.safetensors", {"__metadata__": {"format": "pt"}})
    assert read_header(p).tensors == ()  # a valid file, but nothing to merge
    with pytest.raises(FormatError) as e:
        open_checkpoint(m if layout == "folder" else p)
    assert "empty checkpoint" in str(e.value) and "model.safetensors" in str(e.value)
    with pytest.raises(MergeDBError, match="empty checkpoint"):
        Catalog(tmp_path / "c.duckdb").register([m], base=True)


def test_checkpoint_dtype_label(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    specs = [("q", "F8_E4M3", (64,)), ("s", "BF16", (4,)), ("i", "I64", (16,))]
    with SafetensorsWriter(m / "model.safetensors", specs) as w:
        for n, dt, s in specs:
            w.write(n, bytes(tensor_nbytes(dt, s)))
    assert open_checkpoint(m).dtype == "F8_E4M3"  # the floats' majority, not the 128-byte I64 buffer
    ints = tmp_path / "ints.safetensors"
    with SafetensorsWriter(ints, [("a", "I64", (2,)), ("b", "U8", (4,))]) as w:
        w.write("a", bytes(16))
        w.write("b", bytes(4))
    assert open_checkpoint(ints).dtype == "I64"


def test_hf_cache_style_links_are_not_followed_out(tmp_path):
    """Symlinked side files are copied only when they resolve inside the checkpoint folder."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_text("{}")
    snap = tmp_path / "snap"
    snap.mkdir()
    _tiny(snap / "model.safetensors")
    os.symlink(blobs / "abc", snap / "config.json")
    assert side_files(snap) == []


def test_hub_cache_snapshot_links_into_its_own_blobs_only(tmp_path):
    """In the hub cache's layout (models--ORG--NAME/snapshots/REV/* -> ../../blobs/SHA) a side file may
    link into its own repository's blobs/, not into another repository's, nor out of the cache."""
    repo, other = tmp_path / "models--org--m", tmp_path / "models--org--other"
    for r in (repo, other):
        (r / "blobs").mkdir(parents=True)
        (r / "blobs" / "sha1").write_text("{}")
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    _tiny(snap / "model.safetensors")
    (snap / "config.json").symlink_to("../../blobs/sha1")
    (snap / "tokenizer.json").symlink_to(other / "blobs" / "sha1")
    (snap / "generation_config.json").symlink_to("/etc/hostname")
    assert side_files(snap) == ["config.json"]


def _hub_snapshot(src, repo):
    """`src`'s files as the hub cache lays them out: repo/snapshots/rev1/NAME -> ../../blobs/SHA."""
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copy(p, repo / "blobs" / sha)
        (snap / p.name).symlink_to(f"../../blobs/{sha}")
    return snap


@pytest.mark.parametrize("where", ["local", "file-url"])
def test_a_sharded_hub_cache_snapshot_registers_and_links_out_are_refused(tmp_path, where):
    """A sharded model in the hub cache (shards linking to ../../blobs/SHA) was refused as "outside the
    checkpoint folder", though a single-file snapshot registered (review, 2026-12-02): shards follow the
    side files' rule, inside the folder or its repository's own blobs/. A shard linking anywhere else is
    refused, now as a file:// URL too (it was registered)."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=5, shard_size=500_000)
    snap = _hub_snapshot(fam / "base", tmp_path / "hub" / "models--org--base")
    name = lambda p: str(p) if where == "local" else f"file://{p}"  # noqa: E731
    ck = open_checkpoint(name(snap))
    assert len(ck.files) > 1 and ck.architecture is not None
    assert [t.name for _, t in ck.tensors] == [t.name for _, t in open_checkpoint(fam / "base").tensors]
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([name(snap)], base=True, name="snap")
    shard = sorted(p for p in snap.iterdir() if p.name.startswith("model-"))[0]
    outside = tmp_path / "elsewhere" / "x.safetensors"
    outside.parent.mkdir()
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(FormatError, match="outside the checkpoint folder"):
        open_checkpoint(name(snap))
    shard.unlink()
    shard.symlink_to(fam / "base" / shard.name)  # another folder with the same bytes: outside too
    with pytest.raises(FormatError, match="outside the checkpoint folder"):
        open_checkpoint(name(snap))


@pytest.mark.parametrize("where", ["local", "file-url"])
def test_a_config_linking_out_of_the_folder_is_not_read(tmp_path, where):
    """config.json beside the weights is read for the architecture, vocabulary size and tied head;
    one that links out of the folder was read and stored (review, 2026-12-02): it counts as none now,
    as it does for the side files, which never copied it."""
    name = lambda p: str(p) if where == "local" else f"file://{p}"  # noqa: E731
    single = tmp_path / "single"
    single.mkdir()
    _tiny(single / "model.safetensors")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text('{"architectures": ["FromOutside"], "vocab_size": 7}')
    (single / "config.json").symlink_to(tmp_path / "elsewhere" / "config.json")
    assert open_checkpoint(name(single)).architecture is None
    (single / "config.json").unlink()
    shutil.copy(tmp_path / "elsewhere" / "config.json", single / "config.json")  # the probe: a file of its own
    assert open_checkpoint(name(single)).architecture == "FromOutside"


def test_tokenizer_and_processor_files_reach_the_output(tmp_path):
    """Tokenizer and processor files real models ship beyond the classic names (Mistral's tekken.json
    and tokenizer.model.v3, Qwen's qwen.tiktoken, Kimi's tiktoken.model, ChatGLM's ice_text.model,
    DeBERTa's spm.model, Marian's source.spm/target.spm, Whisper's normalizer.json, multimodal processor
    configs) are copied; other files beside them are not."""
    fam = tmp_path / "fam"
    _model(fam / "base", 1)
    _model(fam / "expert", 2)
    names = ["tekken.json", "tokenizer.model.v3", "tokenizer.model.v7", "qwen.tiktoken", "tiktoken.model", "spm.model",
             "source.spm", "target.spm", "normalizer.json", "processor_config.json",
             "video_preprocessor_config.json", "ice_text.model"]  # fmt: skip
    for n in names + ["tokenizer.model.bak", "notes.py", "optimizer.pt", "tokenizer.model.v3.lock"]:
        (fam / "base" / n).write_text("{}")
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all"))
    out = tmp_path / "out"
    executor.execute(cat.execution_plan(plan.plan_id), out)
    copied = {p.name for p in out.iterdir()} - {"model.safetensors", "mergedb_manifest.json", "mask.parquet"}
    assert copied == {"config.json", *names}


def test_an_index_checks_each_shard_once_not_each_tensor(tmp_path, monkeypatch):
    """A sharded checkpoint's index names every tensor's shard; each shard was resolved twice per
    tensor naming it (a 20k-tensor, 200-shard index: 1.1 s per open, paid by each of a plan's K + 1
    checkpoints at register and execute). Each distinct shard is resolved once now; the refusals
    still name the first tensor that points at a bad shard."""
    from mergedb import checkpoint

    m = tmp_path / "m"
    m.mkdir()
    _tiny(m / "a.safetensors")
    weight_map = {f"t{i}": "a.safetensors" for i in range(50)}
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    calls = []
    real = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    assert checkpoint._shards_from_index(m) == ["a.safetensors"]
    assert len(calls) <= 2, len(calls)  # the folder and the one shard (50 tensors name it)
    monkeypatch.undo()
    weight_map.update({"t50": "../outside.safetensors", "t51": "../outside.safetensors", "t52": "gone.safetensors"})
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="tensor 't50' points to '../outside.safetensors', outside the checkpoint"):
        checkpoint._shards_from_index(m)
    del weight_map["t50"], weight_map["t51"]
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FormatError, match="tensor 't52' points to missing shard 'gone.safetensors'"):
        checkpoint._shards_from_index(m)


def test_one_shard_named_two_ways_in_the_index_is_one_shard(tmp_path):
    """weight_map naming s1.safetensors for some tensors and ./s1.safetensors for others: the file was
    opened twice and refused as "a tensor in two shards; remove one copy" (review, 2026-12-03)."""
    from safetensors.numpy import save_file

    from mergedb.checkpoint import open_checkpoint

    save_file({n: np.ones((2, 2), np.float32) for n in ("a.weight", "b.weight")}, str(tmp_path / "s1.safetensors"))
    save_file({"c.weight": np.ones((2, 2), np.float32)}, str(tmp_path / "s2.safetensors"))
    weight_map = {"a.weight": "s1.safetensors", "b.weight": "./s1.safetensors", "c.weight": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = open_checkpoint(tmp_path)
    assert sorted(t.name for _, t in ckpt.tensors) == ["a.weight", "b.weight", "c.weight"]
    assert [f.relpath for f in ckpt.files] == ["s1.safetensors", "s2.safetensors"]
