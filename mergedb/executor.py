"""The executor: merge a plan into a Hugging-Face folder, reading only the planned expert bytes.

An `ExecutionPlan` (mergedb.manifest) is a plain value: parameters, file locations, the mask as
an Arrow table, no database. The merge is a stream of (name, tensor) pieces produced by
independent units of work (the tensors bound for one output shard); writing safetensors is one
consumer of that stream, `merge_to_dict` another. The output folder is built under a temporary
name and put in place only when complete, by outdir.py (one writer per output, the --force swap,
recovery after a crash).
"""

from __future__ import annotations

import collections
import itertools
import os
import resource
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import xxhash

from . import kernels, methods, outdir
from .check import check_output  # noqa: F401  (re-exported: outputs are checked where they are made)
from .checkpoint import INDEX, open_checkpoint, side_files
from .errors import ChangedFileError, MergeDBError
from .layout import TensorLayout, block_bytes, row_elems, shard_groups, shard_names
from .manifest import MANIFEST, MASK, ExecutionPlan, Source, build_manifest, mask_table, plan_from_manifest, write_json
from .tensorfile import DTYPES, SafetensorsWriter, TensorInfo, as_float32, encode, pread_into, tensor_nbytes

OUT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
READ_AHEAD = 3  # expert blocks in flight ahead of the arithmetic


@dataclass(frozen=True)
class ExecuteResult:
    out: Path
    manifest: dict[str, Any]
    seconds: float
    expert_bytes: int  # logical: bytes requested from expert files
    physical_bytes: int  # /proc/self/io read_bytes during the run (experts and base)
    base_bytes: int
    bytes_written: int
    peak_rss: int


