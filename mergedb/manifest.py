"""The execution plan as a plain value, and the manifest that makes an output replayable.

An `ExecutionPlan` holds everything a merge needs (parameters, file locations, the layout, the
mask as an Arrow table) and no database connection, so the same value runs in this process, on
threads or on remote workers. The manifest (`mergedb_manifest.json` beside `mask.parquet`) is
that value written down, plus the output's tensor hashes: `content_hash` covers every
deterministic field, so an edited manifest is detected before it is used.

This module is long because a manifest is untrusted input once written: reading it back
(read_manifest, read_mask) and validating every field (manifest_problems) share the writer's field
lists, and split apart they would drift.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import greedy, jsondoc, tensorparams
from .errors import MergeDBError
from .layout import TensorLayout
from .methods import validate
from .plainfile import read_small
from .tensorfile import DTYPE_BITS, MAX_RANK  # MAX_RANK: what a registered file may have

MANIFEST = "mergedb_manifest.json"
MASK = "mask.parquet"
FORMAT = "mergedb-manifest/1"


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
    tensor_params: pa.Table | None = None  # per-(position, tensor_idx) effective values (the columns
    # of tensorparams.COLUMNS) of a plan whose values differ by tensor; None: per expert (Source, params)
    side_files: tuple[str, str | None] | None = None  # the base's (root, checkpoints.side_files) from a
    # catalog: execute refuses a base that lost one since it was registered; None: not known (a manifest's plan)

    def tensor_values(self) -> dict[tuple[int, int], tensorparams.TensorParams]:
        """(position, tensor_idx) -> the values the merge uses there; pairs absent from the plan's
        tensor_params (all of them for a plan with per-expert values) take `default_values`."""
        if self.tensor_params is None:
            return {}
        out = {}
        for r in self.tensor_params.to_pylist():
            out[(r["position"], r["tensor_idx"])] = tensorparams.TensorParams(
                weight=r["weight"],
                coef=r["coef"],
                density=1.0 if r["density"] is None else r["density"],
                epsilon=r["epsilon"],
                lam=1.0 if r["lam"] is None else r["lam"],
                base_scale=r["base_scale"],
            )
        return out

    def default_values(self, pos: int) -> tensorparams.TensorParams:
        """Expert `pos`'s values from the plan-level parameters and its Source."""
        src = self.experts[pos]
        p = self.params
        return tensorparams.TensorParams(
            src.weight, src.coef, float(p.get("density", 1.0)), p.get("epsilon"), float(p.get("lambda", 1.0))
        )

    def selected(self, hashes: bool = True, last: int | None = None) -> dict[int, dict[int, list[tuple[int, str]]]]:
        """tensor_idx -> block_idx -> [(position, content_hash)] in plan order. hashes=False: "" for
        every hash (only --verify reads them; at K = 20 on the bench family the strings were ~5.5 MiB of a merge);
        `last`: tensors 0..last only."""
        pos, ti, bi = (np.asarray(self.mask.column(c).to_numpy()) for c in ("position", "tensor_idx", "block_idx"))
        keep = np.flatnonzero(ti <= last) if last is not None else np.arange(ti.size)
        keep = keep[np.lexsort((pos[keep], bi[keep], ti[keep]))]  # (tensor, block, position): unique
        h = self.mask.column("content_hash").to_pylist() if hashes else None
        bare = [(p, "") for p in range(len(self.experts))]  # hashes=False: one shared pair per position
        out: dict[int, dict[int, list[tuple[int, str]]]] = {}
        for i, p, t, b in zip(keep.tolist(), pos[keep].tolist(), ti[keep].tolist(), bi[keep].tolist()):
            out.setdefault(t, {}).setdefault(b, []).append((p, h[i]) if h is not None else bare[p])
        return out


