"""The executor: merge a plan into a Hugging-Face folder, reading only the planned expert bytes.

An `ExecutionPlan` (mergedb.manifest) is a plain value: parameters, file locations, the mask as
an Arrow table, no database. The merge is a stream of (name, tensor) pieces; writing safetensors
is one consumer of that stream, `merge_to_dict` another. The output folder is built under a
temporary name and put in place only when complete, by outdir.py (one writer per output, the
--force swap, recovery after a crash).

The merge itself (units of work, threads, fused kernels) is merger.py, imported when a merge
starts. fetchplan.Prefetch reads the merge's first bytes meanwhile: while numba's kernels import and
load (~0.2 s) where the C kernels cannot be built (kernels.py); with the C kernels (~1 ms to load)
its four streams just read ahead of the merger (the executor's seconds count both).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq
import xxhash

from . import fetchplan, methods, outdir, sidefiles
from .checkpoint import INDEX, file_times, open_checkpoint
from .errors import ChangedFileError, MergeDBError
from .jsondoc import write_json
from .layout import output_dtype, shard_groups, shard_names
from .manifest import (
    MANIFEST,
    MASK,
    ExecutionPlan,
    build_manifest,
    mask_table,
    plan_from_manifest,
    run_seal,
)
from .measure import peak_rss, physical_read_bytes
from .sidefiles import TEMPLATES, copy_side_files
from .tensorfile import DTYPES, PT_METADATA, FileRange, SafetensorsWriter, normalize_dtype, tensor_nbytes
from .units import check_threads

if TYPE_CHECKING:
    from .merger import FoldBlock, Merger, ReadBlock


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


def output_shards(xp: ExecutionPlan, max_shard_size: int, dtype: str | None = None) -> list[list[int]]:
    """Tensor indices grouped into output shards of at most `max_shard_size` bytes (in order)."""
    sizes = [tensor_nbytes(output_dtype(t, dtype), t.shape) for t in xp.tensors]
    return shard_groups(sizes, max_shard_size)


def _check_plan(xp: Any, fn: str) -> None:
    """Refuse what is not an ExecutionPlan, naming what to pass (a plan id fails deep inside otherwise)."""
    if not isinstance(xp, ExecutionPlan):
        raise MergeDBError(
            f"executor.{fn}() takes an ExecutionPlan (Catalog.execution_plan(PLAN)), got {type(xp).__name__}; "
            "Catalog.execute(PLAN, OUT) runs a plan by its id or name"
        )


def merge_to_dict(
    xp: ExecutionPlan,
    dtype: str | None = None,
    threads: int | None = None,
    read_block: ReadBlock | None = None,
    on_tensor: Callable[[], None] | None = None,
    fold_block: FoldBlock | None = None,
) -> dict[str, np.ndarray]:
    """The merged model in memory: name -> float32 (mergeable) or raw-typed array (packed sub-byte
    dtypes such as F4 as their raw uint8 bytes). For embedding. `read_block`: see merger.ReadBlock;
    `on_tensor` is called after each tensor (a sweep paces its plans with it); `fold_block`: see
    merger.FoldBlock."""
    _check_plan(xp, "merge_to_dict")
    if on_tensor is not None and not callable(on_tensor):  # it would fail after the first tensor
        raise MergeDBError(f"merge_to_dict() on_tensor is a function or None, got {type(on_tensor).__name__}")
    from .merger import Merger

    m = Merger(xp, dtype, threads=threads, read_block=read_block, fold_block=fold_block)
    try:
        state = {}
        for name, dt, shape, data in m.tensors(list(range(len(xp.tensors)))):
            state[name] = tensor_array(dt, shape, data)
            if on_tensor is not None:
                on_tensor()
        return state
    finally:
        m.close()


def tensor_array(dt: str, shape: tuple[int, ...], data: np.ndarray) -> np.ndarray:
    """A merged tensor's bytes as an array: float32 for BF16, its own type otherwise (packed sub-byte
    dtypes such as F4, which have no numpy type, stay raw uint8 bytes)."""
    if dt not in DTYPES:
        return data
    arr = data.view(np.dtype(DTYPES[dt][1])).reshape(shape)
    return (arr.astype(np.uint32) << 16).view(np.float32) if dt == "BF16" else arr


def refuse_lost_side_files(xp: ExecutionPlan) -> None:
    """Refuse a plan whose local base lost a side file (config.json, tokenizer) since it was
    registered: the output would lack it and look complete (a model without config.json does not
    load). Known for plans read from a catalog (ExecutionPlan.side_files), not for a manifest's."""
    if xp.side_files is not None and "://" not in xp.side_files[0]:
        sidefiles.refuse_lost(xp.base.name, *xp.side_files)


