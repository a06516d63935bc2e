"""The safetensors reader/writer: golden bytes, round trips, and property tests on corrupt headers."""

from __future__ import annotations

import errno
import json
import os
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from mergedb import writeout
from mergedb.encoding import float32_to_bf16
from mergedb.errors import FormatError, MergeDBError
from mergedb.tensorfile import DTYPES, FileRange, SafetensorsWriter, read_header


def test_writer_golden_bytes(tmp_path):
    p = tmp_path / "g.safetensors"
    with SafetensorsWriter(p, [("a", "F32", (2,)), ("b", "U8", (3,))]) as w:
        w.write("a", np.array([1.0, -2.0], np.float32))
        w.write("b", np.array([7, 8, 9], np.uint8))
    header = (
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}'
    )
    header += b" " * (-len(header) % 8)
    expected = struct.pack("<Q", len(header)) + header + np.array([1.0, -2.0], np.float32).tobytes() + bytes([7, 8, 9])
    assert p.read_bytes() == expected
    loaded = load_file(str(p))  # the reference library reads it
    assert loaded["a"].tolist() == [1.0, -2.0] and loaded["b"].tolist() == [7, 8, 9]


def test_writer_refuses_out_of_order_and_short(tmp_path):
    with pytest.raises(MergeDBError, match="out of order"):
        with SafetensorsWriter(tmp_path / "x.safetensors", [("a", "F32", (1,)), ("b", "F32", (1,))]) as w:
            w.write("b", np.zeros(1, np.float32))
    w = SafetensorsWriter(tmp_path / "y.safetensors", [("a", "F32", (1,))])
    with pytest.raises(MergeDBError, match="closed before"):
        w.close()


@pytest.mark.parametrize("in_kernel", [True, "exdev", "zero"])
def test_writer_copies_a_file_range_or_refuses_a_short_one(tmp_path, monkeypatch, in_kernel):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 40)
    if in_kernel == "exdev":  # as on file systems without an in-kernel copy between them: chunked reads and writes

        def no_copy(*a):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", no_copy)
    elif in_kernel == "zero":  # as FUSE and some overlay file systems answer "not here": 0 bytes copied
        monkeypatch.setattr(os, "copy_file_range", lambda *a: 0)
    fd = os.open(src, os.O_RDONLY)
    try:
        with SafetensorsWriter(tmp_path / "c.safetensors", [("a", "U8", (2,)), ("b", "U8", (5000,))]) as w:
            w.write("a", np.array([1, 2], np.uint8))
            w.copy("b", FileRange(fd, str(src), 3001, 5000))
        assert load_file(str(tmp_path / "c.safetensors"))["b"].tobytes() == src.read_bytes()[3001:8001]
        w = SafetensorsWriter(tmp_path / "d.safetensors", [("b", "U8", (9000,))])
        with pytest.raises(FormatError, match="src.bin: file ended"):
            w.copy("b", FileRange(fd, str(src), 3001, 9000))  # 7239 bytes left in the file
        w.abort()
    finally:
        os.close(fd)


def test_writer_starts_the_write_out_behind_what_it_wrote(tmp_path, monkeypatch):
    """Every WRITE_BEHIND bytes written (or copied) have their write-out started, one contiguous range
    after another from the file's first byte, through libc's sync_file_range (looked up here: a
    lookup that failed would silently start nothing); the file is the same bytes."""
    started = []
    real = writeout.start
    monkeypatch.setattr(writeout, "WRITE_BEHIND", 1000)
    monkeypatch.setattr(writeout, "start", lambda fd, off, n: started.append((off, n)) or real(fd, off, n))
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 20)
    rng = np.random.default_rng(1)
    a, c = rng.integers(0, 256, 700, dtype=np.uint8), rng.integers(0, 256, 2500, dtype=np.uint8)
    fd = os.open(src, os.O_RDONLY)
    try:
        p = tmp_path / "w.safetensors"
        with SafetensorsWriter(p, [("a", "U8", (700,)), ("b", "U8", (3000,)), ("c", "U8", (2500,))]) as w:
            w.write("a", a)  # 8 + header + 700 bytes: under 1000 unless the header is long
            w.copy("b", FileRange(fd, str(src), 100, 3000))
            w.write("c", c)
    finally:
        os.close(fd)
    got = load_file(str(p))
    assert got["a"].tobytes() == a.tobytes() and got["c"].tobytes() == c.tobytes()
    assert got["b"].tobytes() == src.read_bytes()[100:3100]
    size = p.stat().st_size
    assert started and started[0][0] == 0 and all(n >= 1000 for _, n in started)
    assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(started, started[1:])), started  # contiguous
    assert size - sum(n for _, n in started) < 1000  # what is left for the fsync at close
    if sys.platform.startswith("linux"):
        assert writeout._call, "libc's sync_file_range was not found"


