"""Byte sources: where scans and merges read a checkpoint file's bytes from.

A local file is an open descriptor read with os.preadv, exactly as before (`LocalFile`). A remote
file (a URL, see remote.py) is read with ranged requests (`RemoteFile`). Reads of a remote file
that a caller declares ahead (`RemoteFile.expect`: the planned blocks of a merge, the blocks of a
scan, in the order they will be read) are coalesced: consecutive declared ranges whose gap is at
most `RemoteOptions.gap_bytes` and whose span is at most `max_request_bytes` become one request
(a chunk), fetched once, kept until every read declared in it has been served, then dropped. When
a chunk is first needed, the next `read_ahead` chunks of the file are fetched on the caller's I/O
threads (the merger's), while at most `prefetch_bytes` of fetched-but-unread chunks are held. An
undeclared read is fetched as it is, in requests of at most `max_request_bytes`.

Bytes fetched are counted per `Sources` (the merge's manifest records them): planned bytes plus at
most one gap per declared range, plus the ranges read undeclared.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import remote
from .errors import MergeDBError
from .tensorfile import pread_into
from .units import parse_size

MIN_SPAN = 2**20  # a concurrent read's request spans at least this much: below, latency rules, not memory


@dataclass(frozen=True)
class RemoteOptions:
    """How remote files are fetched (no effect on local files nor on any output byte)."""

    gap_bytes: int = 256 * 2**10  # fetch unplanned bytes between two planned ranges up to this size
    max_request_bytes: int = 16 * 2**20  # one request's span
    read_ahead: int = 2  # chunks of a file fetched ahead of the one being read
    prefetch_bytes: int = 512 * 2**20  # fetched-but-unread chunks held at most (all files together)

    def __post_init__(self) -> None:
        for k in ("gap_bytes", "max_request_bytes", "read_ahead", "prefetch_bytes"):
            if getattr(self, k) < (1 if k == "max_request_bytes" else 0):
                raise MergeDBError(f"RemoteOptions.{k} must be positive, got {getattr(self, k)}")

    @classmethod
    def from_env(cls) -> RemoteOptions:
        """The defaults, overridden by MERGEDB_REMOTE_GAP and MERGEDB_REMOTE_REQUEST (sizes: 64KiB,
        16MiB) and MERGEDB_REMOTE_READ_AHEAD (chunks): the same on the CLI, in the library and on
        remote workers, which inherit the environment."""
        kw: dict[str, int] = {}
        for var, key in (("MERGEDB_REMOTE_GAP", "gap_bytes"), ("MERGEDB_REMOTE_REQUEST", "max_request_bytes")):
            if os.environ.get(var):
                kw[key] = parse_size(os.environ[var], what=var)
        if os.environ.get("MERGEDB_REMOTE_READ_AHEAD"):
            text = os.environ["MERGEDB_REMOTE_READ_AHEAD"]
            if not (text.isascii() and text.isdigit()):
                raise MergeDBError(f"MERGEDB_REMOTE_READ_AHEAD must be a whole number of chunks, got {text!r}")
            kw["read_ahead"] = int(text)
        return cls(**kw)


class LocalFile:
    """A local file: os.preadv on a descriptor, as before remote sources existed."""

    remote = False

    def __init__(self, path: Path, random: bool = False) -> None:
        self.path = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        if random:  # no kernel readahead past the ranges asked for
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read_into(self, buf: memoryview, offset: int) -> None:
        pread_into(self.fd, buf, offset, self.path)

    def will_need(self, offset: int, n: int) -> None:
        os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_WILLNEED)

    def expect(self, reads: Iterable[tuple[int, int, int]]) -> None:
        """Nothing to plan: the page cache and the kernel's readahead serve local files."""

    def close(self) -> None:
        os.close(self.fd)


