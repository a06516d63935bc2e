"""manifest.mask_table and mask_digest on masks in any row order and chunking, against the rows
sorted in Python (a stable sort on (position, tensor_idx, block_idx)) and sha256 written out here."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace

import numpy as np
import pyarrow as pa

from mergedb import manifest
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest


def _reference(xp, rows):
    names, tensors = [e.name for e in xp.experts], list(xp.tensors)
    out = []
    for r in sorted(rows, key=lambda r: (r["position"], r["tensor_idx"], r["block_idx"])):
        t = tensors[r["tensor_idx"]]
        out.append(
            {
                "expert": names[r["position"]],
                "position": r["position"],
                "tensor": t.name,
                "tensor_idx": r["tensor_idx"],
                "block_idx": r["block_idx"],
                "row_start": t.rows[r["block_idx"]][0],
                "row_end": t.rows[r["block_idx"]][1],
                "content_hash": r["content_hash"],
            }
        )
    return out


def test_mask_table_and_digest_in_any_row_order(tmp_path, tiny_family):
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tiny_family], base_model="base")
    pid = cat.plan(PlanRequest("base", None, "ties", "60%", params={"density": 0.5})).plan_id
    xp = cat.execution_plan(pid)
    rows = xp.mask.to_pylist()
    assert len(rows) > 4
    keys = sorted((r["position"], r["tensor_idx"], r["block_idx"]) for r in rows)
    h = hashlib.sha256()
    for col in range(3):
        h.update(struct.pack(f"<{len(keys)}q", *(k[col] for k in keys)))
    rng = np.random.default_rng(1)
    for n_chunks in (1, 3):
        for shuffle in (False, True):
            order = rng.permutation(len(rows)) if shuffle else np.arange(len(rows))
            shuffled = [rows[i] for i in order]
            tbl = pa.Table.from_pylist(shuffled, schema=xp.mask.schema)
            tbl = pa.Table.from_batches(tbl.to_batches(max_chunksize=-(-len(rows) // n_chunks)), schema=tbl.schema)
            got = replace(xp, mask=tbl)
            assert manifest.mask_table(got).to_pylist() == _reference(xp, shuffled)
            assert manifest.mask_digest(tbl) == h.hexdigest()