@dataclass
class _Counters:
    expert: int = 0
    base: int = 0


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: on Linux a child started by fork and
    exec inherits its parent's high-water mark there, so a small merge run from a big process
    would report the parent's memory."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def physical_read_bytes() -> int:
    """Bytes this process has fetched from storage so far (/proc/self/io read_bytes; page-cache
    hits are not counted). 0 where the kernel does not report it."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class _Inputs:
    """Open files of every source, checked against their fingerprints."""

    def __init__(self, xp: ExecutionPlan) -> None:
        self.fds: list[int] = []
        self.where: list[dict[str, tuple[int, TensorInfo, str]]] = []
        for i, src in enumerate((xp.base, *xp.experts)):
            ckpt = open_checkpoint(src.path, name=src.name)
            if ckpt.fingerprint != src.fingerprint:
                raise ChangedFileError(
                    f"{src.name} ({src.path}) changed since it was registered; re-register it with "
                    "`mergedb register --refresh` and plan again"
                )
            fds = []
            for f in ckpt.files:
                fd = os.open(ckpt.root / f.relpath, os.O_RDONLY)
                if i > 0:  # experts: no kernel readahead past the ranges we ask for
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                fds.append(fd)
                self.fds.append(fd)
            where = {t.name: (fds[fi], t, str(ckpt.root / ckpt.files[fi].relpath)) for fi, t in ckpt.tensors}
            self.where.append(where)
            for t in xp.tensors:  # the plan's sizes come from the files, never from the plan alone
                info = where.get(t.name)
                if (i == 0 or t.mergeable) and (info is None or info[1].dtype != t.dtype or info[1].shape != t.shape):
                    have = f"{info[1].dtype}{list(info[1].shape)}" if info else "nothing"
                    raise ChangedFileError(
                        f"{src.path}: the plan describes tensor {t.name!r} as {t.dtype}{list(t.shape)} but the "
                        f"file holds {have}; the plan or manifest does not describe these files: plan again"
                    )

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def output_shards(xp: ExecutionPlan, max_shard_size: int, dtype: str | None = None) -> list[list[int]]:
    """Tensor indices grouped into output shards of at most `max_shard_size` bytes (in order)."""
    sizes = [tensor_nbytes(_out_dtype(t, dtype), t.shape) for t in xp.tensors]
    return shard_groups(sizes, max_shard_size)


def _out_dtype(t: TensorLayout, dtype: str | None) -> str:
    return (dtype or t.dtype) if t.mergeable else t.dtype


class Merger:
    """Produces merged tensors of a plan; one per process (or worker), fed tensor indices."""

    def __init__(self, xp: ExecutionPlan, dtype: str | None = None, verify: bool = False) -> None:
        self.xp, self.verify = xp, verify
        self.dtype = OUT_DTYPES.get(dtype, dtype) if dtype else None
        self.method = methods.get_method(xp.method)
        self.sel = xp.selected()
        self.trims = {
            (p, t): r
            for p, t, r in zip(
                xp.trims.column("position").to_pylist(), xp.trims.column("tensor_idx").to_pylist(), xp.trims.to_pylist()
            )
        }
        self.inputs = _Inputs(xp)
        self.count = _Counters()
        self.pool = ThreadPoolExecutor(2)
        self._bufs: dict[str, np.ndarray] = {}

    def close(self) -> None:
        self.pool.shutdown()
        self.inputs.close()

    def _read_base(self, ti: int) -> np.ndarray:
        """The base's bytes of tensor `ti` (streamed in full, unbudgeted)."""
        t = self.xp.tensors[ti]
        fd, info, path = self.inputs.where[0][t.name]
        base = np.empty(info.nbytes, np.uint8)
        pread_into(fd, memoryview(base), info.start, path)
        self.count.base += info.nbytes
        if self.verify and t.base_hashes:
            for b in range(len(t.rows)):
                lo, hi = block_bytes(t, info.nbytes, b)
                if xxhash.xxh3_128_hexdigest(base[lo:hi]) != t.base_hashes[b]:
                    raise ChangedFileError(
                        f"{path}: block {b} of {t.name!r} changed since registration; register the base again"
                    )
        return base

    def _read_one(self, ti: int, b: int, pos: int, h: str) -> np.ndarray:
        """Expert `pos`'s bytes of block `b` of tensor `ti` (checked against `h` with --verify)."""
        t = self.xp.tensors[ti]
        fd, info, path = self.inputs.where[pos + 1][t.name]
        lo, hi = block_bytes(t, info.nbytes, b)
        raw = np.empty(hi - lo, np.uint8)
        pread_into(fd, memoryview(raw), info.start + lo, path)
        self.count.expert += raw.nbytes
        if self.verify and xxhash.xxh3_128_hexdigest(raw) != h:
            raise ChangedFileError(
                f"{path}: block {b} of {t.name!r} does not match its registered hash; the file changed "
                "since registration: re-register it with --refresh and plan again"
            )
        return raw

    def _reads(self, ti: int, work: list[tuple[int, int, str]]) -> Iterator[tuple[int, np.ndarray]]:
        """(position, bytes) for each (block, position, hash) of `work`, in order, read on the I/O
        thread up to READ_AHEAD items before the arithmetic needs them: memory is a few expert
        blocks, whatever K."""
        futures = collections.deque(self.pool.submit(self._read_one, ti, *w) for w in work[:READ_AHEAD])
        for i in range(len(work)):
            raw = futures.popleft().result()
            if i + READ_AHEAD < len(work):
                futures.append(self.pool.submit(self._read_one, ti, *work[i + READ_AHEAD]))
            yield work[i][1], raw

    def tensors(self, indices: list[int]) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
        """(name, dtype, shape, bytes as uint8 array) of each merged tensor; the next base is read ahead."""
        ahead = self.pool.submit(self._read_base, indices[0]) if indices else None
        for n, ti in enumerate(indices):
            base = ahead.result()  # type: ignore[union-attr]
            if n + 1 < len(indices):
                ahead = self.pool.submit(self._read_base, indices[n + 1])
            yield self._merge(ti, base)

    def _merge(self, ti: int, base_raw: np.ndarray) -> tuple[str, str, tuple[int, ...], np.ndarray]:
        t = self.xp.tensors[ti]
        out_dtype = _out_dtype(t, self.dtype)
        selected = self.sel.get(ti, {})
        if not t.mergeable or (not selected and out_dtype == t.dtype):
            return t.name, t.dtype, t.shape, base_raw  # copied from the base without decoding
        raw_dt, out_dt = np.dtype(DTYPES[t.dtype][1]), np.dtype(DTYPES[out_dtype][1])
        convert = out_dtype != t.dtype
        # Rows of blocks that no expert touches keep the base's bytes exactly (unless the dtype
        # changes); `out` is the base buffer itself, overwritten block by block.
        blocks = list(range(len(t.rows))) if convert else sorted(selected)
        out = base_raw if not convert else np.empty(int(np.prod(t.shape)) * out_dt.itemsize, np.uint8)
        stock = _StockDots(self.xp, ti) if self.xp.method == "model_stock" else None
        pending: list[tuple[int, np.ndarray, np.ndarray]] = []  # model_stock: until t is known
        per_row = row_elems(t.shape)
        reads = self._reads(ti, [(b, pos, h) for b in blocks for pos, h in selected.get(b, [])])
        for b in blocks:
            r0, r1 = t.rows[b]
            lo, n = r0 * per_row, (r1 - r0) * per_row
            base = as_float32(base_raw.view(raw_dt)[lo : lo + n], t.dtype, np.empty(n, np.float32))  # (n,) f32
            acc = kernels.Accumulator(self.method, self.xp.params, n)
            deltas = []
            for pos, raw in itertools.islice(reads, len(selected.get(b, []))):
                d = as_float32(raw.view(raw_dt), t.dtype, self._scratch("e", n))
                np.subtract(d, base, out=d)  # Δ in place: (n,) float32
                src = self.xp.experts[pos]
                d = kernels.sparsify(self.method, self.xp.params, d, lo, self._trim(pos, ti, t, src))
                acc.add(src.coef, src.weight, d)
                if stock is not None:
                    deltas.append((pos, d.copy()))  # the scratch buffer is reused by the next expert
            update = acc.merged_delta()
            if stock is not None:
                stock.add_block(deltas)
                pending.append((lo, base, update))
                continue
            out.view(out_dt)[lo : lo + n] = encode(base + update, out_dtype)
        if stock is not None:
            scale = np.float32(stock.t())
            for lo, base, update in pending:
                out.view(out_dt)[lo : lo + base.size] = encode(base + scale * update, out_dtype)
        return t.name, out_dtype, t.shape, out

    def _scratch(self, name: str, n: int) -> np.ndarray:
        """A reused float32 buffer of n elements (fresh large allocations cost page faults)."""
        buf = self._bufs.get(name)
        if buf is None or buf.size < n:
            buf = self._bufs[name] = np.empty(n, np.float32)
        return buf[:n]

    def _trim(self, pos: int, ti: int, t: TensorLayout, src: Source) -> kernels.Trim:
        r = self.trims.get((pos, ti))
        key = kernels.rng_key(self.xp.seed, src.name, t.name)
        if r is None:
            return kernels.Trim(key=key)
        rank = _della_rank(r["rank_codes"], r["rank_counts"]) if r.get("rank_codes") is not None else None
        return kernels.Trim(r["t_lo"] or 0.0, r["t_hi"], key, rank)