def execute(
    xp: ExecutionPlan,
    out: str | os.PathLike[str],
    *,
    max_shard_size: int = 5 * 10**9,
    dtype: str | None = None,
    verify: bool = False,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
    expect_hashes: dict[str, str] | None = None,
    expect_side: dict[str, str] | None = None,
    threads: int | None = None,
    unit_order_seed: int | None = None,
    read_block: ReadBlock | None = None,
    write_shards: WriteShards | None = None,
    fold_block: FoldBlock | None = None,
) -> ExecuteResult:
    """Merge into `out` (a new folder, or an old mergedb output with force=True), atomically.

    With `expect_hashes` (tensor name -> xxh3-128 of its bytes, as a manifest records them) the
    output is checked before it is installed: a mismatch raises and leaves nothing behind; so is
    each side file (config, tokenizer) with `expect_side` (name -> sha256, as run.side_files records).
    `on_total(n)` is told the output's tensor bytes first, then `progress(k)` each tensor's bytes
    as it is written (for a byte-based progress bar).
    `threads` compute threads (default: os.cpu_count()) merge; the output's bytes and manifest do
    not depend on it, nor on `unit_order_seed` (shuffles the order units are run in; for tests).
    `read_block` serves expert blocks instead of reading them (merger.ReadBlock; a sweep's shared reads),
    `fold_block` their folded sums (merger.FoldBlock; a sweep's shared folds).
    `write_shards` writes the shards elsewhere than in this process (rayexec.py; see WriteShards):
    `threads`, `unit_order_seed`, `read_block` and `fold_block` are then its business, not this function's;
    `verify=True` then needs a writer that verifies (rayexec.shard_writer(verify=True)), else is refused."""
    outdir.check_run_args(
        "executor.execute()",
        out,
        max_shard_size,
        flags={"verify": verify, "force": force},
        calls={"progress": progress, "on_total": on_total, "write_shards": write_shards},
    )
    max_shard_size = int(max_shard_size)  # a numpy whole number is one (it is written into the manifest's JSON)
    _check_plan(xp, "execute")
    refuse_lost_side_files(xp)
    if verify and write_shards is not None and not getattr(write_shards, "verifies", False):
        raise MergeDBError(  # silently unverified before: the shards' writer reads the experts, not this call
            "verify=True with write_shards: the shards' writer reads the experts, so it must verify them "
            "(rayexec.shard_writer(..., verify=True)); nothing was read or written"
        )
    if threads is not None:
        check_threads(threads)
    shown = Path(out)
    out = outdir.resolve_out(shown)
    out_dt = normalize_dtype(dtype)
    outdir.check_clear_of(out, [xp.base.path, *(e.path for e in xp.experts)], "an input of this plan")
    if not force:
        outdir.check_out(out, force)  # early; with --force only after a killed run's swap is undone
    with outdir.output_lock(out):
        outdir.remove_stale(out)  # under the lock: what is left is a killed run's, never a live one's
        outdir.check_out(out, force)
        t0, phys0 = time.perf_counter(), physical_read_bytes()
        tmp = outdir.temp_folder(out)
        inputs = file_times((src.name, src.path) for src in (xp.base, *xp.experts))  # compared after the merge
        merger = prefetch = None
        ok = False
        try:
            tmp.mkdir()
            if write_shards is None:
                if read_block is None and fold_block is None:  # (a sweep's reads are shared, not ours)
                    prefetch = fetchplan.Prefetch(xp)  # reads while the merge engine imports and loads
                from .merger import Merger

                merger = Merger(xp, out_dt, verify, threads, unit_order_seed, read_block, fold_block)
                write_shards = functools.partial(_write_shards_here, merger)
            if on_total:
                on_total(sum(tensor_nbytes(output_dtype(t, out_dt), t.shape) for t in xp.tensors))
            manifest, run, shards = _write(
                xp, write_shards, tmp, out, out_dt, max_shard_size, progress, expect_hashes, expect_side
            )
            written = shards.written
            _refuse_changed_while_read(xp, inputs)  # before the output is installed as a merge of its inputs
            run["seconds"] = time.perf_counter() - t0
            run["physical_read_bytes"] = physical_read_bytes() - phys0 + shards.physical_bytes
            write_json(tmp / MANIFEST, {**manifest, "run": run})
            outdir.fsync_dir(tmp)
            outdir.install(tmp, out, force)
            ok = True
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise MergeDBError(f"writing {out} failed: {outdir.os_advice(e, out)}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if merger is not None:
                merger.close(wait=ok)
            if prefetch is not None:
                prefetch.close()
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


def _refuse_changed_while_read(xp: ExecutionPlan, before: dict[tuple[str, str], Any]) -> None:
    """Refuse an output whose local inputs changed while they were read (a training job saving into an
    expert's file): it would merge neither version, yet look complete and pass `check --output`, which
    compares the output with its own manifest. Their fingerprints were checked when they were opened
    (after `before` was taken); their files' sizes and times are compared again after the last read."""
    after = file_times((src.name, src.path) for src in (xp.base, *xp.experts))
    changed = [k for k in before.keys() | after.keys() if before.get(k) != after.get(k)]
    if changed:
        name, _ = min(changed)
        src = next(s for s in (xp.base, *xp.experts) if s.name == name)
        raise ChangedFileError(
            f"{src.name} ({src.path}) changed while this merge read it (its files' sizes or times); "
            "nothing was installed: run again once nothing writes it (re-register it with `mergedb register "
            "--refresh` and plan again if its new weights are to be merged)"
        )


@dataclass(frozen=True)
class ShardsWritten:
    """What writing an output's shards produced: each tensor's xxh3-128 and shard file, the bytes
    written, and the reads it took (expert and base bytes requested; `physical_bytes` fetched by
    processes other than this one, which measures its own)."""

    hashes: dict[str, str]
    weight_map: dict[str, str]
    written: int
    expert_bytes: int
    base_bytes: int
    physical_bytes: int = 0
    peak_rss: int = 0  # the largest peak resident set of the processes that merged (0: this one)
    remote_fetched: int | None = None  # tensor bytes fetched from URLs (None: no input is remote)


# write_shards(xp, groups, names, tmp, dtype, progress): write shard names[i] holding the tensors
# groups[i] (indices into xp.tensors) into the folder `tmp`, each complete when this returns, and
# call progress(n) with each tensor's bytes. The local one merges here (_write_shards_here); a Ray
# one runs a task per shard (rayexec.py).
WriteShards = Callable[
    [ExecutionPlan, list[list[int]], list[str], Path, "str | None", "Callable[[int], None] | None"], ShardsWritten
]


def write_shard(
    merger: Merger,
    xp: ExecutionPlan,
    group: list[int],
    path: Path,
    dtype: str | None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, str], int]:
    """Merge the tensors `group` into the safetensors file `path`; (tensor name -> xxh3-128, bytes written)."""
    entries = [(xp.tensors[i].name, output_dtype(xp.tensors[i], dtype), xp.tensors[i].shape) for i in group]
    hashes: dict[str, str] = {}
    with SafetensorsWriter(path, entries, PT_METADATA) as w:
        for name, _, _, data in merger.tensors(group, copy=True):
            if isinstance(data, FileRange):  # untouched: the base's bytes, copied file to file
                w.copy(name, data)
                hashes[name] = hash_range(data)
            else:
                w.write(name, data)
                hashes[name] = xxhash.xxh3_128_hexdigest(data)
            if progress:
                progress(data.nbytes)
    return hashes, w.total_size


