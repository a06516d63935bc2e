"""Running a merge and a registration on Ray (the optional extra `mergedb[ray]`).

Execution: one Ray task per output shard (executor.output_shards). Each task opens the plan's
inputs itself (so they must live on storage every node can reach: a shared filesystem, or
object storage through the remote-checkpoint readers), merges its tensors with the same Merger
the local executor uses, and writes its shard into the run's temporary output folder under a
private name, then renames it to the shard's name: a task Ray retries after its worker died
rewrites the shard whole, and what a killed attempt left half-written is removed before the
folder is installed. The driver does everything else exactly as a local run does (executor.py
and outdir.py: the lock, the index, the mask, the manifest, the atomic install), so the output's
bytes and the manifest's deterministic part are the local executor's. A task that raises fails
the run: the other tasks are cancelled and waited for, then the temporary folder is removed.

Registration: one Ray task per expert runs the local scan (scan.scan_experts) on that expert and
returns its rows; the driver hands each expert's rows to the registration's sink as its task ends
(staged on disk: staging.py) and alone writes the catalog, in one transaction (register.py).

`address`: "local" starts a Ray instance in this process's machine for the call; "auto" joins
the cluster this machine belongs to; anything else is passed to ray.init (e.g. "ray://head:10001"
or "head:6379"). When Ray is already initialized in this process (a notebook, a test), that
session is used whatever the address, and left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .checkpoint import Checkpoint
from .errors import MergeDBError
from .executor import ShardsWritten, WriteShards, write_shard
from .layout import FamilyTensor
from .manifest import ExecutionPlan
from .measure import peak_rss, physical_read_bytes
from .merger import Merger, output_dtype
from .remote import is_url
from .tensorfile import tensor_nbytes
from .units import check_threads

RETRIES = 3  # times Ray reruns a task whose worker process died (an exception is never retried)
PART = ".mergedb-part-"  # a shard being written by a task: `.NAME.mergedb-part-XXXXXXXX`
INSTALL_HINT = "pip install 'mergedb[ray]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MergeDBError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@contextlib.contextmanager
def session(address: str | None) -> Iterator[Any]:
    """The `ray` module, connected: to the running session if there is one (left running), else to
    `address` ("local", "auto" or a cluster address; None: "local"), shut down on exit."""
    ray = _ray()
    if ray.is_initialized():
        yield ray
        return
    _check_reachable(address)
    try:
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise MergeDBError(
            f"cannot connect to Ray at {address!r} ({e}); pass --ray local to start one on this machine, "
            "--ray auto to join this machine's cluster, or the head's address (e.g. ray://head:10001)"
        ) from None
    except OSError as e:  # its session folder: not the output's fault, which an OSError would be taken for
        where = os.environ.get("RAY_TMPDIR") or "/tmp/ray"
        raise MergeDBError(
            f"Ray could not start ({e.strerror or e}: {e.filename or where}); its session folder ({where}) may "
            "belong to another user or not be a folder: set RAY_TMPDIR to a folder of yours and retry"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _check_reachable(address: str | None) -> None:
    """Refuse a head address (`host:port` or `ray://host:port`) that nothing answers on within a few
    seconds: ray.init would keep retrying it for minutes."""
    if address in (None, "local", "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise MergeDBError(
            f"--ray {address!r} is not a Ray address: pass local, auto, HOST:PORT (the head's GCS, e.g. "
            "head:6379) or ray://HOST:PORT (Ray Client, e.g. ray://head:10001)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            greeting = _greeting(conn)
    except OSError as e:
        raise MergeDBError(
            f"cannot reach the Ray head at {address} ({e.strerror or e}); check the address and that the "
            "cluster is up (`ray status` on the head), or pass --ray local to start one on this machine"
        ) from None
    tls = os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")  # a TLS server waits for the client
    if not tls and not (len(greeting) >= 9 and greeting[3] == 4):  # no HTTP/2 SETTINGS frame: not gRPC
        raise MergeDBError(
            f"{address} answers, but not as a Ray head (Ray's GCS and Ray Client speak gRPC, which greets at "
            "once; ray.init would wait on it forever): pass the head's GCS address (head:6379) or Ray Client's "
            "(ray://head:10001), not the dashboard's (8265)"
        )


def _greeting(conn: socket.socket, seconds: float = 3.0) -> bytes:
    """The first bytes a server sends unasked (b"" if none within `seconds`): a gRPC server sends an
    HTTP/2 SETTINGS frame (9-byte header, type 4) as soon as a connection is accepted."""
    conn.settimeout(seconds)
    try:
        return conn.recv(64)
    except TimeoutError:
        return b""


# -- execution ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KillOnce:
    """A fault for tests: the first attempt of the task writing shard `shard` kills its own worker
    process (SIGKILL) after writing one tensor, leaving a half-written part file; `marker` (a path
    the tasks can reach) records that it happened, so Ray's retry runs through."""

    shard: str
    marker: str

    def __call__(self, shard: str) -> None:
        if shard == self.shard and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class _ShardDone:
    name: str
    hashes: dict[str, str]
    written: int
    expert_bytes: int
    base_bytes: int
    physical_bytes: int
    peak_rss: int
    remote_fetched: int | None  # tensor bytes fetched from URLs (None: no input is remote)