def _della_rank(codes: list[int], counts: list[int]) -> Callable[[np.ndarray], np.ndarray]:
    """DELLA's magnitude rank from a tensor's magnitude summary: the fraction of elements in lower
    2^-6-wide bins plus half of the element's own bin (see README, "DELLA")."""
    below = np.zeros(1 << 15)
    np.add.at(below, np.asarray(codes, np.int64), np.asarray(counts, np.float64))
    cum = (np.cumsum(below) - below / 2) / max(1.0, below.sum())

    def rank(a: np.ndarray) -> np.ndarray:
        return cum[np.asarray(a, np.float32).view(np.uint32) >> 17]

    return rank


class _StockDots:
    """model_stock's per-tensor t from the mean pairwise cosine of the task vectors.

    ⟨Δ_j, Δ_k⟩ is exact over blocks where both were read and estimated from the catalog's
    sketches elsewhere; ‖Δ_k‖² is exact (from the catalog).
    """

    def __init__(self, xp: ExecutionPlan, ti: int) -> None:
        self.k = len(xp.experts)
        self.dots = np.zeros((self.k, self.k))
        self.norm2 = np.zeros(self.k)
        if xp.stock is not None:
            rows = xp.stock.filter(pa.compute.equal(xp.stock.column("tensor_idx"), ti)).to_pylist()
            for r in rows:
                if r["j"] == r["k"]:
                    self.norm2[r["j"]] = r["dot"]
                else:
                    self.dots[r["j"], r["k"]] += r["dot"]

    def add_block(self, deltas: list[tuple[int, np.ndarray]]) -> None:
        for a in range(len(deltas)):
            for b in range(a + 1, len(deltas)):
                (j, dj), (k, dk) = deltas[a], deltas[b]
                self.dots[min(j, k), max(j, k)] += float(np.dot(dj.astype(np.float64), dk.astype(np.float64)))

    def t(self) -> float:
        cos = []
        for j in range(self.k):
            for k in range(j + 1, self.k):
                den = np.sqrt(self.norm2[j] * self.norm2[k])
                cos.append(self.dots[j, k] / den if den > 0 else 0.0)
        c = float(np.mean(cos)) if cos else 0.0
        return self.k * c / (1 + (self.k - 1) * c) if 1 + (self.k - 1) * c != 0 else 0.0


def merge_to_dict(xp: ExecutionPlan, dtype: str | None = None) -> dict[str, np.ndarray]:
    """The merged model in memory: name -> float32 (mergeable) or raw-typed array (packed sub-byte
    dtypes such as F4 as their raw uint8 bytes). For embedding."""
    m = Merger(xp, dtype)
    try:
        out = {}
        for name, dt, shape, data in m.tensors(list(range(len(xp.tensors)))):
            if dt not in DTYPES:  # packed sub-byte dtype: no numpy type, keep the bytes
                out[name] = data
                continue
            arr = data.view(np.dtype(DTYPES[dt][1])).reshape(shape)
            out[name] = (arr.astype(np.uint32) << 16).view(np.float32) if dt == "BF16" else arr
        return out
    finally:
        m.close()


