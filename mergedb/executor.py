"""The executor: merge a plan into a Hugging-Face folder, reading only the planned expert bytes.

An `ExecutionPlan` is a plain value (parameters, file locations, the mask as an Arrow table): it
needs no database, so the same code runs here or on remote workers. The merge is a stream of
(name, tensor) pieces produced by independent units of work (the tensors bound for one output
shard); writing safetensors is one consumer of that stream, `merge_to_dict` another.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
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

from . import methods
from .checkpoint import INDEX, open_checkpoint, side_files
from .errors import ChangedFileError, MergeDBError
from .tensorfile import DTYPES, SafetensorsWriter, TensorInfo, as_float32, encode, pread_into

MANIFEST = "mergedb_manifest.json"
MASK = "mask.parquet"
FORMAT = "mergedb-manifest/1"
OUT_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
READ_AHEAD = 3  # expert blocks in flight ahead of the arithmetic


@dataclass(frozen=True)
class Source:
    """A checkpoint the merge reads."""

    name: str
    path: str
    fingerprint: str
    content_hash: str
    weight: float = 0.0
    coef: float = 0.0


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the family and its blocks (dim-0 row ranges)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    mergeable: bool
    rows: tuple[tuple[int, int], ...]
    base_hashes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExecutionPlan:
    """Everything a merge needs, without a catalog. `mask` lists the selected (position,
    tensor_idx, block_idx, content_hash); `trims` the per-(position, tensor_idx) thresholds."""

    plan_id: int
    plan_hash: str
    method: str
    params: dict[str, Any]
    seed: int
    base: Source
    experts: tuple[Source, ...]
    tensors: tuple[TensorLayout, ...]
    mask: pa.Table
    trims: pa.Table
    budget_bytes: int = 0
    stock: pa.Table | None = None  # model_stock: (tensor_idx, j, k, dot) over blocks not both read,
    # from sketches, with j == k rows holding the exact ‖Δ_k‖² of the whole tensor

    def selected(self) -> dict[int, dict[int, list[tuple[int, str]]]]:
        """tensor_idx -> block_idx -> [(position, content_hash)] in plan order."""
        out: dict[int, dict[int, list[tuple[int, str]]]] = {}
        cols = [self.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx", "content_hash")]
        for pos, t, b, h in sorted(zip(*cols)):
            out.setdefault(t, {}).setdefault(b, []).append((pos, h))
        return out


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


def _read_bytes() -> int:
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
            self.where.append({t.name: (fds[fi], t, str(ckpt.root / ckpt.files[fi].relpath)) for fi, t in ckpt.tensors})

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def _row_elems(t: TensorLayout) -> int:
    return int(np.prod(t.shape[1:])) if len(t.shape) >= 2 else int(np.prod(t.shape))


def units(xp: ExecutionPlan, max_shard_size: int, dtype: str | None = None) -> list[list[int]]:
    """Tensor indices grouped into output shards of at most `max_shard_size` bytes (in order)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, t in enumerate(xp.tensors):
        nbytes = int(np.prod(t.shape)) * DTYPES[_out_dtype(t, dtype)][0]
        if groups[-1] and used + nbytes > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += nbytes
    return groups


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
            row_bytes = info.nbytes // max(1, t.shape[0] if len(t.shape) >= 2 else 1)
            for b, (r0, r1) in enumerate(t.rows):
                if xxhash.xxh3_128_hexdigest(base[r0 * row_bytes : r1 * row_bytes]) != t.base_hashes[b]:
                    raise ChangedFileError(
                        f"{path}: block {b} of {t.name!r} changed since registration; register the base again"
                    )
        return base

    def _read_one(self, ti: int, b: int, pos: int, h: str) -> np.ndarray:
        """Expert `pos`'s bytes of block `b` of tensor `ti` (checked against `h` with --verify)."""
        t = self.xp.tensors[ti]
        r0, r1 = t.rows[b]
        fd, info, path = self.inputs.where[pos + 1][t.name]
        row_bytes = info.nbytes // max(1, t.shape[0] if len(t.shape) >= 2 else 1)
        raw = np.empty((r1 - r0) * row_bytes, np.uint8)
        pread_into(fd, memoryview(raw), info.start + r0 * row_bytes, path)
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
        per_row = _row_elems(t)
        reads = self._reads(ti, [(b, pos, h) for b in blocks for pos, h in selected.get(b, [])])
        for b in blocks:
            r0, r1 = t.rows[b]
            lo, n = r0 * per_row, (r1 - r0) * per_row
            base = as_float32(base_raw.view(raw_dt)[lo : lo + n], t.dtype, np.empty(n, np.float32))  # (n,) f32
            acc = methods.Accumulator(self.method, self.xp.params, n)
            deltas = []
            for pos, raw in itertools.islice(reads, len(selected.get(b, []))):
                d = as_float32(raw.view(raw_dt), t.dtype, self._scratch("e", n))
                np.subtract(d, base, out=d)  # Δ in place: (n,) float32
                src = self.xp.experts[pos]
                d = methods.sparsify(self.method, self.xp.params, d, lo, self._trim(pos, ti, t, src))
                acc.add(src.coef, src.weight, 0, d)
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

    def _trim(self, pos: int, ti: int, t: TensorLayout, src: Source) -> methods.Trim:
        r = self.trims.get((pos, ti))
        key = methods.rng_key(self.xp.seed, src.name, t.name)
        if r is None:
            return methods.Trim(key=key)
        rank = None
        if r.get("rank_codes") is not None:
            codes = np.asarray(r["rank_codes"], np.int64)
            counts = np.asarray(r["rank_counts"], np.float64)
            below = np.zeros(1 << 15)
            np.add.at(below, codes, counts)
            cum = (np.cumsum(below) - below / 2) / max(1.0, counts.sum())

            def rank(a: np.ndarray, cum: np.ndarray = cum) -> np.ndarray:
                return cum[np.asarray(a, np.float32).view(np.uint32) >> 17]

        return methods.Trim(r["t_lo"] or 0.0, r["t_hi"], key, rank)


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
    """The merged model in memory: name -> float32 (mergeable) or raw-typed array. For embedding."""
    m = Merger(xp, dtype)
    try:
        out = {}
        for name, dt, shape, data in m.tensors(list(range(len(xp.tensors)))):
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
) -> ExecuteResult:
    """Merge into `out` (a new folder, or an old mergedb output with force=True), atomically."""
    out = Path(out)
    out_dt = OUT_DTYPES.get(dtype, dtype) if dtype else None
    if out_dt is not None and out_dt not in OUT_DTYPES.values():
        raise MergeDBError(f"unknown --dtype {dtype!r}; use bf16, fp16 or fp32")
    _check_out(out, force)
    t0, phys0 = time.perf_counter(), _read_bytes()
    _remove_stale_temps(out)
    tmp = out.parent / f".{out.name}.mergedb-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    merger = None
    try:
        merger = Merger(xp, out_dt, verify)
        groups = units(xp, max_shard_size, out_dt)
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
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
            _write_json(tmp / INDEX, {"metadata": {"total_size": written}, "weight_map": weight_map})
        base_root = open_checkpoint(xp.base.path).root
        for f in side_files(base_root):
            shutil.copyfile(base_root / f, tmp / f)
        pq.write_table(mask_table(xp), tmp / MASK)
        manifest = build_manifest(xp, out_dt, hashes)
        run = {
            "seconds": time.perf_counter() - t0,
            "expert_bytes_logical": merger.count.expert,
            "physical_read_bytes": _read_bytes() - phys0,
            "base_bytes": merger.count.base,
            "bytes_written": written,
            "peak_rss_bytes": _peak_rss(),
            "files": sorted(p.name for p in tmp.iterdir()) + [MANIFEST],
        }
        _write_json(tmp / MANIFEST, {**manifest, "run": run})
        _fsync_dir(tmp)
        _install(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MergeDBError(
            f"writing {out} failed: {e.strerror or e}; nothing was left behind, free space and retry"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if merger is not None:
            merger.close()
    return ExecuteResult(
        out,
        manifest,
        run["seconds"],
        run["expert_bytes_logical"],
        run["physical_read_bytes"],
        run["base_bytes"],
        written,
        run["peak_rss_bytes"],
    )


def _remove_stale_temps(out: Path) -> None:
    """Remove temporary folders that an earlier, killed mergedb left for this output."""
    if not out.parent.is_dir():
        return
    for p in [*out.parent.glob(f".{out.name}.mergedb-tmp-*"), *out.parent.glob(f".{out.name}.mergedb-old-*")]:
        try:
            pid = int(p.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)  # its process is gone: a crash left it
        except (ValueError, PermissionError, IndexError):
            continue  # not ours to judge


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise MergeDBError(
                f"{out} exists and is not empty; choose another --out or pass --force to replace a "
                "previous mergedb output"
            )
        if not (out / MANIFEST).is_file():
            raise MergeDBError(
                f"{out} holds files mergedb did not create (no {MANIFEST}); refusing to touch it "
                "even with --force; choose another --out"
            )


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place. An old mergedb output there is swapped out by two
    renames (files it did not create are carried over first), then removed."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(tmp, out)
        return
    ours = set(json.loads((out / MANIFEST).read_text()).get("run", {}).get("files", [])) | {MANIFEST}
    for p in out.iterdir():
        if p.name not in ours and not (tmp / p.name).exists():
            os.rename(p, tmp / p.name)  # not ours: keep it
    old = out.parent / f".{out.name}.mergedb-old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _fsync_dir(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def mask_table(xp: ExecutionPlan) -> pa.Table:
    """The replayable mask: selected blocks with their row ranges and content hashes."""
    pos = xp.mask.column("position").to_pylist()
    tix = xp.mask.column("tensor_idx").to_pylist()
    bix = xp.mask.column("block_idx").to_pylist()
    return pa.table(
        {
            "expert": [xp.experts[p].name for p in pos],
            "position": pa.array(pos, pa.int32()),
            "tensor": [xp.tensors[t].name for t in tix],
            "tensor_idx": pa.array(tix, pa.int32()),
            "block_idx": pa.array(bix, pa.int32()),
            "row_start": pa.array([xp.tensors[t].rows[b][0] for t, b in zip(tix, bix)], pa.int64()),
            "row_end": pa.array([xp.tensors[t].rows[b][1] for t, b in zip(tix, bix)], pa.int64()),
            "content_hash": xp.mask.column("content_hash"),
        }
    ).sort_by([("position", "ascending"), ("tensor_idx", "ascending"), ("block_idx", "ascending")])


def build_manifest(xp: ExecutionPlan, dtype: str | None, tensor_hashes: dict[str, str]) -> dict[str, Any]:
    """The deterministic part of the manifest, with a content hash over all of it."""
    mask = mask_table(xp)
    digest = hashlib.sha256()
    for c in ("position", "tensor_idx", "block_idx"):
        digest.update(mask.column(c).to_numpy().astype("<i8").tobytes())
    doc: dict[str, Any] = {
        "format": FORMAT,
        "plan_hash": xp.plan_hash,
        "method": xp.method,
        "params": xp.params,
        "seed": xp.seed,
        "dtype": dtype,
        "budget_bytes": xp.budget_bytes,
        "base": _source_doc(xp.base),
        "experts": [_source_doc(e) for e in xp.experts],
        "layout": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "mergeable": t.mergeable,
                "rows": [list(r) for r in t.rows],
                "base_hashes": list(t.base_hashes),
            }
            for t in xp.tensors
        ],
        "trims": xp.trims.to_pylist(),
        "stock": xp.stock.to_pylist() if xp.stock is not None else None,
        "mask_digest": digest.hexdigest(),
        "tensor_hashes": tensor_hashes,
    }
    doc["content_hash"] = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return doc