def _shard_task(
    xp: ExecutionPlan,
    group: list[int],
    name: str,
    tmp: str,
    dtype: str | None,
    verify: bool,
    threads: int,
    fault: Callable[[str], None] | None,
) -> _ShardDone:
    """Runs on a Ray worker: merge tensors `group` into `tmp/name`, written under a private name
    first and renamed when complete."""
    phys0 = physical_read_bytes()
    part = Path(tmp) / f".{name}{PART}{uuid.uuid4().hex[:8]}"
    merger = Merger(xp, dtype, verify, threads, tensors=group)  # fetches ahead only what the shard reads
    remote = merger.inputs.sources.any_remote  # asked before close(), which forgets the opened files
    try:
        hashes, written = write_shard(merger, xp, group, part, dtype, (lambda _: fault(name)) if fault else None)
        os.replace(part, Path(tmp) / name)
    finally:
        merger.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
    return _ShardDone(
        name,
        hashes,
        written,
        merger.count.expert,
        merger.count.base,
        physical_read_bytes() - phys0,
        peak_rss(),
        merger.inputs.fetched if remote else None,
    )


def shard_writer(
    address: str | None = None,
    *,
    verify: bool = False,
    threads: int = 1,
    retries: int = RETRIES,
    fault: Callable[[str], None] | None = None,
) -> WriteShards:
    """An executor.WriteShards that runs one Ray task per shard, each asking Ray for `threads`
    CPUs and merging on that many threads; for executor.execute(write_shards=...)."""
    check_threads(threads)
    if not _ray().is_initialized():  # without Ray, or with no head at `address`: fail before anything is
        _check_reachable(address)  # read or written, and before execute takes the output's lock

    def write(
        xp: ExecutionPlan,
        groups: list[list[int]],
        names: list[str],
        tmp: Path,
        dtype: str | None,
        progress: Callable[[int], None] | None,
    ) -> ShardsWritten:
        with session(address) as ray:
            _check_cpus(ray, threads)
            task = ray.remote(_shard_task).options(num_cpus=threads, max_retries=retries, retry_exceptions=False)
            refs = [
                task.remote(ray.put(for_tensors(xp, group)), group, name, str(tmp), dtype, verify, threads, fault)
                for name, group in zip(names, groups)
            ]
            done: list[_ShardDone] = [None] * len(refs)  # type: ignore[list-item]
            for i, result in _gather(ray, refs, lambda i: f"writing {names[i]}", retries):
                done[i] = result
                if progress:
                    progress(
                        sum(tensor_nbytes(output_dtype(xp.tensors[t], dtype), xp.tensors[t].shape) for t in groups[i])
                    )
        for p in tmp.glob(f".*{PART}*"):  # what attempts killed mid-write left
            p.unlink()
        hashes = {h: v for d in done for h, v in d.hashes.items()}
        weight_map = {h: d.name for d in done for h in d.hashes}
        return ShardsWritten(
            hashes,
            weight_map,
            sum(d.written for d in done),
            sum(d.expert_bytes for d in done),
            sum(d.base_bytes for d in done),
            sum(d.physical_bytes for d in done),
            max((d.peak_rss for d in done), default=0),
            None if all(d.remote_fetched is None for d in done) else sum(d.remote_fetched or 0 for d in done),
        )

    write.verifies = verify  # type: ignore[attr-defined]  # executor.execute(verify=True) asks for it
    return write


