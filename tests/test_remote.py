"""Checkpoints behind URLs: a local HTTP server with Range support and a local S3 (moto), each
logging every request on the server side. A 25% plan over remote checkpoints writes the same bytes
as the same plan over the local files, and fetches only the planned ranges (plus headers and at
most one coalescing gap per range); credentials never reach the catalog or the manifest; a
replaced remote file is refused at execution.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from mergedb import executor, remote, synth
from mergedb.catalog import Catalog
from mergedb.errors import ChangedFileError, MergeDBError
from mergedb.manifest import ExecutionPlan
from mergedb.planner import PlanRequest

fsspec = pytest.importorskip("fsspec", reason="remote checkpoints need fsspec: pip install 'mergedb[remote]'")

GAP = 4096  # MERGEDB_REMOTE_GAP for these runs
BLOCK = "16KiB"
REQUEST = PlanRequest(base="base", experts=None, method="ties", budget="25%", params={"density": 0.5})
EXPERTS = ["expert_00", "expert_01", "expert_02"]


@dataclass(frozen=True)
class Logged:
    """One request as the server saw it: method, file (relative path), byte range sent, body bytes."""

    method: str
    path: str
    start: int
    end: int
    body: int


class RangeServer:
    """http.server serving a folder with HEAD, GET and single-range GET (206), ETag and
    Last-Modified; every request is appended to `log`."""

    def __init__(self, root: Path, versions: bool = True) -> None:
        self.root, self.log, self.lock = root, [], threading.Lock()
        self.fail_data = False  # answer 500 to every read of tensor data (a server failing mid-run)
        self.shift = 0  # answer a range of tensor data with the bytes this much further on (a lying server)
        self.flaky: list[int | str | tuple[int, str]] = []  # the next reads of tensor data fail thus, one
        # each: a status, (status, Retry-After), or "drop"
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self, head: bool) -> None:
                rel = unquote(urlsplit(self.path).path).lstrip("/")
                path = server.root / rel
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    server.record(Logged(self.command, rel, 0, 0, 0))
                    return
                st = path.stat()
                lo, hi, status = 0, st.st_size, 200
                rng = self.headers.get("Range")
                if rng and not head:
                    a, _, b = rng.removeprefix("bytes=").partition("-")
                    lo, hi, status = int(a), min(int(b) + 1 if b else st.st_size, st.st_size), 206
                    data = rel.endswith(".safetensors") and lo >= _data_start(path)
                    with server.lock:
                        fault = server.flaky.pop(0) if data and server.flaky else None
                    if fault == "drop":  # the connection closed without an answer
                        server.record(Logged(self.command, rel, lo, hi, 0))
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if server.fail_data and data or fault is not None:
                        server.record(Logged(self.command, rel, lo, hi, 0))  # the range asked for
                        status, wait = fault if isinstance(fault, tuple) else (fault, None)
                        self.send_response(int(status or 500))
                        if wait is not None:
                            self.send_header("Retry-After", wait)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    elif server.shift and rel.endswith(".safetensors") and lo >= _data_start(path):
                        n = hi - lo  # same length, other bytes, and an honest Content-Range saying so
                        lo = min(lo + server.shift, st.st_size - n)
                        hi = lo + n
                self.send_response(status)
                self.send_header("Content-Length", str(hi - lo))
                self.send_header("Accept-Ranges", "bytes")
                if versions:
                    self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
                    self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{st.st_size}")
                self.end_headers()
                body = b""
                if not head:
                    with open(path, "rb") as f:
                        f.seek(lo)
                        body = f.read(hi - lo)
                    self.wfile.write(body)
                server.record(Logged(self.command, rel, lo, hi, len(body)))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def record(self, entry: Logged) -> None:
        with self.lock:
            self.log.append(entry)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class LoggingProxy:
    """A reverse proxy in front of `upstream` that logs each request's method, object key, the byte
    range it asked for and the body bytes it got back (the S3 server's side of the reads)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.log, self.lock = [], threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                conn = http.client.HTTPConnection(*upstream)
                conn.request(self.command, self.path, body, {k: v for k, v in self.headers.items()})
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():  # a HEAD keeps the object's Content-Length
                    if k.lower() not in ("transfer-encoding", "connection") and (
                        k.lower() != "content-length" or self.command == "HEAD"
                    ):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()
                lo = hi = 0
                rng = self.headers.get("Range")
                if rng:
                    a, _, b = rng.removeprefix("bytes=").partition("-")
                    lo, hi = int(a), int(b) + 1
                key = unquote(urlsplit(self.path).path).lstrip("/")
                with proxy.lock:
                    proxy.log.append(Logged(self.command, key, lo, hi, 0 if self.command == "HEAD" else len(data)))

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begins: 8 + the header length it declares."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _header_entries(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> absolute [start, end) in the file, from its JSON header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        doc = json.loads(f.read(n))
    return {
        k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in doc.items() if k != "__metadata__"
    }


def _planned_ranges(family: Path, xp) -> dict[str, list[tuple[int, int]]]:
    """Relative file path -> byte ranges the plan needs: every tensor of the base, and each selected
    (expert, block): rows [r0, r1) of the tensor, at row bytes = tensor bytes / rows."""
    where: dict[tuple[str, str], tuple[str, int, int]] = {}
    for ckpt in ["base", *EXPERTS]:
        for f in sorted((family / ckpt).glob("*.safetensors")):
            for name, (s, e) in _header_entries(f).items():
                where[ckpt, name] = (f"{ckpt}/{f.name}", s, e)
    out: dict[str, list[tuple[int, int]]] = {}
    for t in xp.tensors:
        rel, s, e = where["base", t.name]
        out.setdefault(rel, []).append((s, e))
    cols = [xp.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx")]
    for pos, ti, b in zip(*cols):
        t = xp.tensors[ti]
        rel, s, e = where[xp.experts[pos].name, t.name]
        r0, r1 = t.rows[b]
        rows = t.shape[0] if len(t.shape) >= 2 else 1
        rb = (e - s) // rows
        out.setdefault(rel, []).append((s + r0 * rb, s + r1 * rb) if len(t.rows) > 1 else (s, e))
    return {k: sorted(v) for k, v in out.items()}


def _check_fetches(family: Path, xp, log: list[Logged]) -> int:
    """Every GET of tensor data covers planned ranges only, separated by gaps of at most GAP, and
    starts and ends on a planned range; header reads stay in the header; in total, data bytes ≤
    planned bytes + one GAP per planned range. Returns the data bytes fetched."""
    planned = _planned_ranges(family, xp)
    fetched = 0
    for rel in {e.path for e in log if e.path.endswith(".safetensors")}:
        ds = _data_start(family / rel)
        gets = [e for e in log if e.path == rel and e.method == "GET"]
        for e in gets:
            assert e.body == e.end - e.start, e  # every GET was a range request, answered in full
            if e.start < ds:
                assert e.end <= ds, f"{rel}: a header read ran into the data: {e}"
        data = [e for e in gets if e.start >= ds]
        ranges = planned.get(rel, [])
        for e in data:
            inside = [(s, t) for s, t in ranges if e.start <= s and t <= e.end]
            assert inside and inside[0][0] == e.start and inside[-1][1] == e.end, f"{rel}: unplanned fetch {e}"
            gaps = [b - a for (_, a), (b, _) in zip(inside, inside[1:]) if b > a]
            assert all(g <= GAP for g in gaps), (rel, e, gaps)
        got = sum(e.body for e in data)
        assert got <= sum(t - s for s, t in ranges) + GAP * len(ranges), rel
        for s, t in ranges:  # and every planned range was fetched
            assert any(e.start <= s and t <= e.end for e in data), (rel, s, t)
        fetched += got
    return fetched


def _selected(xp) -> list[tuple[int, int, int]]:
    return sorted(zip(*(xp.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx"))))


def _same_outputs(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.name != "mergedb_manifest.json")
    assert names == sorted(p.name for p in b.iterdir() if p.name != "mergedb_manifest.json")
    assert any(n.endswith(".safetensors") for n in names) and "config.json" in names
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.fixture
def sharded_family(tmp_path) -> Path:
    return synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=11, shard_size=700_000)


@pytest.fixture
def http_server(sharded_family):
    srv = RangeServer(sharded_family)
    yield srv
    srv.close()


def test_http_registration_and_plan_fetch_only_planned_ranges(sharded_family, http_server, tmp_path, monkeypatch):
    monkeypatch.setenv("MERGEDB_REMOTE_GAP", str(GAP))
    index = "model.safetensors.index.json"
    local, far = Catalog(tmp_path / "local.duckdb"), Catalog(tmp_path / "remote.duckdb")
    local.register([sharded_family / "base"], base=True, block_size=BLOCK)
    local.register([sharded_family / e for e in EXPERTS], base_model="base")
    far.register([f"{http_server.url}/base/{index}"], base=True, block_size=BLOCK)
    http_server.log.clear()
    far.register([f"{http_server.url}/{e}/{index}" for e in EXPERTS], base_model="base")
    # registration streamed each expert file once and the base once (plus headers)
    for rel in {e.path for e in http_server.log if e.path.endswith(".safetensors")}:
        ds, size = _data_start(sharded_family / rel), (sharded_family / rel).stat().st_size
        assert sum(e.body for e in http_server.log if e.path == rel and e.start >= ds) == size - ds, rel

    lp, rp = local.plan(REQUEST), far.plan(REQUEST)
    lx, rx = local.execution_plan(lp.plan_id), far.execution_plan(rp.plan_id)
    assert _selected(lx) == _selected(rx)  # the same statistics, so the same plan
    assert 0 < rp.selected_bytes <= rp.budget_bytes
    http_server.log.clear()
    remote_run = executor.execute(rx, tmp_path / "out-remote")
    local_run = executor.execute(lx, tmp_path / "out-local")
    _same_outputs(tmp_path / "out-remote", tmp_path / "out-local")
    fetched = _check_fetches(sharded_family, rx, http_server.log)
    assert remote_run.expert_bytes == local_run.expert_bytes <= rp.budget_bytes  # the logical count
    doc = json.loads((tmp_path / "out-remote" / "mergedb_manifest.json").read_text())
    assert doc["run"]["remote_bytes_fetched"] == fetched  # the client's count is the server's
    replayed = executor.replay(tmp_path / "out-remote" / "mergedb_manifest.json", tmp_path / "replayed")
    assert replayed.manifest["content_hash"] == remote_run.manifest["content_hash"]
    assert (
        "remote_bytes_fetched" not in json.loads((tmp_path / "out-local" / "mergedb_manifest.json").read_text())["run"]
    )


def test_http_changed_file_is_refused_at_execution(sharded_family, http_server, tmp_path):
    url = f"{http_server.url}/expert_01/model.safetensors.index.json"
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([f"{http_server.url}/base/model.safetensors.index.json"], base=True, block_size=BLOCK)
    cat.register([url], base_model="base")
    xp = cat.execution_plan(cat.plan(REQUEST).plan_id)
    shard = sorted((sharded_family / "expert_01").glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # same size, same header, one byte of the data changed: a new ETag
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(ChangedFileError, match="expert_01.*changed since it was registered"):
        executor.execute(xp, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_server_answering_other_bytes_is_caught_by_the_block_hashes(sharded_family, http_server, tmp_path):
    """A server that answers a range with other bytes of the file (same length, unchanged ETag) made
    a wrong output that installed and passed check (fsspec does not look at Content-Range): remote
    merges now check every block they read against its registered hash, as --verify does."""
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([f"{http_server.url}/base/model.safetensors.index.json"], base=True, block_size=BLOCK)
    cat.register([f"{http_server.url}/expert_01/model.safetensors.index.json"], base_model="base")
    xp = cat.execution_plan(cat.plan(REQUEST).plan_id)
    executor.execute(xp, tmp_path / "good")
    http_server.shift = 512
    with pytest.raises(ChangedFileError, match="does not match its registered hash"):
        executor.execute(xp, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_one_object_under_two_spellings_of_its_url_is_one_expert(sharded_family, http_server, tmp_path):
    """expert_01 and expert%5F01 name the same object; registered under two names it was counted
    twice by every plan over all experts (the copy check compared the URLs as typed)."""
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([f"{http_server.url}/base/model.safetensors.index.json"], base=True, block_size=BLOCK)
    cat.register([f"{http_server.url}/expert_01/model.safetensors.index.json"], base_model="base", name="a")
    with pytest.raises(MergeDBError, match="holds the files of expert 'a'"):
        cat.register([f"{http_server.url}/expert%5F01/model.safetensors.index.json"], base_model="base", name="b")
    assert [c.name for c in cat.checkpoints()] == ["base", "a"]


def test_a_failure_without_words_is_named_by_its_kind(monkeypatch):
    """aiohttp's timeout (after 300 s on a stalled server) has an empty str: the message read
    'reading failed ()'."""

    class Stalled:
        protocol = ("http", "https")
        calls = 0

        def cat_file(self, *a, **k):
            Stalled.calls += 1
            raise TimeoutError()

    monkeypatch.setattr(remote, "filesystem", lambda url: (Stalled(), url))
    with pytest.raises(MergeDBError, match=r"reading failed \(TimeoutError\)"):
        remote.read_bytes("http://example.invalid/x.safetensors", 0, 8)
    assert Stalled.calls == 1  # aiohttp times out after 5 minutes: not tried again (25 minutes in all)


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on 127.0.0.1 behind a logging proxy; fsspec's s3 points at the proxy and the
    credentials come from the environment only (the secret is a random marker)."""
    pytest.importorskip("s3fs", reason="S3 checkpoints need s3fs: pip install 'mergedb[remote]'")
    server_mod = pytest.importorskip("moto.server", reason="the S3 test needs moto[server] (in the dev extra)")
    import boto3
    import s3fs

    # port 0: the system picks a free one (a port probed free first could be taken before moto
    # binds it, and moto's start() then waits forever)
    moto = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    port = moto.get_host_and_port()[1]
    proxy = LoggingProxy(("127.0.0.1", port))
    secret = "mergedb-test-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "mergedbtestkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": proxy.url})
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
    client.create_bucket(Bucket="models")
    yield client, proxy, secret
    s3fs.S3FileSystem.clear_instance_cache()
    proxy.close()
    moto.stop()


def _upload(client, folder: Path, prefix: str) -> None:
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            client.put_object(Bucket="models", Key=f"{prefix}/{p.relative_to(folder)}", Body=p.read_bytes())


def test_s3_folder_of_experts_plan_equals_local_and_stores_no_secret(s3, tmp_path, monkeypatch):
    client, proxy, secret = s3
    monkeypatch.setenv("MERGEDB_REMOTE_GAP", str(GAP))
    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=5)
    _upload(client, fam, "fam")
    local, far = Catalog(tmp_path / "local.duckdb"), Catalog(tmp_path / "remote.duckdb")
    local.register([fam], base_model="base", block_size=BLOCK)
    res = far.register(["s3://models/fam"], base_model="base", block_size=BLOCK)  # listed: base and 3 experts
    assert sorted(res.registered) == ["base", *EXPERTS]
    lx = local.execution_plan(local.plan(REQUEST).plan_id)
    rp = far.plan(REQUEST)
    rx = far.execution_plan(rp.plan_id)
    assert rx.experts[0].path == "s3://models/fam/expert_00"
    proxy.log.clear()
    run = executor.execute(rx, tmp_path / "out-remote")
    executor.execute(lx, tmp_path / "out-local")
    _same_outputs(tmp_path / "out-remote", tmp_path / "out-local")
    log = [Logged(e.method, e.path.removeprefix("models/fam/"), e.start, e.end, e.body) for e in proxy.log]
    fetched = _check_fetches(fam, rx, log)
    assert run.manifest is not None and fetched > 0
    assert run.expert_bytes <= rp.budget_bytes
    far_files = [p for p in tmp_path.iterdir() if p.name.startswith("remote.duckdb")]
    for f in [*far_files, tmp_path / "out-remote" / "mergedb_manifest.json"]:
        assert secret.encode() not in f.read_bytes(), f
        assert b"mergedbtestkey" not in f.read_bytes(), f

    # an expert replaced in the bucket (same size and header) is refused, and nothing is written
    key = "fam/expert_02/model.safetensors"
    data = bytearray((fam / "expert_02" / "model.safetensors").read_bytes())
    data[-2] ^= 1
    client.put_object(Bucket="models", Key=key, Body=bytes(data))
    with pytest.raises(ChangedFileError, match="expert_02"):
        executor.execute(rx, tmp_path / "out-again")
    assert not (tmp_path / "out-again").exists()


def test_coalescing_merges_close_ranges_and_counts_bytes(tmp_path):
    from mergedb.sources import RemoteOptions, Sources

    blob = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / "f.bin").write_bytes(blob)
    group = Sources(RemoteOptions(gap_bytes=8, max_request_bytes=1000, read_ahead=0))
    src = group.open(f"file://{tmp_path}/f.bin")
    reads = [(0, 10), (12, 20), (40, 10), (2000, 100), (2100, 950), (5000, 3000)]
    src.expect((o, n, 1) for o, n in reads)
    for o, n in reads:
        buf = bytearray(n)
        src.read_into(memoryview(buf), o)
        assert bytes(buf) == blob[o : o + n]
    # by hand: [0,32) (gap 2); [40,50) (gap 8 from 32 would join, but 10 bytes later: 40-32=8 ≤ 8)
    # so [0,50) is one request; [2000,2100) and [2100,3050) exceed 1000 together: two requests;
    # [5000,8000) is larger than a request: read directly in 3 pieces of ≤ 1000
    assert group.requests == 1 + 2 + 3
    assert group.fetched == 50 + 100 + 950 + 3000
    again = bytearray(10)  # a read beyond what was declared is fetched as it is
    src.read_into(memoryview(again), 0)
    assert bytes(again) == blob[:10] and group.fetched == 4100 + 10
    group.close()


def test_a_merge_of_many_files_spans_its_requests_within_the_prefetch_bound(tmp_path):
    """A merge reads every file at once and holds each file's current request until its last read,
    whatever the prefetch bound (remote review helper: ~31 MiB per expert file, 16 GB for 1,000
    experts). Declared as concurrent, a request of F files spans at most prefetch_bytes / F (not
    under MIN_SPAN); a scan's declarations (one file at a time) keep max_request_bytes."""
    from mergedb.sources import MIN_SPAN, RemoteOptions, Sources, declare

    assert MIN_SPAN == 2**20

    opt = RemoteOptions(max_request_bytes=16 * 2**20, prefetch_bytes=32 * 2**20)
    for files, concurrent, most in ((64, True, 2**20), (8, True, 4 * 2**20), (64, False, 16 * 2**20)):
        group = Sources(opt)
        srcs = [group.open(f"file://{tmp_path}/f{i}.bin") for i in range(files)]
        # each file: 24 MiB of 64 KiB blocks, back to back (a tensor read whole)
        declare(((s, o, 2**16, 1) for s in srcs for o in range(0, 24 * 2**20, 2**16)), concurrent=concurrent)
        spans = [c.hi - c.lo for s in srcs for c in s.chunks]
        assert max(spans) == most  # by hand: 32 MiB / 64 under MIN_SPAN; 32 MiB / 8; a scan's 16 MiB
        assert sum(spans) == files * 24 * 2**20  # every byte declared, in whole requests
        group.close()


def test_urls_with_credentials_are_refused(tmp_path):
    cat = Catalog(tmp_path / "c.duckdb")
    for url in (
        "https://user:pw@example.com/m/model.safetensors",
        "https://example.com/m/model.safetensors?X-Amz-Signature=1",
    ):
        with pytest.raises(MergeDBError, match="environment"):
            cat.register([url], base=True)
    assert not (tmp_path / "c.duckdb").exists()  # refused before the catalog was created


def test_an_unreachable_server_is_not_called_a_missing_file(sharded_family, http_server, tmp_path):
    """fsspec's HTTP filesystem reports a refused connection as FileNotFoundError: mergedb says the
    server cannot be reached (with the cause), and keeps "no such file" for a real 404."""
    pytest.importorskip("fsspec")
    cat = Catalog(tmp_path / "c.duckdb")
    with pytest.raises(MergeDBError, match=r"127.0.0.1:9/x/model.safetensors: cannot be reached \(ClientConnector"):
        cat.register(["http://127.0.0.1:9/x/model.safetensors"], base=True)
    with pytest.raises(MergeDBError, match="no such file|holds no checkpoint|no model.safetensors"):
        cat.register([f"{http_server.url}/no/such/model.safetensors"], base=True)
    assert not (tmp_path / "c.duckdb").exists()


def test_mergedb_works_without_fsspec_and_says_how_to_get_it(tmp_path):
    code = f"""
import sys
sys.modules["fsspec"] = None  # as if not installed
from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.errors import MergeDBError
from mergedb.planner import PlanRequest
fam = synth.make_family({str(tmp_path / "fam")!r}, experts=2, size="tiny")
cat = Catalog({str(tmp_path / "c.duckdb")!r})
cat.register([fam], base_model="base")
xp = cat.execution_plan(cat.plan(PlanRequest("base", None, "linear", "50%")).plan_id)
executor.execute(xp, {str(tmp_path / "out")!r})
try:
    cat.register(["s3://bucket/expert"], base_model="base")
except MergeDBError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "pip install 'mergedb[remote]'" in out.stdout and "s3://bucket/expert" in out.stdout
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_registers_a_url_and_lists_it(tmp_path):
    from typer.testing import CliRunner

    from mergedb.cli import app

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=2)
    db = str(tmp_path / "c.duckdb")
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(app, ["register", f"file://{fam}/base", "--base", "--catalog", db, "--quiet"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["register", f"file://{fam}/expert_00/model.safetensors", "--catalog", db, "--quiet"])
    assert r.exit_code == 0, r.output
    paths = Catalog(db).sql("SELECT name, path FROM checkpoints ORDER BY name").to_pylist()
    assert paths == [
        {"name": "base", "path": f"file://{fam}/base"},
        {"name": "expert_00", "path": f"file://{fam}/expert_00/model.safetensors"},
    ]


def test_server_without_versions_and_escaping_shards_are_refused(sharded_family, tmp_path):
    srv = RangeServer(sharded_family, versions=False)
    try:
        with pytest.raises(MergeDBError, match="neither an ETag nor a Last-Modified"):
            Catalog(tmp_path / "a.duckdb").register([f"{srv.url}/base/model.safetensors.index.json"], base=True)
    finally:
        srv.close()
    index = sharded_family / "base" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    doc["weight_map"][first] = "../expert_00/" + doc["weight_map"][first]
    index.write_text(json.dumps(doc))
    with pytest.raises(MergeDBError, match="outside the checkpoint folder"):
        Catalog(tmp_path / "b.duckdb").register([f"file://{index}"], base=True)


def test_check_deep_reads_remote_blocks(tmp_path):
    from mergedb.check import check_catalog

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([f"file://{fam}/base", f"file://{fam}/expert_00"], base_model="base", block_size=BLOCK)
    assert check_catalog(cat, deep=True) == []
    f = fam / "expert_00" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 1
    f.write_bytes(bytes(data))
    problems = check_catalog(cat, deep=True)
    assert [p.where for p in problems] == ["checkpoint expert_00"] and "changed" in problems[0].what


def _side_tree(folder: Path) -> dict[str, bytes]:
    """The output's files other than its weights and manifest, by relative path."""
    skip = {"model.safetensors", "mergedb_manifest.json"}
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name not in skip}


def test_a_listed_remote_base_gives_the_side_files_a_local_one_gives(tmp_path):
    """A base read from a listing filesystem (S3, GCS; file:// here) gave its output no
    tokenizer.model.vN (a Mistral base whose only tokenizer it is: none), no named chat templates and
    not the modules its custom code imports relatively (remote review helper): the same now as from
    the local folder. Over HTTP, which cannot list, the code and what it imports still come."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=4)
    b = fam / "base"
    (b / "tokenizer.model.v3").write_bytes(b"\x0a\x05mistral-sp")
    (b / "additional_chat_templates").mkdir()
    (b / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    cfg = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    (b / "configuration_my.py").write_text("from .helpers import x\n\nclass MyConfig:\n    pass\n")
    (b / "helpers.py").write_text("x = 1\n")
    want = {"tokenizer.model.v3", "additional_chat_templates/tool_use.jinja", "configuration_my.py", "helpers.py"}
    trees = {}
    for label, where in (("local", str(fam)), ("listed", f"file://{fam}")):
        cat = Catalog(tmp_path / f"{label}.duckdb")
        cat.register([f"{where}/base", f"{where}/expert_00"], base_model="base", block_size=BLOCK)
        xp = cat.execution_plan(cat.plan(PlanRequest("base", None, "linear", "all")).plan_id)
        executor.execute(xp, tmp_path / label)
        trees[label] = _side_tree(tmp_path / label)
    assert want <= set(trees["local"]) and trees["listed"] == trees["local"]
    assert json.loads(trees["listed"]["config.json"])["auto_map"] == {"AutoConfig": "configuration_my.MyConfig"}
    srv = RangeServer(fam)  # over HTTP: by name only
    try:
        cat = Catalog(tmp_path / "http.duckdb")
        cat.register([f"{srv.url}/base/model.safetensors"], base=True, name="base", block_size=BLOCK)
        cat.register([f"{srv.url}/expert_00/model.safetensors"], base_model="base", name="expert_00")
        xp = cat.execution_plan(cat.plan(PlanRequest("base", None, "linear", "all")).plan_id)
        executor.execute(xp, tmp_path / "h")
    finally:
        srv.close()
    code = {"configuration_my.py", "helpers.py"}
    assert code <= set(_side_tree(tmp_path / "h")) and not (want - code) & set(_side_tree(tmp_path / "h"))


def test_a_remote_expert_gone_at_execution_is_named_as_gone(tmp_path):
    """A remote object deleted between plan and execute was refused with registration's message
    ("no model.safetensors … there; point at a model folder"), which misleads: it was one. And keys
    named '.' or '..' under a prefix are no experts."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([f"file://{fam}"], base_model="base", block_size=BLOCK)
    xp = cat.execution_plan(cat.plan(PlanRequest("base", None, "linear", "all")).plan_id)
    (fam / "expert_01" / "model.safetensors").unlink()
    with pytest.raises(ChangedFileError, match=r"expert_01 is no longer readable at file://.*restore it there"):
        executor.execute(xp, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_keys_named_dot_or_dot_dot_are_no_entries(s3, tmp_path):
    """An object store holds keys like fam/../model.safetensors literally: listed, they became
    experts named '.' and '..' (remote review helper)."""
    client, _, _ = s3
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=4)
    _upload(client, fam, "dots")  # a prefix of its own: moto's in-process servers share their buckets
    weights = (fam / "expert_00" / "model.safetensors").read_bytes()
    for key in ("dots/../model.safetensors", "dots/./model.safetensors"):
        client.put_object(Bucket="models", Key=key, Body=weights)
    assert remote.listdir("s3://models/dots") == ["base", "expert_00"]


def test_bench_remote_quick_runs(tmp_path):
    """The remote benchmark cannot rot: --quick at tiny size, and its RESULTS section renders."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "MERGEDB_BENCH_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "benchmarks.bench_remote", "--quick", "--k", "2", "--repeats", "1"]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "results" / "remote-quick.json").read_text())
    for row in doc["rows"]:
        assert row["expert_bytes"] == row["selected_bytes"]
        if row["arm"] == "remote":  # the server sent the tensor bytes the client counted, plus headers and side files
            assert row["served_bytes"] >= row["remote_bytes_fetched"] >= row["expert_bytes"] + row["base_bytes"]
    from benchmarks.report import _remote

    assert "| 25% | remote / local |" in "\n".join(_remote(doc))


def _served_plan(http_server, tmp_path) -> ExecutionPlan:
    """REQUEST's plan over the sharded family as `http_server` serves it (base and every expert)."""
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([f"{http_server.url}/base/model.safetensors.index.json"], base=True, block_size=BLOCK)
    cat.register([f"{http_server.url}/{e}/model.safetensors.index.json" for e in EXPERTS], base_model="base")
    return cat.execution_plan(cat.plan(REQUEST).plan_id)


def test_server_failing_mid_run_leaves_no_output(sharded_family, http_server, tmp_path):
    xp = _served_plan(http_server, tmp_path)
    http_server.fail_data = True
    with pytest.raises(MergeDBError, match="reading failed.*check the network"):
        executor.execute(xp, tmp_path / "out")
    assert not [p.name for p in tmp_path.iterdir() if "out" in p.name]  # no output, no temporary folder, no lock


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """HTTP requests are tried again after a transient failure without the waits between tries."""
    monkeypatch.setattr(remote, "HTTP_BACKOFF", 0.0)


def test_transient_http_failures_are_tried_again_and_lasting_ones_are_not(sharded_family, http_server, tmp_path):
    """fsspec's HTTP filesystem does not retry: one 503 or dropped connection among hundreds of
    ranged GETs failed a whole merge (over S3 botocore retries). A transient failure is tried again
    (HTTP_TRIES in all) and the output is the one without failures; a 403 is not tried again, and a
    failure that lasts ends the run after HTTP_TRIES tries of a range, leaving no output."""
    xp = _served_plan(http_server, tmp_path)
    executor.execute(xp, tmp_path / "clean")
    http_server.flaky = [503, "drop", 500, 429]  # HTTP_TRIES − 1: fine even if one request meets them all
    http_server.log.clear()
    executor.execute(xp, tmp_path / "flaky")
    _same_outputs(tmp_path / "flaky", tmp_path / "clean")
    assert not http_server.flaky
    failed = [e for e in http_server.log if e.method == "GET" and e.body == 0 and e.path.endswith(".safetensors")]
    assert len(failed) == 4  # each failure was one request, each tried again
    http_server.flaky = [403]
    http_server.log.clear()
    with pytest.raises(MergeDBError, match="reading failed.*Forbidden"):
        executor.execute(xp, tmp_path / "forbidden")
    assert len([e for e in http_server.log if e.method == "GET" and e.body == 0]) == 1
    http_server.fail_data = True  # every read of tensor data fails: each range is tried HTTP_TRIES times
    http_server.log.clear()
    with pytest.raises(MergeDBError, match="reading failed.*Internal Server Error"):
        executor.execute(xp, tmp_path / "lasting")
    # one range is one (path, start, end): a chunk fetched ahead and a read of its first tensor begin at one
    # offset, and under load both were tried before the run ended (7 GETs at one start, in a CI run here)
    tries = collections.Counter((e.path, e.start, e.end) for e in http_server.log if e.method == "GET" and not e.body)
    assert max(tries.values()) == remote.HTTP_TRIES
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("forbidden", "lasting", ".forbidden"))]


def test_a_retry_after_answer_is_waited_for_up_to_a_limit(sharded_family, http_server, tmp_path, monkeypatch):
    """A 429 or 503 may say when to come back (Retry-After: seconds, or an HTTP date); it was not read,
    so the next tries came at once and a throttled merge failed faster than the server asked. Now the
    wait is what the answer asks (at least the usual backoff); an answer asking for more than
    HTTP_MAX_WAIT ends the run at once with the wait it asked for, leaving no output."""
    xp = _served_plan(http_server, tmp_path)
    executor.execute(xp, tmp_path / "clean")
    waits: list[float] = []
    monkeypatch.setattr(remote.time, "sleep", waits.append)  # waits recorded, not slept
    http_server.flaky = [(429, "1"), (503, "2")]
    executor.execute(xp, tmp_path / "waited")
    assert sorted(waits) == [1.0, 2.0]  # what each answer asked (the usual backoff is 0 in tests)
    _same_outputs(tmp_path / "waited", tmp_path / "clean")
    monkeypatch.setattr(remote, "HTTP_MAX_WAIT", 30.0)
    http_server.flaky = [(429, "3600")]
    http_server.log.clear()
    with pytest.raises(
        MergeDBError, match=r"asks to be tried again in 3600 s \(Retry-After\), longer than mergedb waits"
    ):
        executor.execute(xp, tmp_path / "throttled")
    assert len([e for e in http_server.log if e.method == "GET" and e.body == 0]) == 1  # not tried again
    assert not [p.name for p in tmp_path.iterdir() if "throttled" in p.name]
    later = formatdate(remote.time.time() + 120, usegmt=True)
    assert 100 < remote._retry_after(_answer(503, later)) <= 120
    assert remote._retry_after(_answer(429, "7")) == 7.0
    assert remote._retry_after(_answer(429, "soon")) is None and remote._retry_after(_answer(503, None)) is None


def _answer(status: int, retry_after: str | None) -> Exception:
    """An aiohttp error as fsspec's HTTP filesystem raises it, with the answer's headers."""
    import aiohttp

    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return aiohttp.ClientResponseError(None, (), status=status, headers=headers)


def test_a_listed_remote_folder_refuses_weights_it_would_skip(tmp_path):
    """A folder URL of checkpoints (file:// here, listed as S3 or GCS are) skipped a subfolder of
    shards without their index, as the local folder did: the family was registered an expert short.
    Refused now, naming the subfolder; plain files and folders without weights are still ignored."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=9)
    (fam / "notes.txt").write_text("hello\n")
    (fam / "logs").mkdir()
    (fam / "logs" / "training_args.bin").write_bytes(b"\0")
    (fam / "expert_01" / "model.safetensors").rename(fam / "expert_01" / "model-00001-of-00001.safetensors")
    cat = Catalog(tmp_path / "c.duckdb")
    with pytest.raises(MergeDBError, match=r"expert_01 holds shards \(model-00001-of-00001.safetensors, …\)"):
        cat.register([f"file://{fam}"], base_model="base")
    assert not cat.path.exists()
    (fam / "expert_01" / "model-00001-of-00001.safetensors").unlink()
    assert cat.register([f"file://{fam}"], base_model="base").registered == ("base", "expert_00")


def test_a_model_file_takes_its_folders_name_except_over_http(tmp_path):
    """file:// and object stores name …/expert_00/model.safetensors 'expert_00', as the folder would
    be named; over HTTP the folder is often a revision (…/resolve/main/model.safetensors), so the
    file's stem stays the name there."""
    from mergedb.checkpoint import open_checkpoint

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=4)
    assert open_checkpoint(f"file://{fam}/expert_00/model.safetensors").name == "expert_00"
    srv = RangeServer(fam)
    try:
        assert open_checkpoint(f"{srv.url}/expert_00/model.safetensors").name == "model"
    finally:
        srv.close()