def execute(
    xp: ExecutionPlan,
    out: str | os.PathLike[str],
    *,
    max_shard_size: int = 5 * 10**9,
    dtype: str | None = None,
    verify: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    expect_hashes: dict[str, str] | None = None,
) -> ExecuteResult:
    """Merge into `out` (a new folder, or an old mergedb output with force=True), atomically.

    With `expect_hashes` (tensor name -> xxh3-128 of its bytes, as a manifest records them) the
    output is checked before it is installed: a mismatch raises and leaves nothing behind."""
    shown = Path(out)
    out = outdir.resolve_out(shown)
    out_dt = OUT_DTYPES.get(dtype, dtype) if dtype else None
    if out_dt is not None and out_dt not in OUT_DTYPES.values():
        raise MergeDBError(f"unknown --dtype {dtype!r}; use bf16, fp16 or fp32")
    outdir.check_clear_of(out, [xp.base.path, *(e.path for e in xp.experts)], "an input of this plan")
    if not force:
        outdir.check_out(out, force)  # early; with --force only after a killed run's swap is undone
    with outdir.output_lock(out):
        outdir.remove_stale(out)  # under the lock: what is left is a killed run's, never a live one's
        outdir.check_out(out, force)
        t0, phys0 = time.perf_counter(), physical_read_bytes()
        tmp = out.parent / f".{out.name}{outdir.TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        merger = None
        try:
            tmp.mkdir()
            merger = Merger(xp, out_dt, verify)
            manifest, run, written = _write(xp, merger, tmp, out, out_dt, max_shard_size, progress, expect_hashes)
            run["seconds"] = time.perf_counter() - t0
            run["physical_read_bytes"] = physical_read_bytes() - phys0
            write_json(tmp / MANIFEST, {**manifest, "run": run})
            outdir.fsync_dir(tmp)
            outdir.install(tmp, out)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise MergeDBError(f"writing {out} failed: {outdir.os_advice(e, out)}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if merger is not None:
                merger.close()
    return ExecuteResult(
        shown,
        manifest,
        run["seconds"],
        run["expert_bytes_logical"],
        run["physical_read_bytes"],
        run["base_bytes"],
        written,
        run["peak_rss_bytes"],
    )


def _write(
    xp: ExecutionPlan,
    merger: Merger,
    tmp: Path,
    out: Path,
    out_dt: str | None,
    max_shard_size: int,
    progress: Callable[[int], None] | None,
    expect_hashes: dict[str, str] | None,
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Write the merged model into `tmp` (all but the manifest); (manifest, run record, bytes written)."""
    groups = output_shards(xp, max_shard_size, out_dt)
    names = shard_names(len(groups))
    hashes: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    written = 0
    for fname, group in zip(names, groups):
        entries = [(xp.tensors[i].name, _out_dtype(xp.tensors[i], out_dt), xp.tensors[i].shape) for i in group]
        with SafetensorsWriter(tmp / fname, entries, {"format": "pt"}) as w:
            for name, _, _, data in merger.tensors(group):
                w.write(name, data)
                hashes[name] = xxhash.xxh3_128_hexdigest(data)
                weight_map[name] = fname
                if progress:
                    progress(1)
        written += w.total_size
    if len(groups) > 1:
        write_json(tmp / INDEX, {"metadata": {"total_size": written}, "weight_map": weight_map})
    base_root = open_checkpoint(xp.base.path).root
    for f in side_files(base_root):
        shutil.copyfile(base_root / f, tmp / f)
    pq.write_table(mask_table(xp), tmp / MASK)
    if expect_hashes is not None and hashes != expect_hashes:
        bad = sorted(n for n in expect_hashes.keys() | hashes.keys() if hashes.get(n) != expect_hashes.get(n))
        raise MergeDBError(
            f"the merge into {out} differs from the recorded one in tensors {bad[:5]}; nothing was installed "
            "(an input changed since, or the manifest does not describe these files)"
        )
    run = {
        "expert_bytes_logical": merger.count.expert,
        "base_bytes": merger.count.base,
        "bytes_written": written,
        "peak_rss_bytes": _peak_rss(),
        "files": sorted(p.name for p in tmp.iterdir()) + [MANIFEST],
    }
    return build_manifest(xp, out_dt, hashes), run, written


def replay(manifest_path: str | os.PathLike[str], out: str | os.PathLike[str], *, force: bool = False) -> ExecuteResult:
    """Re-execute an output from its manifest and mask, installing it only if every tensor hash matches."""
    xp, doc = plan_from_manifest(manifest_path)
    return execute(xp, out, dtype=doc["dtype"], force=force, expect_hashes=doc["tensor_hashes"])