def mask_digest(mask: pa.Table) -> str:
    """sha256 over the selected (position, tensor_idx, block_idx), sorted, as little-endian int64.

    The one definition used by the planner (plan hash, greedy.mask_digest on sorted arrays), the
    manifest and `check --output`."""
    pos, tix, bix = (_int_column(mask, c) for c in ("position", "tensor_idx", "block_idx"))
    order = np.lexsort((bix, tix, pos))
    return greedy.mask_digest(pos[order], tix[order], bix[order])


def _int_column(t: pa.Table, name: str) -> np.ndarray:
    """An integer column as int64 numpy."""
    return np.asarray(t.column(name).to_numpy(), np.int64)


def _unsorted(pos: np.ndarray, tix: np.ndarray, bix: np.ndarray) -> bool:
    """Whether the rows are out of (position, tensor_idx, block_idx) order (plans store them in it)."""
    dp, dt, db = np.diff(pos), np.diff(tix), np.diff(bix)
    return bool(np.any((dp < 0) | ((dp == 0) & ((dt < 0) | ((dt == 0) & (db < 0))))))


def mask_table(xp: ExecutionPlan) -> pa.Table:
    """The replayable mask: selected blocks with their row ranges and content hashes (vectorised:
    a plan may select millions of blocks)."""
    pos, tix, bix = (_int_column(xp.mask, c) for c in ("position", "tensor_idx", "block_idx"))
    hashes = xp.mask.column("content_hash").combine_chunks()
    if _unsorted(pos, tix, bix):  # a stable sort, as pyarrow's sort_by (its compute module: ~0.03 s to import)
        order = np.lexsort((bix, tix, pos))
        pos, tix, bix = pos[order], tix[order], bix[order]
        hashes = pa.array(np.asarray(hashes.to_numpy(zero_copy_only=False), object)[order], hashes.type)
    first = np.concatenate([[0], np.cumsum([len(t.rows) for t in xp.tensors])]).astype(np.int64)
    rows = np.array([r for t in xp.tensors for r in t.rows], np.int64).reshape(-1, 2)  # (blocks, 2)
    g = first[tix] + bix
    return pa.table(
        {
            "expert": pa.array(np.array([e.name for e in xp.experts], object)[pos], pa.string()),
            "position": pa.array(pos.astype(np.int32)),
            "tensor": pa.array(np.array([t.name for t in xp.tensors], object)[tix], pa.string()),
            "tensor_idx": pa.array(tix.astype(np.int32)),
            "block_idx": pa.array(bix.astype(np.int32)),
            "row_start": pa.array(rows[g, 0]),
            "row_end": pa.array(rows[g, 1]),
            "content_hash": hashes,
        }
    )


def content_hash(doc: dict[str, Any]) -> str:
    """sha256 of the manifest's deterministic part (everything but `run` and `content_hash`): of
    `json.dumps(part, sort_keys=True)`, fed to the hash in pieces (jsondoc.compact_pieces)."""
    h = hashlib.sha256()
    for piece in jsondoc.compact_pieces({k: v for k, v in doc.items() if k not in ("run", "content_hash")}):
        h.update(piece.encode())
    return h.hexdigest()


# what replay and `check --output` take from the manifest's `run` section, which `content_hash` leaves
# out (its timings and byte counts differ run to run): sealed (`run.seal`, their sha256), so an edit of them
# is told (review, 2026-12-03: emptied side_files made a replay delete config.json and report success)
RUN_SEALED = ("side_files", "files", "max_shard_size")


def run_seal(run: dict[str, Any]) -> str:
    """sha256 of `run`'s RUN_SEALED fields (not of the content hash: a deterministic part edited and
    re-hashed is refused by its own checks, with their more telling messages)."""
    sealed = {k: run.get(k) for k in RUN_SEALED}
    return hashlib.sha256(json.dumps(sealed, sort_keys=True, default=str).encode()).hexdigest()


def run_problem(doc: dict[str, Any]) -> str | None:
    """Why the `run` section of a manifest that says it is sealed (`sealed_run`, hashed) is not as
    written; None when it is, or for manifests written before seals."""
    if doc.get("sealed_run") is not True:
        return None
    run = doc.get("run")
    if not isinstance(run, dict) or run.get("seal") != run_seal(run):
        return "its run section (side_files, files, max_shard_size) was edited or removed since it was written"
    return None