def test_chunked_copy_survives_short_writes_across_chunks(tmp_path, monkeypatch):
    """A disk filling up makes pwrite write part of a chunk; the copy writes the rest (over two
    16 MiB chunks here) instead of leaving a hole the header says is a tensor."""
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, 17 * 2**20 + 123, dtype=np.uint8).tobytes()
    src = tmp_path / "src.bin"
    src.write_bytes(b"xyz" + payload)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: 0)
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real_pwrite(fd, bytes(data)[:777_777], off))
    fd = os.open(src, os.O_RDONLY)
    try:
        with SafetensorsWriter(tmp_path / "c.safetensors", [("b", "U8", (len(payload),))]) as w:
            w.copy("b", FileRange(fd, str(src), 3, len(payload)))
    finally:
        os.close(fd)
    assert load_file(str(tmp_path / "c.safetensors"))["b"].tobytes() == payload


def test_bf16_rounding_matches_torch():
    import torch

    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 10
    x[:4] = [np.inf, -np.inf, np.nan, 0.0]
    ours = float32_to_bf16(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = np.isfinite(x)
    assert np.array_equal(ours[finite], theirs[finite])
    assert np.array_equal(ours[:2], theirs[:2])
    assert (ours[2] & 0x7F80) == 0x7F80 and (ours[2] & 0x7F) != 0  # NaN stays NaN


_dtype = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL"])
_shape = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8).filter(lambda s: "\0" not in s and s != "__metadata__"), _dtype, _shape
        ),
        max_size=6,
        unique_by=lambda t: t[0],
    )
)
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_round_trip_random_valid_headers(tmp_path, entries):
    p = tmp_path / "r.safetensors"
    rng = np.random.default_rng(0)
    datas = []
    with SafetensorsWriter(p, [(n, d, tuple(s)) for n, d, s in entries]) as w:
        for n, d, s in entries:
            b = rng.integers(0, 256, int(np.prod(s)) * DTYPES[d][0], dtype=np.uint8).tobytes()
            datas.append(b)
            w.write(n, b)
    h = read_header(p)
    by_name = {t.name: t for t in h.tensors}
    raw = p.read_bytes()
    for (n, d, s), b in zip(entries, datas):
        t = by_name[n]
        assert (t.dtype, list(t.shape)) == (d, s)
        assert raw[t.start : t.end] == b


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("v") / "v.safetensors"
    with SafetensorsWriter(p, [("w", "F32", (4, 3)), ("b", "BF16", (3,)), ("i", "I64", (2,))], {"k": "v"}) as w:
        w.write("w", np.arange(12, dtype=np.float32))
        w.write("b", np.zeros(3, np.uint16))
        w.write("i", np.arange(2, dtype=np.int64))
    return p.read_bytes()


@given(st.data())
@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_corrupted_headers_fail_cleanly(tmp_path, valid_file, data):
    """Random byte flips, truncations and insertions: FormatError or a consistent parse, nothing else."""
    buf = bytearray(valid_file)
    n_header = struct.unpack("<Q", buf[:8])[0]
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "length"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, 8 + n_header - 1))
            buf[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf) - 1))]
    elif kind == "insert":
        i = data.draw(st.integers(8, 8 + n_header))
        buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        buf[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    p = tmp_path / "c.safetensors"
    p.write_bytes(bytes(buf))
    try:
        h = read_header(p)
    except FormatError:
        return
    # accepted: every tensor lies inside the file, tiles the data section, and matches its shape
    cursor = h.data_start
    for t in h.tensors:
        assert t.start == cursor and t.end - t.start == t.numel * DTYPES[t.dtype][0]
        cursor = t.end
    assert cursor == len(buf)


@given(
    st.dictionaries(
        st.text(max_size=5),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=4),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
            max_leaves=8,
        ),
        max_size=4,
    )
)
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_random_json_headers_fail_cleanly(tmp_path, doc):
    blob = json.dumps(doc).encode()
    p = tmp_path / "j.safetensors"
    p.write_bytes(struct.pack("<Q", len(blob)) + blob)
    try:
        h = read_header(p)
    except FormatError:
        return
    assert all(t.nbytes == 0 for t in h.tensors)


_W = '"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
_E = '"e": {{"dtype": "F32", "shape": [{}, 0], "data_offsets": [0, 0]}}'


@pytest.mark.parametrize(
    "header, words",
    [
        ('{"x\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "is not valid Unicode"),
        ("{" + _E.format(2**70) + ", " + _W + "}", "invalid shape"),
        ("{" + _E.format("9" * 5000) + ", " + _W + "}", "not valid JSON"),
        ('{"__metadata__": false, ' + _W + "}", "__metadata__ must map strings to strings"),
        ('{"__metadata__": [], ' + _W + "}", "__metadata__ must map strings to strings"),
        ('{"__metadata__": 0, ' + _W + "}", "__metadata__ must map strings to strings"),
    ],
)
def test_headers_python_accepts_but_safetensors_does_not_are_refused(tmp_path, header, words):
    """Headers that once raised a raw exception at registration (a lone surrogate in a name, a
    dimension past int64 in an empty tensor, a 5000-digit integer) or were let through (a
    __metadata__ that is false, [] or 0: safetensors takes null or an object of strings only)."""
    blob = header.encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(4))
    with pytest.raises(FormatError, match=words):
        read_header(p)


def test_pipes_and_devices_are_refused_by_name(tmp_path):
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(FormatError, match="pipe.safetensors: is a named pipe, not a regular file"):
        read_header(tmp_path / "pipe.safetensors")
    with pytest.raises(FormatError, match="/dev/zero: is a device, not a regular file"):
        read_header("/dev/zero")