def hash_range(r: FileRange) -> str:
    """xxh3-128 of a file range, read through a read-only mapping (the page cache's own pages, no copy
    into this process; the copy before it has just brought them in, except after a reflink)."""
    if r.nbytes == 0:
        return xxhash.xxh3_128_hexdigest(b"")
    start = r.offset - r.offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(r.fd, r.offset + r.nbytes - start, access=mmap.ACCESS_READ, offset=start) as mm:
        view = memoryview(mm)[r.offset - start :]
        try:
            return xxhash.xxh3_128_hexdigest(view)
        finally:
            view.release()


def write_shard_files(
    merger: Merger,
    xp: ExecutionPlan,
    groups: list[list[int]],
    names: list[str],
    tmp: Path,
    dtype: str | None,
    progress: Callable[[int], None] | None,
) -> tuple[dict[str, str], dict[str, str], int]:
    """write_shard for each shard `names[i]` of tensors `groups[i]`: (tensor -> hash, tensor -> shard
    file, bytes written)."""
    hashes: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    written = 0
    for fname, group in zip(names, groups):
        h, n = write_shard(merger, xp, group, tmp / fname, dtype, progress)
        hashes.update(h)
        weight_map.update(dict.fromkeys(h, fname))
        written += n
    return hashes, weight_map, written