def _source_doc(s: Source) -> dict[str, Any]:
    return {
        "name": s.name,
        "path": s.path,
        "fingerprint": s.fingerprint,
        "content_hash": s.content_hash,
        "weight": s.weight,
        "coef": s.coef,
    }


def plan_from_manifest(manifest_path: str | os.PathLike[str]) -> tuple[ExecutionPlan, dict[str, Any]]:
    """Rebuild the ExecutionPlan of an output from its manifest and mask alone (no catalog)."""
    path = Path(manifest_path)
    try:
        doc = json.loads(path.read_text())
        mask = pq.read_table(path.parent / MASK)
    except (OSError, ValueError) as e:
        raise MergeDBError(f"cannot read {path} or its {MASK}: {e}") from None
    if doc.get("format") != FORMAT:
        raise MergeDBError(f"{path}: not a {FORMAT} manifest")
    tensors = tuple(
        TensorLayout(
            t["name"],
            t["dtype"],
            tuple(t["shape"]),
            t["mergeable"],
            tuple(tuple(r) for r in t["rows"]),
            tuple(t["base_hashes"]),
        )
        for t in doc["layout"]
    )
    trims = pa.Table.from_pylist(doc["trims"]) if doc["trims"] else _empty_trims()
    xp = ExecutionPlan(
        0,
        doc["plan_hash"],
        doc["method"],
        doc["params"],
        doc["seed"],
        Source(**doc["base"]),
        tuple(Source(**e) for e in doc["experts"]),
        tensors,
        mask.select(["position", "tensor_idx", "block_idx", "content_hash"]),
        trims,
        doc["budget_bytes"],
        pa.Table.from_pylist(doc["stock"]) if doc.get("stock") else None,
    )
    return xp, doc


