"""Registration: read checkpoints once (scan.py) and store their layout and delta statistics.
It is long because every refusal of a registration's input is here, before anything is read.

Two phases, so DuckDB's file lock is held only briefly: the files are read with the catalog
closed, then every row is written in one transaction (nothing is written if anything fails; a new
catalog is made then, so a refused or failed first registration leaves no file behind).
Rows cross from the scan as named records (`scan.BlockRow`, `scan.TensorRow`) and enter DuckDB
as Arrow tables whose columns are named after the schema's (schema/001_catalog.sql); the experts'
statistic rows wait for the transaction on disk, not in memory (staging.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import duckdb
import pyarrow as pa

from . import lora, scan, staging
from .checkpoint import Checkpoint, discover, file_info, fingerprint, gone, open_checkpoint
from .errors import CatalogError, ChangedFileError, MergeDBError
from .faults import rollback
from .layout import Block, FamilyTensor, vocab_size
from .sidefiles import side_record
from .units import DEFAULT_LAYOUT, BlockSizes, block_sizes, check_name, check_same_layout, check_threads, shown

if TYPE_CHECKING:
    from .catalog import Catalog


@dataclass(frozen=True)
class RegisterResult:
    """What a registration did."""

    registered: tuple[str, ...]
    unchanged: tuple[str, ...]
    bytes_read: int
    seconds: float
    moved: tuple[str, ...] = ()  # registered checkpoints found at a new path (the old one gone): path updated


def register(
    cat: Catalog,
    paths: Sequence[str | os.PathLike[str]],
    *,
    base: bool = False,
    base_model: str | None = None,
    name: str | None = None,
    block_size: int | str | BlockSizes | None = None,
    vocab_block_size: int | str | None = None,
    refresh: bool = False,
    threads: int | None = None,
    progress: scan.Progress | None = None,
    on_total: Any = None,
    scanner: Callable[..., list[scan.ExpertStats]] | None = None,
) -> RegisterResult:
    """Register checkpoints: read each once, store layout and exact delta statistics.

    `paths` are model folders, .safetensors files, or folders of those. With `base=True` they
    are bases; otherwise experts of `base_model` (a registered base, or one of `paths` by name;
    the catalog's only base when omitted). Idempotent: an unchanged checkpoint is skipped.
    `block_size`, `vocab_block_size`: a new base's layout (units.block_sizes; default "auto"); experts
    use their base's, and a layout given for a base already registered with another one is
    refused (its experts' rows are per block: it cannot change in place).
    `threads` (default: the machine's cores) never changes a stored row.
    `scanner` reads the experts instead of scan.scan_experts, with its arguments (`sink` included:
    rows given to it are staged at once) and result (e.g. rayexec.expert_scanner: one Ray task per
    expert); the rows are written here all the same.
    """
    t0 = time.perf_counter()
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths  # one path, not its letters
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise MergeDBError(f"register() takes a list of paths (str or Path), got {shown(paths)}")
    for p in paths:
        if "\x00" in os.fsdecode(p):  # os calls raise a bare ValueError for it
            raise MergeDBError(f"register() path {os.fsdecode(p)!r} holds a NUL byte; pass the folder's real name")
    if not paths:
        raise MergeDBError("register() needs a path: a model folder, a .safetensors file, or a folder of them")
    for k, v in (("base", base), ("refresh", refresh)):  # a str such as "no" would be taken as true
        if not isinstance(v, bool):
            raise MergeDBError(f"register() {k} is True or False, got {shown(v)}")
    for k, v in (("progress", progress), ("on_total", on_total), ("scanner", scanner)):
        if v is not None and not callable(v):  # it would fail mid-scan
            raise MergeDBError(f"register() {k} is a function or None, got {type(v).__name__}")
    if base_model is not None and not isinstance(base_model, str):  # a list was a bare "unhashable" TypeError
        raise MergeDBError(f"register() base_model is a registered base's name (a str), got {shown(base_model)}")
    threads = check_threads(os.cpu_count() or 1 if threads is None else threads)
    asked = block_size is not None or vocab_block_size is not None  # else: a new base gets the default
    rule = block_sizes(DEFAULT_LAYOUT if block_size is None else block_size, vocab_block_size)
    if name is not None:
        check_name(name, "--name")
    if base and base_model is not None:
        raise MergeDBError("--base registers PATHS as bases; --base-model names the base of experts: give one of them")
    ckpt_paths, adapter_paths = lora.split_paths(paths, base)  # PEFT adapters: experts read by lorascan
    given = {Path(p).resolve() for p in ckpt_paths if not (isinstance(p, str) and "://" in p)}  # named themselves
    found = [open_checkpoint(p) for p in discover(ckpt_paths)] if ckpt_paths or not adapter_paths else []
    if name is not None:
        if len(found) + len(adapter_paths) != 1:
            raise MergeDBError(f"--name applies to one checkpoint, but {len(found) + len(adapter_paths)} were found")
        found = [replace(c, name=name) for c in found]

    cat.wait_while_created()  # another registration making this catalog right now: its file, not a leftover
    new = not cat.path.exists() or (cat.path.is_file() and cat.path.stat().st_size == 0)  # made with the rows
    existing: dict[str, tuple] = {}  # name -> the row of these columns:
    cols = (
        "name, checkpoint_id, role, base_id, fingerprint, block_size, path, vocab_block_size, vocab_block_rows, root, "
        "content_hash"
    )
    cat.check_creatable()  # before anything is read
    blank = new  # no catalog yet: made in the transaction that writes the rows (catalog.make_if_blank)
    if not new:
        with cat.duckdb_connection(write=True, create=True) as con:
            blank = cat.is_blank(con)  # an empty DuckDB file: left as it is if this registration fails
            if not blank:
                existing = {r[0]: r for r in con.execute(f"SELECT {cols} FROM checkpoints").fetchall()}
    base_names = {r[1]: r[0] for r in existing.values() if r[2] == "base"}
    dim = cat.sketch_dim()

    if base:
        bases, experts, base_ckpt_name = found, [], None
    else:
        base_ckpt_name = base_model
        if base_ckpt_name is None:
            if len(base_names) != 1:
                raise MergeDBError(
                    "which base were these experts fine-tuned from? pass --base-model NAME "
                    + (
                        f"(registered bases: {', '.join(sorted(base_names.values()))})"
                        if base_names
                        else "or register the base first with --base"
                    )
                )
            base_ckpt_name = next(iter(base_names.values()))
        in_paths = [c for c in found if c.name == base_ckpt_name]
        if in_paths:
            bases, experts = in_paths, [c for c in found if c.name != base_ckpt_name]
        elif base_ckpt_name in existing and existing[base_ckpt_name][2] == "base":
            bases, experts = [], found
            at = existing[base_ckpt_name][6]
            if "://" not in at and gone(at):  # its experts are read against it
                raise ChangedFileError(
                    f"base {base_ckpt_name!r} is gone from {at}, where it was registered; if it moved, register it "
                    f"where it is now first (mergedb register NEW_PATH --name {base_ckpt_name} --base), or pass its "
                    "new folder along with the experts"
                )
        else:
            known = ", ".join(sorted(base_names.values())) or "none"
            raise CatalogError(
                f"unknown --base-model {base_ckpt_name!r}: not among the paths and not a registered base "
                f"(registered bases: {known})"
            )
        if adapter_paths:  # mapped onto the base's tensors now: a mismatch is refused before any read
            base_ckpt = in_paths[0] if in_paths else open_checkpoint(existing[base_ckpt_name][6], name=base_ckpt_name)
            experts += [lora.open_adapter(p, base_ckpt, name) for p in adapter_paths]
    for c in bases + experts:
        check_name(c.name, f"the name of {c.path}")
    names = [c.name for c in bases + experts]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise MergeDBError(f"two checkpoints would be named {dupes[0]!r}; register them separately with --name")

    todo_bases, todo_experts, unchanged, retimed, moved = [], [], [], [], []
    for c in bases + experts:
        role = "base" if c in bases else "expert"
        row = existing.get(c.name)
        if row is not None:
            if row[2] != role:
                raise CatalogError(f"{c.name!r} is already registered as a {row[2]}, not a {role}")
            same_files = _where(row[9]) == _where(c.root.resolve()) and row[4] == c.fingerprint
            if row[6] != str(c.path.resolve()) and same_files:  # its folder, named by its file: the same
                unchanged.append(c.name)
                continue
            if row[6] != str(c.path.resolve()):  # names are unique: another folder is another checkpoint,
                if not _moved(row[6], c):  # unless the registered one is gone: then it moved here
                    raise CatalogError(
                        f"{c.name!r} is already registered from {row[6]}; {c.path} is another checkpoint: "
                        "register it under another name with --name NEW"
                    )
                moved.append(c)  # its path is updated with the rows; the checks below apply as ever
            if role == "expert" and row[3] != existing.get(base_ckpt_name or "", (0, -1))[1]:
                old_base = next((n for n, r in existing.items() if r[1] == row[3]), "?")
                raise CatalogError(
                    f"expert {c.name!r} is registered with base {old_base!r}, not {base_ckpt_name!r}; "
                    "register it for this base under another name with --name NEW"
                )
            same_base = role == "base" or existing.get(base_ckpt_name or "", (0, -1))[1] == row[3]
            named = refresh and role == "expert" and Path(str(c.path)).resolve() in given  # not found in a folder
            if row[4] == c.fingerprint and same_base and not named:
                unchanged.append(c.name)  # --refresh re-scans an expert named itself even when its fingerprint
                continue  # (sizes, times, headers) is unchanged: its bytes may have changed in place (--verify)
            if not refresh:
                raise ChangedFileError(
                    f"{c.name!r} ({c.path}) changed since it was registered; "
                    "pass --refresh to re-scan it (plans made before then still execute if its bytes are the same, "
                    "else they ask to be made again)"
                )
            if role == "base":
                if _only_times_changed(cat, c, threads):  # a copy, `touch`, a checkout: its bytes are the same
                    retimed.append(c)
                    continue
                raise ChangedFileError(
                    f"base {c.name!r} ({c.path}) changed since it was registered (its files, not only their times: "
                    f"rewritten, re-sharded or edited); {_NEW_BASE}"
                )
        (todo_bases if role == "base" else todo_experts).append(c)

    moved_bases = [c for c in moved if any(c is b for b in bases)]  # a move is checked as a new path is
    moved_experts = [c for c in moved if all(c is not b for b in bases)]
    base_id = existing.get(base_ckpt_name or "", (0, None))[1]
    named = (todo_bases + moved_bases, todo_experts + moved_experts)  # checked again at the write
    _refuse_copies(*named, existing, base_id)
    if asked:  # a layout asked for must be the one the bases involved get or already have
        involved = [c.name for c in bases] + ([base_ckpt_name] if experts and base_ckpt_name else [])
        owned = {c.name for c in todo_bases}
        for n in sorted(n for n in set(involved) - owned if n in existing and existing[n][2] == "base"):
            check_same_layout(n, BlockSizes(*existing[n][5:6], *existing[n][7:9]), rule)

    todo_experts, todo_adapters = lora.partition(todo_experts)
    total = sum(_tensor_bytes(c) for c in todo_bases) + sum(2 * _tensor_bytes(c) for c in todo_experts)
    if on_total:
        on_total(total)
    read = 0
    read_lock = threading.Lock()

    def tick(n: int) -> None:  # called from the scan's worker threads
        nonlocal read
        with read_lock:
            read += n
            if progress:
                progress(n)

    # The experts' rows go to a scratch file as the scan makes them (staging.py): held in memory
    # they would grow with experts × blocks. It is freed on leaving, whatever ends the call.
    stage = staging.Stage(cat.path.parent)
    try:
        # Phase 1: read the files (catalog closed). A base registered with its experts is hashed by
        # their scan, which reads its blocks anyway (scan.scan_family): one read of it, not two.
        fused = (
            base_ckpt_name if todo_experts and not scanner and base_ckpt_name in {b.name for b in todo_bases} else None
        )
        families: dict[str, tuple[Checkpoint, list[FamilyTensor], list[str]]] = {}
        for b in todo_bases:
            fam = scan.layout(b, rule)
            families[b.name] = (b, fam, [] if b.name == fused else scan.hash_base(b, fam, threads, tick))
        results: list = []

        def to_stage(ckpts: list) -> Callable[..., None]:  # a scan's sink: expert k's rows, staged by name
            return lambda k, *rows: stage.add(ckpts[k].name, *rows)

        if todo_experts or todo_adapters:  # one pool over every (expert, tensor): all cores busy to the end
            assert base_ckpt_name is not None
            if base_ckpt_name not in families:
                here = next((c for c in bases if c.name == base_ckpt_name), None)  # maybe moved, or only retimed
                retimed_base = any(c is here for c in retimed)  # its blocks were just hashed as registered
                families[base_ckpt_name] = _load_family(cat, base_ckpt_name, not retimed_base, here)
            b, fam, hashes = families[base_ckpt_name]
            if fused is not None:
                sink = to_stage(todo_experts)
                hashes, expert_stats = scan.scan_family(b, todo_experts, fam, dim, threads, tick, sink)
                families[base_ckpt_name] = (b, fam, hashes)
                results += zip(todo_experts, expert_stats)
            keyed = {(blk.tensor_idx, blk.block_idx): h for blk, h in zip(_all_blocks(fam), hashes)}
            if todo_experts and fused is None:
                scan_experts = scanner or scan.scan_experts
                got = scan_experts(b, todo_experts, fam, keyed, dim, threads, tick, sink=to_stage(todo_experts))
                results += zip(todo_experts, got)
            if todo_adapters:
                from . import lorascan  # LoRA's reads run numba's kernels (loraread): imported only for adapters

                if on_total:
                    on_total(total + sum(lorascan.bytes_to_read(a, fam) for a in todo_adapters))
                sink = to_stage(todo_adapters)
                adapted = lorascan.scan_adapters(b, todo_adapters, fam, keyed, dim, threads, tick, sink)
                results += zip(todo_adapters, adapted)
        for e, st in results:  # a scanner that returns its rows instead of giving them to the sink
            if st.blocks or st.tensors:
                stage.add(e.name, st.blocks, st.tensors)
                st.blocks, st.tensors = [], []
        stage.finish()  # before the catalog is opened: a full disk is refused with nothing written
        _refuse_changed_while_read([*todo_bases, *(e for e, _ in results)])
        scanned = [("base", b, scan.content_hash(families[b.name][2])) for b in todo_bases]
        scanned += [("expert", e, st.content_hash) for e, st in results]
        _refuse_same_weights(scanned, existing, base_id)

        # Phase 2: one transaction. Another process may have registered some of these meanwhile:
        # identical ones are skipped, conflicting ones refused (nothing is written then).
        n_unchanged = len(unchanged)
        read_against = base_id  # write() has a base_id of its own

        def write(con: duckdb.DuckDBPyConnection) -> list[str]:  # in one transaction (_transaction)
            del unchanged[n_unchanged:]  # a second try starts over
            done: list[str] = []
            now = {
                r[0]: r
                for r in con.execute(
                    "SELECT name, checkpoint_id, role, base_id, fingerprint, block_size, vocab_block_size, "
                    "vocab_block_rows, path, content_hash FROM checkpoints"
                ).fetchall()
            }
            fresh = {r[0]: r for r in con.execute(f"SELECT {cols} FROM checkpoints").fetchall()}
            if fresh != existing:  # another process registered or forgot meanwhile: what was refused before, again
                _refuse_base_changed(base_ckpt_name, [b.name for b in todo_bases], existing, fresh)
                now_base = fresh.get(base_ckpt_name or "", (0, read_against))[1]  # registered meanwhile too
                _refuse_copies(*named, fresh, now_base)
                _refuse_same_weights(scanned, fresh, now_base)
            ids = {}
            # a moved checkpoint is the same one where it is now: its rows and plans hold (a re-scan
            # below rewrites it)
            for c in moved:
                if now[c.name][8] != existing[c.name][6]:
                    raise CatalogError(f"{c.name!r} was registered again by another process meanwhile; run again")
                con.execute(
                    "UPDATE checkpoints SET path = ?, root = ? WHERE checkpoint_id = ?",
                    [str(c.path.resolve()), str(c.root.resolve()), now[c.name][1]],
                )
            for b in retimed:  # its stored fingerprint and file times only: its rows and its experts' hold
                if now[b.name][4] != existing[b.name][4]:
                    raise CatalogError(f"base {b.name!r} was registered again by another process meanwhile; run again")
                con.execute(
                    "UPDATE checkpoints SET fingerprint = ? WHERE checkpoint_id = ?",
                    [b.fingerprint, now[b.name][1]],
                )
                for f in b.files:
                    con.execute(
                        "UPDATE files SET mtime_ns = ? WHERE checkpoint_id = ? AND relpath = ?",
                        [f.mtime_ns, now[b.name][1], f.relpath],
                    )
                done.append(b.name)
            for b in todo_bases:
                _, fam, hashes = families[b.name]
                if b.name in now:
                    same_layout = now[b.name][5:8] == (rule.size, rule.vocab, rule.vocab_rows)
                    if now[b.name][4] != b.fingerprint or not same_layout:
                        raise CatalogError(
                            f"base {b.name!r} was registered by another process meanwhile with other "
                            "contents or block size; nothing was written: run the command again"
                        )
                    ids[b.name] = now[b.name][1]
                    unchanged.append(b.name)
                    continue
                ids[b.name] = _insert_checkpoint(con, b, "base", None, scan.content_hash(hashes), rule)
                _insert_family(con, ids[b.name], fam, hashes)
                done.append(b.name)
            for e, st in results:
                if base_ckpt_name in ids:
                    base_id = ids[base_ckpt_name]
                else:
                    base_id = _one(con, "SELECT checkpoint_id FROM checkpoints WHERE name = ?", [base_ckpt_name])[0]
                if e.name in now:
                    row = now[e.name]
                    if e.name not in existing or row[4] != existing[e.name][4]:  # someone else's write
                        if row[4] == e.fingerprint and row[3] == base_id:
                            unchanged.append(e.name)
                            continue
                        raise CatalogError(
                            f"{e.name!r} was registered by another process meanwhile with other contents; "
                            "nothing was written: run the command again"
                        )
                    if any(e is c for c in moved) and st.content_hash != row[9]:  # not the same model, moved
                        raise CatalogError(
                            f"{e.name!r} is registered from {existing[e.name][6]}, which is gone, but {e.path} "
                            "holds other weights: it is another checkpoint, not that one moved; register it under "
                            "another name with --name NEW (nothing was written)"
                        )
                    _delete_checkpoint(con, row[1])  # --refresh: same id, so old plans see the change
                cid = _insert_checkpoint(
                    con, e, "expert", base_id, st.content_hash, None, now[e.name][1] if e.name in now else None
                )
                stage.insert(con, e.name, cid)  # its expert_blocks and expert_tensors rows (an adapter's costs)
                done.append(e.name)
            for b in bases:  # its side files as they are now, however it was registered (016_base_side_files)
                con.execute(
                    "UPDATE checkpoints SET side_files = ? WHERE name = ? AND role = 'base'",
                    [side_record(b.root), b.name],
                )
            return done

        done = _transaction(cat, new, blank, stage.rows, dim, write)
        return RegisterResult(
            tuple(done), tuple(unchanged), read, time.perf_counter() - t0, tuple(c.name for c in moved)
        )
    finally:
        stage.close()


def _refuse_changed_while_read(scanned: list[Any]) -> None:
    """Refuse, before anything is written, a checkpoint or adapter whose files changed while they were
    read (a training job still saving, a copy still running): their statistics would describe neither
    version, and nothing would tell until the next check (review, 2026-12-02). Compared by the
    fingerprint taken when reading began: sizes, times (a remote file's version) and headers."""
    for c in scanned:
        try:
            if isinstance(c, lora.Adapter):
                now = lora.adapter_fingerprint(c.path)
            else:
                now = fingerprint(tuple(file_info(c.root, f.relpath) for f in c.files))
        except (OSError, MergeDBError):
            now = None
        if now != c.fingerprint:
            raise ChangedFileError(
                f"{c.path} changed while it was being registered (its files' sizes, times or headers are not "
                "those reading began with); nothing was written: run the command again once nothing writes it"
            )


# DuckDB keeps a transaction's inserted rows in memory until COMMIT: ~60 MB per expert of 20k tensors,
# so registering K experts at once grew by K. Under a memory limit it spills them into CATALOG.tmp/
# instead (benchmarks/ANALYSIS.md: 16 experts of 20k tensors, peak RSS 1.43 GB -> 0.49 GB, no slower).
# What cannot spill: the primary keys' index (~8 bytes a key in DuckDB 2.0: 10M keys, 80 MB), which a
# transaction loads for the catalog's rows and grows by the new ones; buffers of each inserting DuckDB
# thread; rows being gathered, as wide as the sketches. So the limit is TRANSACTION_MEMORY, plus
# KEY_BYTES per keyed row, THREAD_MEMORY per DuckDB thread and SKETCH_MEMORY per sketch dimension.
# Measured (ANALYSIS.md; 20k tensors, K = 4 or 16): DuckDB did not keep to 47 MiB (2 threads, sketch
# dim 64), 79 MiB (64 threads) or 102 MiB (dim 1024); it kept to 79, 143 and 166 MiB and to 100 MiB at
# dim 256. The constants give 1.3-1.5x those: 106 MiB + rows at 2 threads and dim 64, 168 + rows at 64
# threads, 226 + rows at dim 1024. (Below its need DuckDB raises, and the transaction runs again under
# its own limit: correct, but the failed try costs its time and more memory than no limit.)
TRANSACTION_MEMORY = 96 * 2**20
THREAD_MEMORY = 2**20
SKETCH_MEMORY = 128 * 2**10
KEY_BYTES = 24


COMMIT_WAIT = 30.0  # seconds registration waits at its commit for a catalog another process holds


def _transaction(
    cat: Catalog,
    new: bool,
    blank: bool,
    rows: int,
    sketch_dim: int,
    write: Callable[[duckdb.DuckDBPyConnection], list[str]],
) -> list[str]:
    """write(con) in one transaction under a DuckDB memory limit for `rows` new keyed rows with sketches
    of `sketch_dim` (see TRANSACTION_MEMORY; never above the connection's own); nothing is written if it
    fails, and a `new` catalog file is removed then. A `blank` one (new, or an empty DuckDB file) gets
    its schema in the same transaction. Where DuckDB cannot keep to the limit (no room for
    CATALOG.tmp/, or more than the estimate will not spill) the transaction runs again under the
    connection's own limit, which is put back afterwards in any case (a process's connections to one
    file share it)."""
    # every file is read by now: a reader holding the catalog for a moment must not throw that away
    with cat.waiting(COMMIT_WAIT).duckdb_connection(write=True, create=blank, alone=True) as con:
        own, threads = con.execute("SELECT current_setting('memory_limit'), current_setting('threads')").fetchall()[0]
        keyed = 0
        if not cat.is_blank(con):
            keyed = con.execute(
                "SELECT (SELECT count(*) FROM expert_blocks) + (SELECT count(*) FROM expert_tensors) "
                "+ (SELECT count(*) FROM blocks)"
            ).fetchall()[0][0]
        cap = TRANSACTION_MEMORY + THREAD_MEMORY * int(threads) + SKETCH_MEMORY * sketch_dim
        cap += KEY_BYTES * (int(keyed) + rows)
        limits = [f"{cap}B", own] if _limit_bytes(own) > cap else [own]
        try:
            for i, limit in enumerate(limits):
                try:
                    con.execute(f"SET memory_limit = '{limit}'")
                except duckdb.OutOfMemoryException:  # DuckDB holds more already (what it loaded of the catalog)
                    if i + 1 < len(limits):
                        continue
                    raise
                con.execute("BEGIN")
                try:
                    cat.make_if_blank(con)
                    done = write(con)
                    con.execute("COMMIT")
                    return done
                except BaseException as e:
                    rollback(con)
                    if isinstance(e, (duckdb.OutOfMemoryException, duckdb.IOException)) and i + 1 < len(limits):
                        continue  # DuckDB could not keep to the limit: again under its own
                    if new:
                        cat.discard_if_empty(con)
                    raise
            raise AssertionError("unreachable")
        finally:
            with contextlib.suppress(duckdb.Error):
                con.execute(f"SET memory_limit = '{own}'")


def _limit_bytes(text: str) -> float:
    """A memory_limit as DuckDB writes it (`18.8 GiB`, `256MB`) in bytes; unknown forms are unlimited."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B\s*", text, re.IGNORECASE)
    if not m:
        return float("inf")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return float(m.group(1)) * (1024 if m.group(3) else 1000) ** power


# what to do with a base whose bytes changed at its registered path (a newer release saved over it)
_NEW_BASE = (
    "its experts' statistics were measured against the old one, so it is not re-scanned in place, nor registered "
    "again from that path under a new name. Register the new base and its experts in a new catalog (--catalog "
    "NEW.duckdb), or put the new base in another folder and register it there under a new --name (then its "
    "experts against it, each under a new --name)"
)


def _refuse_base_changed(
    name: str | None, scanning: list[str], existing: dict[str, tuple], fresh: dict[str, tuple]
) -> None:
    """Refuse to write experts scanned against registered base `name` when another process forgot it
    or registered it again (other files or layout) meanwhile: their rows are per block of the base
    they were read against (existing, fresh: rows of register's columns, before the scan and now)."""
    if name is None or name in scanning or name not in existing:
        return
    was, now = existing[name], fresh.get(name)  # its id, layout and content: not its file times (a re-time)
    if now is None or now[1] != was[1] or now[10] != was[10] or (now[5], *now[7:9]) != (was[5], *was[7:9]):
        raise CatalogError(
            f"base {name!r} was forgotten or registered again by another process while its experts were read; "
            "nothing was written: run the command again"
        )


def _refuse_copies(bases: list, experts: list, existing: dict[str, tuple], base_id: int | None) -> None:
    """Refuse files registered (or being registered) under another name in the same role, for the
    same base: a model named twice would count twice in every plan over all experts. Copies
    elsewhere are refused once read (`_refuse_same_weights`)."""
    mine = [r for r in existing.values() if r[2] == "base" or r[3] == base_id]
    seen = {(r[2], _where(r[9]), r[4]): r[0] for r in mine}
    at = {(r[2], _where(r[6])): r[0] for r in mine}
    for role, todo in (("base", bases), ("expert", experts)):
        for c in todo:
            other = seen.setdefault((role, _where(c.root.resolve()), c.fingerprint), c.name)
            if other != c.name:
                raise CatalogError(
                    f"{c.path} holds the files of {role} {other!r}, registered under that name; register a "
                    f"model once (plans over all experts would count it twice): use {other!r} (--name {other})"
                )
            other = at.get((role, _where(c.path)), c.name)
            if other != c.name and role == "base":  # a base is never re-scanned: its experts depend on it
                raise CatalogError(f"{c.path} is registered as base {other!r} and its files changed since; {_NEW_BASE}")
            if other != c.name:  # the same path, its files changed since: a re-scan, not a second model
                raise CatalogError(
                    f"{c.path} is registered as {role} {other!r} and its files changed since; re-scan it "
                    f"under that name (mergedb register {c.path} --refresh --name {other}), not under a new one"
                )


def _refuse_same_weights(scanned: list[tuple[str, Any, str]], existing: dict[str, tuple], base_id: int | None) -> None:
    """Refuse a scanned (role, checkpoint, content hash) whose weights hash as those of another checkpoint of
    its role (experts: of the same base) registered under another name, or scanned in this call: a copy
    (`cp -a`, or with new file times) would count twice in every plan over all experts. A registered
    one whose folder is gone is not held against it: that is a move, which may take a new name."""
    seen = {
        (r[2], r[10]): (r[0], r[6])
        for r in existing.values()
        if (r[2] == "base" or r[3] == base_id) and ("://" in r[6] or not gone(r[6]))
    }
    for role, c, content_hash in scanned:
        name, where = seen.setdefault((role, content_hash), (c.name, str(c.path)))
        if name != c.name:
            raise CatalogError(
                f"{c.path} holds the same weights as {role} {name!r} (from {where}): a copy; register a model "
                f"once (plans over all experts would count it twice): use {name!r}"
            )


def _moved(registered: str, c: Checkpoint | lora.Adapter) -> bool:
    """Whether `c`, found under a registered checkpoint's name at another path, is that checkpoint
    moved: nothing of it is left at the registered path (checkpoint.gone; local paths only, a remote
    object is never taken as moved)."""
    return "://" not in registered and "://" not in str(c.path) and gone(registered)


def _where(path: Any) -> str:
    """A checkpoint's path as a key: resolved when local, a URL with its escapes decoded (expert%2000
    and "expert 00" name one object)."""
    text = str(path)
    return unquote(text) if "://" in text else str(Path(text).resolve())


def _only_times_changed(cat: Catalog, c: Checkpoint, threads: int) -> bool:
    """Whether the registered base `c`, whose fingerprint changed, differs only in its files' times:
    the same relative paths, sizes and headers, and every block hashing as registered (read in full)."""
    _, fam, hashes = _load_family(cat, c.name, checked=False, ckpt=c)
    with cat.duckdb_connection() as con:
        files = con.execute(
            "SELECT f.relpath, f.bytes, f.header_sha256 FROM files f JOIN checkpoints c USING (checkpoint_id) "
            "WHERE c.name = ? ORDER BY f.file_idx",
            [c.name],
        ).fetchall()
    if [(f.relpath, f.size, f.header.sha256) for f in c.files] != [tuple(r) for r in files]:
        return False
    return list(scan.hash_base(c, fam, threads, None)) == hashes


def _load_family(
    cat: Catalog, base_name: str, checked: bool = True, ckpt: Checkpoint | None = None
) -> tuple[Checkpoint, list[FamilyTensor], list[str]]:
    """A registered base's checkpoint, layout and block hashes, after checking its files are unchanged
    (`checked`). `ckpt`: the base as found among the paths being registered (where it may have moved
    to), else it is opened where it was registered."""
    with cat.duckdb_connection() as con:
        row = _one(con, "SELECT checkpoint_id, path, fingerprint FROM checkpoints WHERE name = ?", [base_name])
        cid, path, fp = row
        tensors = con.execute(
            "SELECT tensor_idx, name, dtype, shape, numel, nbytes, row_bytes, mergeable "
            "FROM family_tensors WHERE base_id = ? ORDER BY tensor_idx",
            [cid],
        ).fetchall()
        blocks = con.execute(
            "SELECT tensor_idx, block_idx, row_start, row_end, byte_start, nbytes, numel, base_hash "
            "FROM blocks WHERE base_id = ? ORDER BY tensor_idx, block_idx",
            [cid],
        ).fetchall()
    ckpt = ckpt or open_checkpoint(path, name=base_name)
    if checked and ckpt.fingerprint != fp:
        raise ChangedFileError(
            f"base {base_name!r} ({path}) changed since it was registered; if only its files' times changed (a "
            f"copy, touch), `mergedb register {path} --base --refresh` keeps it, else register it under a new --name"
        )
    by_tensor: dict[int, list[Block]] = {}
    for t, b, r0, r1, bs, nb, ne, _ in blocks:
        by_tensor.setdefault(t, []).append(Block(t, b, r0, r1, bs, nb, ne))
    fam = [FamilyTensor(t, n, d, tuple(s), ne, nb, rb, m, tuple(by_tensor[t])) for t, n, d, s, ne, nb, rb, m in tensors]
    return ckpt, fam, [b[7] for b in blocks]


def _insert_checkpoint(
    con: duckdb.DuckDBPyConnection,
    c: Checkpoint | lora.Adapter,
    role: str,
    base_id: int | None,
    chash: str,
    block_size: BlockSizes | None,
    cid: int | None = None,
) -> int:
    vocab = vocab_size([t for _, t in c.tensors], c.vocab_size) if block_size is not None else None
    if cid is None:
        cid = int(_one(con, "SELECT coalesce(max(checkpoint_id), 0) + 1 FROM checkpoints")[0])
    con.execute(
        "INSERT INTO checkpoints (checkpoint_id, name, path, root, role, base_id, architecture, dtype, "
        "n_tensors, bytes, fingerprint, content_hash, block_size, vocab_block_size, vocab_block_rows, vocab_size, "
        "adapter) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        [
            cid,
            c.name,
            str(c.path.resolve()),
            str(c.root.resolve()),
            role,
            base_id,
            c.architecture,
            c.dtype,
            len(c.tensors),
            c.bytes,
            c.fingerprint,
            chash,
            *((block_size.size, block_size.vocab, block_size.vocab_rows, vocab) if block_size else (None,) * 4),
            isinstance(c, lora.Adapter) or None,
        ],
    )
    files = pa.table(
        {
            "checkpoint_id": pa.array([cid] * len(c.files), pa.int32()),
            "file_idx": pa.array(range(len(c.files)), pa.int32()),
            "relpath": [f.relpath for f in c.files],
            "bytes": pa.array([f.size for f in c.files], pa.int64()),
            "mtime_ns": pa.array([f.mtime_ns for f in c.files], pa.int64()),
            "header_len": pa.array([f.header.header_len for f in c.files], pa.int64()),
            "header_sha256": [f.header.sha256 for f in c.files],
        }
    )
    append_rows(con, "files", files)
    order = {t.name: i for i, (_, t) in enumerate(c.tensors)}
    if role == "expert":  # tensor_idx follows the base's order; the base's layout is already stored
        base_order = dict(
            con.execute("SELECT name, tensor_idx FROM family_tensors WHERE base_id = ?", [base_id]).fetchall()
        )
        order = {n: base_order[n] for n in order if n in base_order}  # an adapter's factors are no base tensor
    stored = [(fi, t) for fi, t in c.tensors if t.name in order]
    tensors = pa.table(
        {
            "checkpoint_id": pa.array([cid] * len(stored), pa.int32()),
            "tensor_idx": pa.array([order[t.name] for _, t in stored], pa.int32()),
            "file_idx": pa.array([fi for fi, _ in stored], pa.int32()),
            "data_start": pa.array([t.start for _, t in stored], pa.int64()),
            "data_end": pa.array([t.end for _, t in stored], pa.int64()),
        }
    )
    append_rows(con, "tensors", tensors)
    return cid


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] | None = None) -> Any:
    """The first row of a query, fully fetched (DuckDB 2 streams: an unfetched result blocks the connection)."""
    rows = con.execute(sql, list(params or [])).fetchall()
    return rows[0] if rows else None


def _tensor_bytes(c: Checkpoint) -> int:
    return sum(t.nbytes for _, t in c.tensors)


def _all_blocks(fam: list[FamilyTensor]) -> Iterator[Block]:
    for ft in fam:
        yield from ft.blocks


def append_rows(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> None:
    """INSERT an Arrow table into `table`, by column name. DuckDB reads the table by its local name
    (a replacement scan, as planner._store does): no view to register and drop."""
    _mergedb_rows = data  # noqa: F841
    cols = ", ".join(data.column_names)
    con.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM _mergedb_rows")


def _insert_family(con: duckdb.DuckDBPyConnection, base_id: int, fam: list[FamilyTensor], hashes: list[str]) -> None:
    append_rows(
        con,
        "family_tensors",
        pa.table(
            {
                "base_id": pa.array([base_id] * len(fam), pa.int32()),
                "tensor_idx": pa.array([f.tensor_idx for f in fam], pa.int32()),
                "name": [f.name for f in fam],
                "dtype": [f.dtype for f in fam],
                "shape": pa.array([list(f.shape) for f in fam], pa.list_(pa.int64())),
                "numel": pa.array([f.numel for f in fam], pa.int64()),
                "nbytes": pa.array([f.nbytes for f in fam], pa.int64()),
                "row_bytes": pa.array([f.row_bytes for f in fam], pa.int64()),
                "mergeable": [f.mergeable for f in fam],
                "n_blocks": pa.array([len(f.blocks) for f in fam], pa.int32()),
            }
        ),
    )
    blocks = list(_all_blocks(fam))
    append_rows(
        con,
        "blocks",
        pa.table(
            {
                "base_id": pa.array([base_id] * len(blocks), pa.int32()),
                "tensor_idx": pa.array([b.tensor_idx for b in blocks], pa.int32()),
                "block_idx": pa.array([b.block_idx for b in blocks], pa.int32()),
                "row_start": pa.array([b.row_start for b in blocks], pa.int64()),
                "row_end": pa.array([b.row_end for b in blocks], pa.int64()),
                "byte_start": pa.array([b.byte_start for b in blocks], pa.int64()),
                "nbytes": pa.array([b.nbytes for b in blocks], pa.int64()),
                "numel": pa.array([b.numel for b in blocks], pa.int64()),
                "base_hash": list(hashes),
                # scan.hash_base's per-block base statistics (None for pass-through tensors)
                "base_norm": pa.array(getattr(hashes, "norms", [None] * len(blocks)), pa.float64()),
                "base_nonfinite": pa.array(getattr(hashes, "nonfinite", [None] * len(blocks)), pa.int64()),
            }
        ),
    )


def _delete_checkpoint(con: duckdb.DuckDBPyConnection, cid: int) -> None:
    for table in ("expert_blocks", "expert_tensors", "tensors", "files", "checkpoints"):
        con.execute(f"DELETE FROM {table} WHERE checkpoint_id = ?", [cid])