def build_manifest(
    xp: ExecutionPlan, dtype: str | None, tensor_hashes: dict[str, str], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The deterministic part of the manifest, with `extra` keys (rng, sealed_run, lora), and a content
    hash over all of it (computed once: 16 experts of 5,000 tensors make an 11 MB manifest, ~145 ms a hash)."""
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
        "tensor_params": xp.tensor_params.to_pylist() if xp.tensor_params is not None else None,
        "mask_digest": mask_digest(xp.mask),
        "tensor_hashes": tensor_hashes,
        **(extra or {}),
    }
    doc["content_hash"] = content_hash(doc)
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


def read_manifest(manifest_path: str | os.PathLike[str]) -> tuple[dict[str, Any], pa.Table]:
    """The manifest document and its mask table, checked against the content hash and digest and
    validated field by field (types, ranges, references), so that a manifest edited and re-hashed
    consistently still cannot crash a replay or make it allocate more than the files hold."""
    path = Path(manifest_path)
    if path.is_dir() and (path / MANIFEST).is_file():  # the output's folder: its manifest
        path = path / MANIFEST
    try:
        doc = json.loads(read_small(path))
    except (OSError, ValueError) as e:
        raise MergeDBError(f"cannot read {path}: {e}") from None
    except RecursionError:  # JSON nested deeper than Python's stack (a manifest mergedb never writes)
        raise MergeDBError(f"{path}: its JSON nests too deeply; not a manifest mergedb wrote") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MergeDBError(f"{path}: not a {FORMAT} manifest")
    try:
        hashed = content_hash(doc)
    except RecursionError:
        raise MergeDBError(f"{path}: its JSON nests too deeply; not a manifest mergedb wrote") from None
    if hashed != doc.get("content_hash"):
        raise MergeDBError(
            f"{path}: content_hash does not match the manifest's contents (edited?); re-execute the plan"
        )
    try:
        mask = read_mask(path.parent / MASK, doc)
    except (OSError, ValueError) as e:
        raise MergeDBError(f"cannot read {path.parent / MASK}: {e}") from None
    problems = manifest_problems(doc, mask)
    if problems:
        raise MergeDBError(f"{path}: {problems[0]}; the manifest was edited or damaged: re-execute the plan")
    sealed = run_problem(doc)
    if sealed:
        raise MergeDBError(f"{path}: {sealed}; restore the manifest, or re-execute the plan")
    return doc, mask


def read_mask(path: Path, doc: dict[str, Any]) -> pa.Table:
    """The mask table at `path`, read only once its metadata shows it fits the manifest `doc`: at most
    one row per (expert, block) its layout holds, each of a few dozen bytes. Parquet compresses a
    column of one repeated value to almost nothing, so a 1 MB file could decode to 30M rows (6.5 GB)
    before any check of its rows ran. Raises ValueError (with the counts) for one that does not fit."""
    meta = pq.ParquetFile(path).metadata  # an unreadable file: OSError or pyarrow's ArrowInvalid (a ValueError)
    experts, layout = doc.get("experts"), doc.get("layout")
    k = len(experts) if isinstance(experts, list) else 0
    rows = [t.get("rows") for t in layout if isinstance(t, dict)] if isinstance(layout, list) else []
    limit = k * sum(len(r) for r in rows if isinstance(r, list))  # a tensor's row bounds outnumber its blocks
    if meta.num_rows > limit:
        raise ValueError(f"it has {meta.num_rows} rows, more than the {limit} (expert, block) pairs the manifest has")
    decoded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if decoded > _MASK_ROW_BYTES * meta.num_rows + (1 << 20):
        raise ValueError(f"it decodes to {decoded} bytes, more than {meta.num_rows} mask rows hold")
    return pq.read_table(path)


_MASK_ROW_BYTES = 512  # a mask row: a few integers and a 32-character hash; generously
_MASK_COLUMNS = ("position", "tensor_idx", "block_idx", "content_hash")
_SOURCE_FIELDS = {"name": str, "path": str, "fingerprint": str, "content_hash": str, "weight": float, "coef": float}
_TOP_FIELDS = {
    "plan_hash": str,
    "method": str,
    "params": dict,
    "seed": int,
    "budget_bytes": int,
    "base": dict,
    "experts": list,
    "layout": list,
    "trims": list,
    "mask_digest": str,
    "tensor_hashes": dict,
}


def _is(v: Any, kind: type) -> bool:
    """JSON type check: bool is not an int here, and an int is a valid float."""
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return isinstance(v, kind)


def manifest_problems(doc: dict[str, Any], mask: pa.Table | None) -> list[str]:
    """What is wrong with a manifest's fields (empty when every type, range and reference holds).

    Only what the manifest can check alone: the executor then checks every layout tensor against
    the base file's header, so sizes are bounded by the real files, never by the manifest."""
    try:
        return _problems(doc, mask)
    except (KeyError, TypeError, ValueError, IndexError, pa.ArrowException) as e:  # a shape not foreseen
        return [f"malformed manifest ({type(e).__name__}: {e})"]


def _problems(doc: dict[str, Any], mask: pa.Table | None) -> list[str]:
    for key, kind in _TOP_FIELDS.items():
        if not _is(doc.get(key), kind):
            return [f"field {key!r} is missing or not a {kind.__name__} (got {doc.get(key)!r:.60})"]
    if doc.get("dtype") is not None and doc["dtype"] not in ("BF16", "F16", "F32"):
        return [f"dtype {doc['dtype']!r:.40} is not one of BF16, F16, F32"]
    if doc["budget_bytes"] < 0:
        return [f"budget_bytes {doc['budget_bytes']} is negative"]
    sources = [doc["base"], *doc["experts"]]
    for i, src in enumerate(sources):
        where = "base" if i == 0 else f"experts[{i - 1}]"
        if not isinstance(src, dict) or set(src) != set(_SOURCE_FIELDS):
            return [f"{where} must have exactly the fields {sorted(_SOURCE_FIELDS)}"]
        for key, kind in _SOURCE_FIELDS.items():
            if not _is(src[key], kind):
                return [f"{where}.{key} is not a {kind.__name__} (got {src[key]!r:.60})"]
        if "\0" in src["path"] or not src["path"]:
            return [f"{where}.path is not a path (got {src['path']!r:.60})"]
    k = len(doc["experts"])
    try:
        validate(doc["method"], doc["params"], [e["weight"] for e in doc["experts"]], k)
    except MergeDBError as e:
        return [f"method/params: {e}"]
    layout = doc["layout"]
    names = set()
    for ti, t in enumerate(layout):
        if not isinstance(t, dict):
            return [f"layout[{ti}] is not an object"]
        for key, kind in (("name", str), ("dtype", str), ("shape", list), ("mergeable", bool), ("rows", list)):
            if not _is(t.get(key), kind):
                return [f"layout[{ti}].{key} is missing or not a {kind.__name__}"]
        if t["dtype"] not in DTYPE_BITS:
            return [f"layout[{ti}] ({t['name']!r:.60}) has unknown dtype {t['dtype']!r:.20}"]
        shape = t["shape"]
        if len(shape) > MAX_RANK or not all(_is(d, int) and d >= 0 for d in shape):
            return [f"layout[{ti}] ({t['name']!r:.60}) has an invalid shape {shape!r:.80}"]
        if t["name"] in names:
            return [f"layout[{ti}]: tensor {t['name']!r:.60} appears twice"]
        names.add(t["name"])
        if problem := _rows_problem(t["rows"], shape[0] if len(shape) >= 2 else 1):
            return [f"layout[{ti}] ({t['name']!r:.60}): {problem}"]
        hashes = t.get("base_hashes", [])
        if (
            not isinstance(hashes, list)
            or len(hashes) not in (0, len(t["rows"]))
            or not all(isinstance(h, str) for h in hashes)
        ):
            return [f"layout[{ti}] ({t['name']!r:.60}): base_hashes must be one string per block"]
    if set(doc["tensor_hashes"]) != names or not all(isinstance(h, str) for h in doc["tensor_hashes"].values()):
        return ["tensor_hashes must map every layout tensor, and only those, to a hash string"]
    for i, r in enumerate(doc["trims"]):
        if problem := _trim_problem(r, k, len(layout)):
            return [f"trims[{i}]: {problem}"]
    stock = doc.get("stock")
    if stock is not None:
        if not isinstance(stock, list):
            return ["stock is not a list"]
        for i, r in enumerate(stock):
            if not (
                isinstance(r, dict)
                and _is(r.get("tensor_idx"), int)
                and 0 <= r["tensor_idx"] < len(layout)
                and all(_is(r.get(c), int) and 0 <= r[c] < k for c in ("j", "k"))
                and _is(r.get("dot"), float)
            ):
                return [f"stock[{i}] needs tensor_idx < {len(layout)}, j and k < {k} and a finite dot"]
    rows = doc.get("tensor_params")
    if rows is not None:
        if not isinstance(rows, list):
            return ["tensor_params is not a list"]
        for i, r in enumerate(rows):
            if problem := tensorparams.row_problem(r, k, len(layout)):
                return [f"tensor_params[{i}]: {problem}"]
    if mask is not None:
        return _mask_problems(doc, mask, k)
    return []


def _rows_problem(rows: list[Any], n: int) -> str | None:
    """Blocks must cover rows [0, n) in order, each [start, end) with start < end (one empty block
    for a tensor without rows)."""
    if not rows:
        return "no blocks"
    prev = 0
    for r in rows:
        if not (isinstance(r, list) and len(r) == 2 and all(_is(x, int) for x in r)):
            return f"block rows {r!r:.40} are not [start, end]"
        if r[0] != prev or not (r[0] < r[1] or (len(rows) == 1 and r[1] == r[0] == n)) or r[1] > n:
            return f"block rows {r!r:.40} do not continue [0, {n}) in order"
        prev = r[1]
    if prev != n:
        return f"blocks end at row {prev}, not at the tensor's {n} rows"
    return None


def _trim_problem(r: Any, k: int, n_tensors: int) -> str | None:
    if not isinstance(r, dict):
        return "not an object"
    if not (_is(r.get("position"), int) and 0 <= r["position"] < k):
        return f"position must be an expert index below {k}"
    if not (_is(r.get("tensor_idx"), int) and 0 <= r["tensor_idx"] < n_tensors):
        return f"tensor_idx must be below {n_tensors}"
    for c in ("t_lo", "t_hi"):
        if r.get(c) is not None and not _is(r[c], float):
            return f"{c} must be a finite number or null"
    codes, counts = r.get("rank_codes"), r.get("rank_counts")
    if codes is not None or counts is not None:
        if not (isinstance(codes, list) and isinstance(counts, list) and len(codes) == len(counts)):
            return "rank_codes and rank_counts must be lists of one length"
        if not all(_is(c, int) and 0 <= c < 1 << 15 for c in codes) or not all(_is(c, int) and c >= 0 for c in counts):
            return "rank_codes must lie in [0, 32768) and rank_counts be counts ≥ 0"
    return None


def _mask_problems(doc: dict[str, Any], mask: pa.Table, k: int) -> list[str]:
    missing = [c for c in _MASK_COLUMNS if c not in mask.column_names]
    if missing:
        return [f"{MASK} lacks the columns {missing}"]
    for c in _MASK_COLUMNS[:3]:
        if not pa.types.is_integer(mask.schema.field(c).type) or mask.column(c).null_count:
            return [f"{MASK} column {c} must hold integers without nulls"]
    if not pa.types.is_string(mask.schema.field("content_hash").type):
        return [f"{MASK} column content_hash must hold strings"]
    n_blocks = np.array([len(t["rows"]) for t in doc["layout"]], np.int64)
    pos, ti, b = (mask.column(c).to_numpy().astype(np.int64) for c in _MASK_COLUMNS[:3])
    t_ok = np.clip(ti, 0, max(len(n_blocks) - 1, 0))
    bad = (pos < 0) | (pos >= k) | (ti < 0) | (ti >= len(n_blocks))
    bad |= (b < 0) | (b >= (n_blocks[t_ok] if len(n_blocks) else 0))
    if bad.any():
        i = int(np.argmax(bad))
        return [f"{MASK} row (position {pos[i]}, tensor_idx {ti[i]}, block_idx {b[i]}) refers to no expert block"]
    key = (pos * len(n_blocks) + ti) * (int(n_blocks.max()) if len(n_blocks) else 1) + b
    order = np.argsort(key, kind="stable")
    twice = np.flatnonzero(key[order][1:] == key[order][:-1])
    if twice.size:
        i = int(order[twice[0] + 1])
        return [f"{MASK} row (position {pos[i]}, tensor_idx {ti[i]}, block_idx {b[i]}) appears twice"]
    if mask_digest(mask) != doc["mask_digest"]:
        return [f"{MASK} does not match the manifest's mask digest"]
    return _described(doc, mask, pos, ti, b)


def _described(doc: dict[str, Any], mask: pa.Table, pos: np.ndarray, ti: np.ndarray, b: np.ndarray) -> list[str]:
    """Problems of the mask's descriptive columns (expert, tensor, row range), which the digest leaves
    out, against the hashed manifest: a reader of mask.parquet trusts them (review, 2026-12-03)."""
    first = np.concatenate([[0], np.cumsum([len(t["rows"]) for t in doc["layout"]])]).astype(np.int64)
    rows = np.array([r for t in doc["layout"] for r in t["rows"]], np.int64).reshape(-1, 2)
    want = {
        "expert": np.array([e["name"] for e in doc["experts"]], object)[pos],
        "tensor": np.array([t["name"] for t in doc["layout"]], object)[ti],
        "row_start": rows[first[ti] + b, 0] if len(rows) else np.zeros(0, np.int64),
        "row_end": rows[first[ti] + b, 1] if len(rows) else np.zeros(0, np.int64),
    }
    for col, expected in want.items():
        if col not in mask.column_names:  # a mask written without it
            continue
        try:
            got = np.asarray(mask.column(col).to_numpy(zero_copy_only=False), expected.dtype)
        except (ValueError, TypeError, pa.ArrowException):
            return [f"{MASK} column {col} holds values of the wrong type (edited?)"]
        wrong = np.flatnonzero(got != expected)
        if wrong.size:
            i = int(wrong[0])
            return [f"{MASK} row {i}: {col} is {got[i]!r}, the manifest says {expected[i]!r} (edited?)"]
    return []


def plan_from_manifest(manifest_path: str | os.PathLike[str]) -> tuple[ExecutionPlan, dict[str, Any]]:
    """Rebuild the ExecutionPlan of an output from its manifest and mask alone (no catalog)."""
    doc, mask = read_manifest(manifest_path)
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
    try:  # rows that passed the field checks can still hold what Arrow cannot take (2**64, a key of two types)
        trims = pa.Table.from_pylist(doc["trims"]) if doc["trims"] else _empty_trims()
        stock = pa.Table.from_pylist(doc["stock"]) if doc.get("stock") else None
    except (OverflowError, pa.ArrowException) as e:
        raise MergeDBError(
            f"{manifest_path}: its trims or stock rows cannot be read ({type(e).__name__}: {str(e):.120}); the "
            "manifest was edited or damaged: re-execute the plan"
        ) from None
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
        stock,
        tensorparams.table_from_rows(doc["tensor_params"]) if doc.get("tensor_params") else None,
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