class _Chunk:
    """One coalesced request: bytes [lo, hi) of a file, fetched once, served to `left` reads."""

    __slots__ = ("lo", "hi", "left", "readers", "state", "data", "done", "error", "index")

    def __init__(self, lo: int, hi: int, index: int) -> None:
        self.lo, self.hi, self.index = lo, hi, index
        self.left = 0  # declared reads not yet started
        self.readers = 0  # reads started and not finished
        self.state = "idle"  # idle -> queued -> fetching -> ready -> spent (or failed)
        self.data: bytes | None = None
        self.done = threading.Event()
        self.error: BaseException | None = None


class RemoteFile:
    """A file behind a URL, read with ranged requests (see the module docstring)."""

    remote = True

    def __init__(self, url: str, group: Sources) -> None:
        self.path = url
        self.group = group
        self.chunks: list[_Chunk] = []
        self.at: dict[tuple[int, int], _Chunk] = {}  # declared (offset, length) -> its chunk
        self.lock = threading.Lock()

    def expect(self, reads: Iterable[tuple[int, int, int]], span: int | None = None) -> None:
        """Declare reads (offset, length, times read) in the order they will be asked for, coalesced
        into requests spanning at most `span` bytes (default: max_request_bytes)."""
        opt = self.group.options
        span = opt.max_request_bytes if span is None else span
        cur = self.chunks[-1] if self.chunks else None
        for off, n, times in reads:
            if n <= 0 or times <= 0:
                continue
            known = self.at.get((off, n))
            if known is not None:
                known.left += times
                continue
            if n > span:  # read directly, in pieces
                continue
            if cur is None or not (cur.hi <= off <= cur.hi + opt.gap_bytes and off + n - cur.lo <= span):
                cur = _Chunk(off, off + n, len(self.chunks))
                self.chunks.append(cur)
            cur.hi = max(cur.hi, off + n)
            cur.left += times
            self.at[off, n] = cur

    def read_into(self, buf: memoryview, offset: int) -> None:
        n = len(buf)
        mine = False
        with self.lock:
            chunk = self.at.get((offset, n))
            if chunk is not None and chunk.left <= 0:  # read more often than declared
                chunk = None
            if chunk is not None:
                chunk.left -= 1  # this read's slot: the bytes stay until every slot's read is done
                chunk.readers += 1
                if chunk.state in ("idle", "queued"):
                    chunk.state = "fetching"  # this thread fetches it (a queued prefetch finds it taken)
                    mine = True
        if chunk is None:
            self._direct(buf, offset)
            return
        try:
            if mine:
                self._fetch(chunk)
            self._ahead(chunk)
            chunk.done.wait()
            if chunk.error is not None:
                raise chunk.error
            if chunk.data is None:
                raise RuntimeError(f"bug: chunk {chunk.lo}-{chunk.hi} of {self.path} dropped before its last read")
            buf[:] = memoryview(chunk.data)[offset - chunk.lo : offset - chunk.lo + n]
        finally:
            with self.lock:
                chunk.readers -= 1
                if chunk.left == 0 and chunk.readers == 0 and chunk.state == "ready":
                    chunk.state, chunk.data = "spent", None
                    self.group.release(chunk.hi - chunk.lo)

    def _fetch(self, chunk: _Chunk) -> None:
        try:
            data = self.group.get(self.path, chunk.lo, chunk.hi)
        except BaseException as e:  # every reader of the chunk raises it
            chunk.error = e
            with self.lock:
                chunk.state = "failed"
            chunk.done.set()
            if not isinstance(e, Exception):
                raise
            return
        with self.lock:
            chunk.data, chunk.state = data, "ready"
            self.group.hold(chunk.hi - chunk.lo)
        chunk.done.set()

    def _ahead(self, chunk: _Chunk) -> None:
        """Queue the next chunks of this file on the I/O threads, within the prefetch memory bound."""
        pool = self.group.pool()
        for nxt in self.chunks[chunk.index + 1 : chunk.index + 1 + self.group.options.read_ahead]:
            with self.lock:
                if nxt.state != "idle" or not self.group.may_hold(nxt.hi - nxt.lo):
                    continue
                nxt.state = "queued"
            try:
                pool.submit(self._prefetch, nxt)
            except RuntimeError:  # the pool was shut down (the merge is closing): read on demand
                with self.lock:
                    nxt.state = "idle" if nxt.state == "queued" else nxt.state
                return

    def _prefetch(self, chunk: _Chunk) -> None:
        with self.lock:
            if chunk.state != "queued":  # a reader took it meanwhile
                return
            chunk.state = "fetching"
        self._fetch(chunk)

    def _direct(self, buf: memoryview, offset: int) -> None:
        step = self.group.options.max_request_bytes
        for a in range(0, len(buf), step):
            b = min(len(buf), a + step)
            buf[a:b] = self.group.get(self.path, offset + a, offset + b)

    def will_need(self, offset: int, n: int) -> None:
        """Declared reads are fetched ahead already."""

    def close(self) -> None:
        with self.lock:
            for c in self.chunks:
                if c.state == "ready":
                    self.group.release(c.hi - c.lo)
                c.state, c.data = "spent", None