def _write_shards_here(
    merger: Merger,
    xp: ExecutionPlan,
    groups: list[list[int]],
    names: list[str],
    tmp: Path,
    dtype: str | None,
    progress: Callable[[int], None] | None,
) -> ShardsWritten:
    hashes, weight_map, written = write_shard_files(merger, xp, groups, names, tmp, dtype, progress)
    fetched = merger.inputs.fetched if merger.inputs.sources.any_remote else None
    return ShardsWritten(hashes, weight_map, written, merger.count.expert, merger.count.base, remote_fetched=fetched)


def _write(
    xp: ExecutionPlan,
    write_shards: WriteShards,
    tmp: Path,
    out: Path,
    out_dt: str | None,
    max_shard_size: int,
    progress: Callable[[int], None] | None,
    expect_hashes: dict[str, str] | None,
    expect_side: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], ShardsWritten]:
    """Write the merged model into `tmp` (all but the manifest); (manifest, run record, shards)."""
    groups = output_shards(xp, max_shard_size, out_dt)
    names = shard_names(len(groups))
    shards = write_shards(xp, groups, names, tmp, out_dt, progress)
    hashes, weight_map, written = shards.hashes, shards.weight_map, shards.written
    if len(groups) > 1:
        write_json(tmp / INDEX, {"metadata": {"total_size": written}, "weight_map": weight_map})
    copied = copy_side_files(open_checkpoint(xp.base.path).root, tmp, out_dt)
    if expect_side is not None:  # a replay writes the side files its output had, not those a newer
        for f in set(copied) - expect_side.keys():  # mergedb copies too (chat templates, custom code)
            (tmp / f).unlink()
        with contextlib.suppress(OSError):  # the templates' folder, if that emptied it
            (tmp / TEMPLATES).rmdir()
        copied = [f for f in copied if f in expect_side]
    side = {f: hashlib.sha256((tmp / f).read_bytes()).hexdigest() for f in copied}
    if expect_side is not None and side != expect_side:
        bad = sorted(n for n in side.keys() | expect_side.keys() if side.get(n) != expect_side.get(n))
        raise MergeDBError(
            f"the base's side files {bad} differ from those the replayed output was written with (edited since?); "
            f"nothing was installed in {out}: restore them, or execute the plan again for an output with the "
            "current ones"
        )
    pq.write_table(mask_table(xp), tmp / MASK)
    if expect_hashes is not None and hashes != expect_hashes:
        bad = sorted(n for n in expect_hashes.keys() | hashes.keys() if hashes.get(n) != expect_hashes.get(n))
        raise MergeDBError(
            f"the merge into {out} differs from the recorded one in tensors {bad[:5]}; nothing was installed "
            "(an input changed since, or the manifest does not describe these files)"
        )
    run = {
        "expert_bytes_logical": shards.expert_bytes,
        "base_bytes": shards.base_bytes,
        "bytes_written": written,
        "peak_rss_bytes": max(peak_rss(), shards.peak_rss),
        "max_shard_size": max_shard_size,  # replay writes the same shards
        "side_files": side,
        **({"remote_bytes_fetched": shards.remote_fetched} if shards.remote_fetched is not None else {}),
        "files": sorted(p.name for p in tmp.iterdir()) + [MANIFEST],
        "file_stats": outdir.file_stats(tmp),  # what --force may replace: the files as written (outdir._edited)
    }
    # a DARE/DELLA output names its random stream (`rng`), so a replay by a mergedb that draws differently
    # refuses instead of writing other bytes; `sealed_run`: run_seal covers what replay and check take from run
    extra = {"rng": methods.RNG} if methods.get_method(xp.method).draws else {}
    doc = build_manifest(xp, out_dt, hashes, {**extra, "sealed_run": True})
    return doc, {**run, "seal": run_seal(run)}, shards