def _empty_trims() -> pa.Table:
    return pa.table(
        {
            "position": pa.array([], pa.int32()),
            "tensor_idx": pa.array([], pa.int32()),
            "t_lo": pa.array([], pa.float32()),
            "t_hi": pa.array([], pa.float32()),
        }
    )


def replay(manifest_path: str | os.PathLike[str], out: str | os.PathLike[str], *, force: bool = False) -> ExecuteResult:
    """Re-execute an output from its manifest and mask, and check every tensor hash matches."""
    xp, doc = plan_from_manifest(manifest_path)
    res = execute(xp, out, dtype=doc["dtype"], force=force)
    if res.manifest["tensor_hashes"] != doc["tensor_hashes"]:
        bad = [n for n, h in doc["tensor_hashes"].items() if res.manifest["tensor_hashes"].get(n) != h]
        raise MergeDBError(f"replay into {out} differs from the original in tensors {bad[:5]}")
    return res


def check_output(folder: str | os.PathLike[str]) -> list[str]:
    """Problems of a merged output against its manifest (empty when it is intact)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return [f"{folder}: no {MANIFEST}: not a complete mergedb output"]
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        return [f"{path}: not valid JSON ({e})"]
    problems = []
    det = {k: v for k, v in doc.items() if k not in ("run", "content_hash")}
    if hashlib.sha256(json.dumps(det, sort_keys=True).encode()).hexdigest() != doc.get("content_hash"):
        problems.append(f"{path}: content_hash does not match the manifest's contents (edited?)")
    try:
        mask = pq.read_table(folder / MASK)
        digest = hashlib.sha256()
        for c in ("position", "tensor_idx", "block_idx"):
            digest.update(mask.column(c).to_numpy().astype("<i8").tobytes())
        if digest.hexdigest() != doc.get("mask_digest"):
            problems.append(f"{folder / MASK}: does not match the manifest's mask digest")
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"{folder / MASK}: cannot be read ({e})")
    from .tensorfile import read_header

    seen = {}
    for f in sorted(folder.glob("*.safetensors")):
        try:
            h = read_header(f)
        except MergeDBError as e:
            problems.append(str(e))
            continue
        with open(f, "rb") as fh:
            for t in h.tensors:
                fh.seek(t.start)
                seen[t.name] = xxhash.xxh3_128_hexdigest(fh.read(t.nbytes))
    for name, want in doc.get("tensor_hashes", {}).items():
        if name not in seen:
            problems.append(f"{folder}: tensor {name!r} is missing")
        elif seen[name] != want:
            problems.append(f"{folder}: tensor {name!r} differs from the manifest")
    return problems