class Sources:
    """The byte sources one scan or merge opens: their options, the thread pool remote chunks are
    fetched ahead on (the merger's I/O threads, else a small pool of its own), and the count of
    bytes fetched from remote files."""

    def __init__(self, options: RemoteOptions | None = None, pool: Executor | None = None) -> None:
        self.options = options or RemoteOptions.from_env()
        self._pool = pool
        self._own: ThreadPoolExecutor | None = None
        self.opened: list[LocalFile | RemoteFile] = []
        self.fetched = 0  # bytes received from remote files
        self.requests = 0
        self.held = 0  # bytes of fetched chunks not yet read to the end
        self.lock = threading.Lock()

    def open(self, path: Path | remote.RemotePath | str, random: bool = False) -> LocalFile | RemoteFile:
        """A source for the file at `path` (a URL or a local path); closed with `close`."""
        src: LocalFile | RemoteFile = (
            RemoteFile(str(path), self) if remote.is_url(path) else LocalFile(Path(str(path)), random)
        )
        self.opened.append(src)
        return src

    @property
    def any_remote(self) -> bool:
        return any(s.remote for s in self.opened)

    def get(self, url: str, lo: int, hi: int) -> bytes:
        data = remote.read_bytes(url, lo, hi)
        with self.lock:
            self.fetched += len(data)
            self.requests += 1
        return data

    def may_hold(self, n: int) -> bool:
        with self.lock:
            return self.held + n <= self.options.prefetch_bytes

    def hold(self, n: int) -> None:
        with self.lock:
            self.held += n

    def release(self, n: int) -> None:
        with self.lock:
            self.held -= n

    def pool(self) -> Executor:
        if self._pool is not None:
            return self._pool
        with self.lock:
            if self._own is None:
                self._own = ThreadPoolExecutor(4, thread_name_prefix="mergedb-fetch")
            return self._own

    def close(self) -> None:
        if self._own is not None:
            self._own.shutdown(cancel_futures=True)
        for s in self.opened:
            s.close()
        self.opened.clear()


def declare(reads: Iterable[tuple[LocalFile | RemoteFile, int, int, int]], concurrent: bool = False) -> None:
    """Declare (source, offset, length, times) reads, in the order they will be made, to their
    remote sources (local ones ignore them). `concurrent`: the reads go to every file at once, as a
    merge's do, and each file's current request is kept until its last declared read, which no
    prefetch bound limits: so with many files a request spans at most prefetch_bytes / files (not
    under MIN_SPAN), and K experts' requests in progress hold about prefetch_bytes, not K ×
    max_request_bytes (16 GB for 1,000 experts)."""
    by_source: dict[int, tuple[RemoteFile, list[tuple[int, int, int]]]] = {}
    for src, off, n, times in reads:
        if isinstance(src, RemoteFile):
            by_source.setdefault(id(src), (src, []))[1].append((off, n, times))
    for src, rs in by_source.values():
        opt = src.group.options
        share = max(MIN_SPAN, opt.prefetch_bytes // len(by_source)) if concurrent else opt.max_request_bytes
        src.expect(rs, min(opt.max_request_bytes, share))