def _check_rng(path: str | os.PathLike[str], xp: ExecutionPlan, doc: dict[str, Any]) -> None:
    if methods.get_method(xp.method).draws and doc.get("rng") != methods.RNG:
        wrote = doc.get("rng") or "splitmix64 (mergedb before manifests named their stream)"
        raise MergeDBError(
            f"{path}: this {xp.method} output's random draws come from the stream {wrote!r}, but this "
            f"mergedb draws from {methods.RNG!r}, so a replay would write other bytes; replay it with the "
            "mergedb version that wrote it, or execute the plan again to get a new, replayable output"
        )


def replay(
    manifest_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ExecuteResult:
    """Re-execute an output from its manifest and mask, installing it only if every tensor hash
    matches; `progress` and `on_total` as execute's."""
    calls = {"progress": progress, "on_total": on_total}
    outdir.check_run_args("replay()", out, 0, flags={"force": force}, calls=calls)
    if not isinstance(manifest_path, (str, os.PathLike)):  # Path(None) was a bare TypeError
        raise MergeDBError(f"replay() reads an output's manifest (str or Path), got {type(manifest_path).__name__}")
    xp, doc = plan_from_manifest(manifest_path)
    if "lora" in doc:  # an --as-lora output: an adapter folder, not a model
        raise MergeDBError(
            f"{manifest_path} describes a LoRA adapter output (execute --as-lora), not a model; replay it with "
            "`mergedb replay` or mergedb.loraout.replay"
        )
    _check_rng(manifest_path, xp, doc)
    run = doc.get("run") if isinstance(doc.get("run"), dict) else {}  # outputs before these were recorded: defaults
    shard = run.get("max_shard_size")
    side = run.get("side_files")
    return execute(
        xp,
        out,
        dtype=doc["dtype"],
        force=force,
        expect_hashes=doc["tensor_hashes"],
        max_shard_size=shard if isinstance(shard, int) and not isinstance(shard, bool) and shard >= 0 else 5 * 10**9,
        expect_side=side if isinstance(side, dict) else None,
        progress=progress,
        on_total=on_total,
    )