def for_tensors(xp: ExecutionPlan, group: list[int]) -> ExecutionPlan:
    """`xp` with its per-block and per-tensor tables (mask, trims, stock, tensor_params) cut to the
    tensors `group`: all a shard's task needs, so the whole mask (millions of rows for a large
    family) is shipped once in all, not once per task."""
    keep = pa.array(sorted(set(group)), pa.int32())

    def cut(table: pa.Table | None) -> pa.Table | None:
        if table is None:
            return None
        return table.filter(pc.is_in(table.column("tensor_idx").cast(pa.int32()), value_set=keep))

    return replace(xp, mask=cut(xp.mask), trims=cut(xp.trims), stock=cut(xp.stock), tensor_params=cut(xp.tensor_params))


def _gather(ray: Any, refs: list[Any], what: Callable[[int], str], retries: int) -> Iterator[tuple[int, Any]]:
    """(index into `refs`, result) of each task as it finishes. On the first failure the other
    tasks are cancelled and waited for (so none still writes anywhere once this raises), then the
    failure is raised: a task's own exception as itself, a lost worker or node as a MergeDBError
    naming the task (`what(i)`)."""
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = index[ready[0]]
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                raise (e.cause if isinstance(e.cause, Exception) else e) from None
            except ray.exceptions.RayError as e:  # the worker or node died more often than retried, OOM, ...
                lost = isinstance(e, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError))
                why = f"lost its worker {retries + 1} times" if lost else "failed"
                first = (str(e).strip().splitlines() or [""])[0][:200]
                raise MergeDBError(
                    f"the Ray task {what(i)} {why} ({type(e).__name__}: {first}); nothing was installed or "
                    "written: check the workers' memory and logs (`ray logs`) and run the command again"
                ) from None
            yield i, result
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        for ref in pending:
            with contextlib.suppress(Exception):
                ray.get(ref)
        raise


def _check_cpus(ray: Any, threads: int) -> None:
    """Refuse tasks no node could run (Ray would wait for such a node for ever)."""
    most = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    if threads > most:
        raise MergeDBError(
            f"--threads {threads} asks each Ray task for {threads} CPUs, but the largest node of this Ray "
            f"cluster has {most:g}; pass --threads {max(1, int(most))} or less"
        )


# -- registration ------------------------------------------------------------------------------


def _scan_task(
    base: Checkpoint,
    expert: Checkpoint,
    family: list[FamilyTensor],
    base_hashes: dict[tuple[int, int], str],
    sketch_dim: int,
    threads: int,
) -> tuple[Any, int]:
    """Runs on a Ray worker: one expert's statistics (scan.ExpertStats) and the bytes it read."""
    from . import scan

    read = [0]
    lock = threading.Lock()

    def tick(n: int) -> None:  # called from the scan's threads
        with lock:
            read[0] += n

    stats = scan.scan_experts(base, [expert], family, base_hashes, sketch_dim, threads, tick)[0]
    return stats, read[0]


def _absolute(c: Checkpoint) -> Checkpoint:
    if is_url(c.path):  # a URL reads the same from every worker
        return c
    return replace(c, path=c.path.absolute(), root=c.root.absolute())


def expert_scanner(address: str | None = None, *, threads_per_task: int = 1) -> Callable[..., list[Any]]:
    """A replacement for scan.scan_experts (same arguments and result) that scans each expert in
    its own Ray task of `threads_per_task` CPUs; for register.register(scanner=...). With a `sink`, an
    expert's rows go there as its task ends, so the driver holds one expert's rows at a time."""
    _ray()

    def scan_experts(
        base: Checkpoint,
        experts: list[Checkpoint],
        family: list[FamilyTensor],
        base_hashes: dict[tuple[int, int], str],
        sketch_dim: int,
        threads: int,
        progress: Callable[[int], None] | None = None,
        sink: Callable[..., None] | None = None,
    ) -> list[Any]:
        with session(address) as ray:
            _check_cpus(ray, threads_per_task)
            task = ray.remote(_scan_task).options(num_cpus=threads_per_task, max_retries=RETRIES)
            fam, hashes = ray.put(family), ray.put(base_hashes)
            base_at = _absolute(base)  # a worker's current folder is not this process's
            refs = [task.remote(base_at, _absolute(e), fam, hashes, sketch_dim, threads_per_task) for e in experts]
            out: list[Any] = [None] * len(refs)
            for i, (stats, read) in _gather(ray, refs, lambda i: f"scanning {experts[i].name!r}", RETRIES):
                if sink is not None:
                    sink(i, stats.blocks, stats.tensors)
                    stats.blocks, stats.tensors = [], []
                out[i] = stats
                if progress:
                    progress(read)
            return out

    return scan_experts
