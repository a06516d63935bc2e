"""Room for a sweep's outputs: whether they fit on the disk of OUT, asked before anything is planned
(their tensors, from the bases' layouts) and again once the plans are made (all an output holds).
A disk that fills half-way through a sweep fails its plans late; these refuse it up front.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import planner
from .errors import MergeDBError
from .units import format_size

if TYPE_CHECKING:
    from .catalog import Catalog
    from .manifest import ExecutionPlan


def check_space(root: Path, xps: list[ExecutionPlan], dtypes: list[str | None]) -> int:
    """Refuse, before anything runs, a sweep whose outputs exceed the free space where they go (N
    outputs of a model's size each: a disk that fills half-way fails the plans late). Counted: the
    tensors, and a bound on the rest of each output (the base's side files, which a real tokenizer
    makes megabytes; safetensors headers, manifest and mask; a file-system block per file), which the
    tensors alone left out (review, 2026-12-03: a sweep that fitted by its tensors filled the disk).
    Returns the tensors' bytes (what the progress bar counts)."""
    from .layout import output_dtype
    from .sidefiles import side_files
    from .tensorfile import normalize_dtype, tensor_nbytes

    need = sum(
        tensor_nbytes(output_dtype(t, normalize_dtype(dt)), t.shape) for xp, dt in zip(xps, dtypes) for t in xp.tensors
    )
    per_base: dict[str, tuple[int, int]] = {}  # base path -> (its side files, their bytes): listed once
    extra = 0
    for xp in xps:
        if xp.base.path not in per_base:
            base = Path(xp.base.path)
            folder = base if base.is_dir() else base.parent
            try:
                side = side_files(folder) if "://" not in xp.base.path else []
                per_base[xp.base.path] = (len(side), sum((folder / f).stat().st_size for f in side))
            except OSError:
                per_base[xp.base.path] = (0, 0)
        n_side, sides = per_base[xp.base.path]
        headers = sum(len(t.name) + 200 for t in xp.tensors)  # a header entry; the manifest's per tensor
        files = n_side + 4 + sum(tensor_nbytes(t.dtype, t.shape) for t in xp.tensors) // (1 << 30)  # + shards
        extra += sides + 3 * headers + xp.mask.nbytes + (64 << 10) + files * 4096
    _refuse_short(root, len(xps), need + extra, "", "stored")
    return need


def check_space_early(cat: Catalog, root: Path, requests: list[Any], dtypes: list[str | None]) -> None:
    """`check_space` on the outputs' tensors alone, from the bases' layouts before anything is planned:
    a grid too big for the disk was refused only after every point was planned and loaded (2,000
    points: 2.5 minutes with the catalog locked; review, 2026-12-03). Stored plans given by id or name
    are counted once planned, by `check_space`."""
    from .tensorfile import normalize_dtype, tensor_nbytes

    asked = [(r.base, dt) for r, dt in zip(requests, dtypes) if isinstance(r, planner.PlanRequest)]
    if not asked:
        return
    rows = cat.sql(
        "SELECT c.name, ft.dtype, ft.shape, ft.mergeable FROM family_tensors ft "
        "JOIN checkpoints c ON c.checkpoint_id = ft.base_id WHERE list_contains(?, c.name)",
        [sorted({b for b, _ in asked})],
    ).to_pylist()
    by_base: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_base.setdefault(r["name"], []).append(r)
    need = 0
    for base, dt in asked:
        out_dt = normalize_dtype(dt)
        need += sum(
            tensor_nbytes(out_dt if t["mergeable"] and out_dt else t["dtype"], t["shape"])
            for t in by_base.get(base, [])
        )
    _refuse_short(root, len(asked), need, "at least ", "planned")


def _refuse_short(root: Path, n: int, need: int, least: str, nothing: str) -> None:
    free = shutil.disk_usage(nearest(root)).free
    if need > free:
        raise MergeDBError(
            f"the sweep's {n} outputs need {least}{format_size(need)} ({need:,} bytes) under {root} but its disk "
            f"has {format_size(free)} ({free:,} bytes) free; free space, choose another DIR, or sweep fewer plans "
            f"(nothing was {nothing})"
        )


def nearest(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a link counts, dangling or not)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path
