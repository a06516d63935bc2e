"""`mergedb demo`: a synthetic family, registered, planned at three budgets, executed cold, compared.

The demo shows the project's claim honestly: every execution starts from a cold page cache for the
files it reads (POSIX_FADV_DONTNEED after a sync, as the benchmarks do), each time is the median of
a few whole `Catalog.execute` calls, each into a fresh folder, and the family is sized so reading
the experts dominates. If a budget is still not faster than the full read, `notes` says why.

The demo writes into a folder it owns: a new or empty folder, which it marks with `.mergedb-demo`.
A rerun into a marked folder replaces only what the demo wrote there (family/, mergedb.duckdb,
merged-*/); any other non-empty folder is refused, never cleared.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import methods, synth
from .catalog import Catalog
from .errors import MergeDBError
from .planner import PlanRequest
from .tensorfile import DTYPES, as_float32, pread_into, read_header

MARKER = ".mergedb-demo"
BUDGETS = ("100%", "50%", "10%")
PARAMS = {"lambda": 0.5}  # the merged delta at half scale: every plan of the demo
CATALOG = "mergedb.duckdb"
# What the demo writes into its folder, and so all a rerun may remove.
OWNED = ("family", CATALOG, f"{CATALOG}.wal", *(f"merged-{b.rstrip('%')}" for b in BUDGETS))
DEFAULT_SIZE, DEFAULT_EXPERTS, DEFAULT_REPEATS = "small", 16, 3


@dataclass(frozen=True)
class DemoRow:
    budget: str
    expert_bytes: int  # logical: expert bytes the plan reads
    physical_bytes: int  # fetched from storage during the merge (median run; base included)
    seconds: float  # median wall time of whole Catalog.execute calls, cold cache
    speedup: float  # the full read's seconds / these
    rel_to_model: float  # ‖θ_B − θ_F‖ / ‖θ_F‖
    rel_to_update: float  # ‖θ_B − θ_F‖ / ‖θ_F − θ_0‖
    bound_rel: float | None  # the plan's bound on ‖θ_B − θ_F‖ as written / ‖θ_F − θ_0‖; None: not computed
    times: tuple[float, ...] = ()  # every run's seconds
    evicted: bool = True  # the cache was dropped before every run


@dataclass(frozen=True)
class DemoResult:
    rows: list[DemoRow]
    notes: list[str]  # why a speed-up is below 1, when one is
    experts: int
    size: str
    method: str
    repeats: int
    seconds: float  # the whole demo


def run_demo(
    workdir: str | Path,
    experts: int = DEFAULT_EXPERTS,
    size: str = DEFAULT_SIZE,
    method: str = "task_arithmetic",
    repeats: int = DEFAULT_REPEATS,
) -> list[DemoRow]:
    """Build `workdir/family`, register it in `workdir/mergedb.duckdb`, merge at 100/50/10%.

    `workdir` must be new, empty, or a folder an earlier demo created (see the module docstring)."""
    return demo(workdir, experts, size, method, repeats).rows


def demo(
    workdir: str | Path,
    experts: int = DEFAULT_EXPERTS,
    size: str = DEFAULT_SIZE,
    method: str = "task_arithmetic",
    repeats: int = DEFAULT_REPEATS,
    progress: Callable[[str], None] | None = None,
) -> DemoResult:
    """`run_demo` with the notes that explain a surprising row. `progress(step)` is told each step
    as it starts ("registering the family", "merging at 50%, run 1 of 3", …)."""
    t_start = time.perf_counter()
    if repeats < 1:
        raise MergeDBError(f"--repeats must be at least 1, got {repeats}")
    if progress is not None and not callable(progress):
        raise MergeDBError(f"demo() progress is a function or None, got {type(progress).__name__}")
    if not 1 <= experts <= synth.MAX_EXPERTS:  # before anything is written: no experts, nothing to merge
        raise MergeDBError(f"--experts must be from 1 to {synth.MAX_EXPERTS} for a demo, got {experts}")
    if size not in synth.SIZES:  # before the folder is prepared: a rerun's results are cleared there
        raise MergeDBError(f"unknown size {size!r}; choose one of {', '.join(synth.SIZES)}")
    methods.validate(method, PARAMS, [1.0] * experts, experts)  # the plans' request, refused before too
    say = progress or (lambda step: None)
    workdir = Path(workdir)
    prepare_workdir(workdir)
    say(f"generating a base and {experts} {size} expert{'s' if experts != 1 else ''}")
    fam = synth.make_family(workdir / "family", experts=experts, size=size, seed=0)
    inputs = sorted(fam.rglob("*.safetensors"))
    cat = Catalog(workdir / CATALOG)
    say("registering the family")
    cat.register([fam], base_model="base")
    say(f"planning at {', '.join(BUDGETS)}")
    plans = {b: cat.plan(PlanRequest("base", None, method, b, params=PARAMS)) for b in BUDGETS}
    times: dict[str, list[float]] = {b: [] for b in BUDGETS}
    physical: dict[str, list[int]] = {b: [] for b in BUDGETS}
    results = {}
    evicted = True
    for run in range(repeats):  # budgets interleaved, so a slow moment of the disk hits all alike
        for b in BUDGETS:
            say(f"merging at {b}, run {run + 1} of {repeats}")
            out = workdir / f"merged-{b.rstrip('%')}"
            if out.is_dir() and not out.is_symlink():
                shutil.rmtree(out)  # this run's own earlier repeat: each repeat writes a fresh folder
            evicted = _evict(inputs) and evicted
            t0 = time.perf_counter()
            results[b] = cat.execute(plans[b].plan_id, out)
            times[b].append(time.perf_counter() - t0)
            physical[b].append(results[b].physical_bytes)
    say("comparing the merges")
    full = _load(workdir / "merged-100")  # θ_F: the full merge as written, which the plans' bounds refer to
    base = _load(fam / "base")
    update, model = _norm(full, base), _norm(full, None)
    full_seconds = statistics.median(times["100%"])
    rows = []
    for b in BUDGETS:
        diff = _norm(_load(workdir / f"merged-{b.rstrip('%')}"), full)
        p = plans[b]
        bound = p.bound_rounded  # of the output as written; None: not computed (no float32 bound shown as one)
        secs = statistics.median(times[b])
        rows.append(
            DemoRow(
                b,
                results[b].expert_bytes,
                int(statistics.median(physical[b])),
                secs,
                full_seconds / secs if secs else 0.0,
                diff / model if model else 0.0,
                diff / update if update else 0.0,
                None if bound is None else bound / update if update else 0.0,
                tuple(times[b]),
                evicted,
            )
        )
    return DemoResult(rows, _notes(rows), experts, size, method, repeats, time.perf_counter() - t_start)


def _evict(paths: list[Path]) -> bool:
    """Drop `paths` from the page cache (no root needed), so the next read comes from storage."""
    os.sync()
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):  # no posix_fadvise on this platform, or refused
            ok = False
    return ok


def _notes(rows: list[DemoRow]) -> list[str]:
    """Why a budget is not faster than the full read, when one is not."""
    slow = [r for r in rows if r.budget != "100%" and r.speedup < 1]
    if not slow:
        return []
    full = rows[0]
    names = ", ".join(r.budget for r in slow)
    if not full.evicted or full.physical_bytes < full.expert_bytes // 2:
        return [
            f"speed-up below 1 at {names}: the page cache could not be emptied here (the full read fetched "
            f"{full.physical_bytes} bytes from storage for {full.expert_bytes} expert bytes), so every run read "
            "from memory and fixed costs decide; the speed-up shows on cold reads (see benchmarks/)"
        ]
    return [
        f"speed-up below 1 at {names}: at this size fixed costs (start-up, the base read, the output write) "
        "outweigh the expert bytes saved, or the disk was busy; try more experts (-k 32) or --size bench"
    ]


def prepare_workdir(workdir: Path) -> None:
    """Make `workdir` ready for a demo run without touching anything the demo did not write.

    A marked folder loses only the OWNED entries; a new or empty folder is created and marked;
    anything else raises MergeDBError before a single file is removed.
    """
    if (workdir / MARKER).is_file():
        for name in OWNED:
            p = workdir / name
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()  # a file, or a link (removed, its target left alone)
        return
    shown = f"{workdir} ({workdir.resolve()})" if not workdir.is_absolute() else str(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise MergeDBError(f"demo folder {shown} is a file; choose an empty or new --dir, e.g. mergedb demo --dir ./d")
    if workdir.is_dir() and any(workdir.iterdir()):
        raise MergeDBError(
            f"demo folder {shown} is not empty and was not created by `mergedb demo` (no {MARKER} in it); "
            "refusing to touch its contents: choose an empty or new --dir, e.g. mergedb demo --dir ./d"
        )
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / MARKER).write_text(
            "Created by `mergedb demo`. A rerun replaces only: " + ", ".join(OWNED) + "; other files stay.\n"
        )
    except OSError as e:  # under a file, on a read-only file system, in /proc
        raise MergeDBError(
            f"cannot make demo folder {shown}: {e.strerror or e}; choose a --dir in a folder you can write"
        ) from None


def _load(folder: Path) -> dict[str, np.ndarray]:
    """Every float tensor of the model in `folder`, decoded to float32 with mergedb's own reader."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        header = read_header(f)
        fd = os.open(f, os.O_RDONLY)
        try:
            for t in header.tensors:
                if t.dtype not in DTYPES or not DTYPES[t.dtype][2]:
                    continue  # integer buffers and the like: not part of the merge
                raw = np.empty(t.nbytes, np.uint8)
                pread_into(fd, memoryview(raw), t.start, f)
                f32 = as_float32(raw.view(DTYPES[t.dtype][1]), t.dtype, np.empty(t.numel, np.float32))  # (numel,)
                out[t.name] = f32.reshape(t.shape)
        finally:
            os.close(fd)
    return out


def _norm(a: dict[str, np.ndarray], b: dict[str, np.ndarray] | None) -> float:
    total = 0.0
    for k, v in a.items():
        if v.dtype.kind != "f":
            continue
        x = _f64(v) - (_f64(b[k]) if b is not None else 0.0)
        total += float(np.sum(x * x))
    return float(np.sqrt(total))


def _f64(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float64)
