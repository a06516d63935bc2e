"""The execution plan as a plain value, and the manifest that makes an output replayable.

An `ExecutionPlan` holds everything a merge needs (parameters, file locations, the layout, the
mask as an Arrow table) and no database connection, so the same value runs in this process, on
threads or on remote workers. The manifest (`mergedb_manifest.json` beside `mask.parquet`) is
that value written down, plus the output's tensor hashes: `content_hash` covers every
deterministic field, so an edited manifest is detected before it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import MergeDBError
from .layout import TensorLayout

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

    def selected(self) -> dict[int, dict[int, list[tuple[int, str]]]]:
        """tensor_idx -> block_idx -> [(position, content_hash)] in plan order."""
        out: dict[int, dict[int, list[tuple[int, str]]]] = {}
        cols = [self.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx", "content_hash")]
        for pos, t, b, h in sorted(zip(*cols)):
            out.setdefault(t, {}).setdefault(b, []).append((pos, h))
        return out


def mask_digest(mask: pa.Table) -> str:
    """sha256 over the selected (position, tensor_idx, block_idx), sorted, as little-endian int64.

    The one definition used by the planner (plan hash), the manifest and `check --output`."""
    order = mask.select(["position", "tensor_idx", "block_idx"]).sort_by(
        [("position", "ascending"), ("tensor_idx", "ascending"), ("block_idx", "ascending")]
    )
    h = hashlib.sha256()
    for col in order.columns:
        h.update(col.to_numpy().astype("<i8").tobytes())
    return h.hexdigest()


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


def content_hash(doc: dict[str, Any]) -> str:
    """sha256 of the manifest's deterministic part (everything but `run` and `content_hash`)."""
    det = {k: v for k, v in doc.items() if k not in ("run", "content_hash")}
    return hashlib.sha256(json.dumps(det, sort_keys=True).encode()).hexdigest()


def build_manifest(xp: ExecutionPlan, dtype: str | None, tensor_hashes: dict[str, str]) -> dict[str, Any]:
    """The deterministic part of the manifest, with a content hash over all of it."""
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
        "mask_digest": mask_digest(xp.mask),
        "tensor_hashes": tensor_hashes,
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


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def read_manifest(manifest_path: str | os.PathLike[str]) -> tuple[dict[str, Any], pa.Table]:
    """The manifest document and its mask table, checked against the content hash and digest."""
    path = Path(manifest_path)
    try:
        doc = json.loads(path.read_text())
        mask = pq.read_table(path.parent / MASK)
    except (OSError, ValueError) as e:
        raise MergeDBError(f"cannot read {path} or its {MASK}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise MergeDBError(f"{path}: not a {FORMAT} manifest")
    if content_hash(doc) != doc.get("content_hash"):
        raise MergeDBError(
            f"{path}: content_hash does not match the manifest's contents (edited?); re-execute the plan"
        )
    return doc, mask


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
