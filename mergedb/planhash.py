"""A plan's identity: the sha256 of what it merges and how, made by the planner when it stores a
plan and made again from the stored rows before the plan is executed (`refuse_altered`), so that a
catalog edited or damaged since cannot merge another model under the plan's name. Older plans were
hashed from other descriptions (weights as ints, no strategy, per-block model_stock, thresholds by
checkpoint id); each is still accepted for the plans it was made for."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import methods
from .arrowcols import column
from .errors import CatalogError
from .manifest import ExecutionPlan, mask_digest


def plan_hash(
    method: str,
    params: dict[str, Any],
    seed: int,
    budget_bytes: int,
    strategy: str | None,
    base: tuple[str, str],
    experts: list[tuple[str, str, float]],
    trims: pa.Table,
    mask: str,
    tensor_params: pa.Table | None,
    unit: str = "block",
) -> str:
    """A plan's identity: sha256 of what it merges and how. Its method, parameters, seed, budget and
    strategy (None: left out, as plans made before schema 004 were hashed); the base's and each
    expert's (fingerprint, content) as planned, with the weights; its thresholds (trims_by_position:
    position, tensor_idx, t_lo, t_hi, exact; by checkpoint_id before 2026-12-03); its mask (manifest.mask_digest);
    per-tensor values where it has them; its unit of selection when it is not the block (methods.Method.
    unit: model_stock's plans by whole tensors since 2026-12-02; its older plans, per block, keep the hash
    they had). The planner makes it, and `refuse_altered` makes it again
    from the stored rows before a plan is executed."""
    description = {
        "method": method,
        "params": params,
        "seed": seed,
        "budget_bytes": budget_bytes,
        **({"strategy": strategy} if strategy is not None else {}),
        "base": {"fingerprint": base[0], "content": base[1]},
        "experts": [{"fingerprint": fp, "content": ch, "weight": w} for fp, ch, w in experts],
        "thresholds": hashlib.sha256(_canonical_table(trims)).hexdigest(),
        "mask": mask,
    }
    if tensor_params is not None:  # plans with per-expert values keep the hash they always had
        description["tensor_params"] = hashlib.sha256(_canonical_table(tensor_params)).hexdigest()
    if unit != "block":
        description["unit"] = unit
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _canonical_table(t: pa.Table) -> bytes:
    """The bytes a table is hashed by: `json.dumps(t.to_pylist(), sort_keys=True, default=str)`. A table of
    numbers and booleans under distinct names (thresholds, per-tensor values) is written a column at a
    time by json's C encoder and joined row by row in that form: the same bytes in under half the time
    (a TIES plan's 528 thresholds, keyed and written: 1.3 -> 0.6 ms)."""
    names = sorted(t.column_names)  # sort_keys; a number's text never holds ", ", so it splits back
    if not t.num_rows or not names or len(set(names)) < len(names) or not all(_numeric(f.type) for f in t.schema):
        return json.dumps(t.to_pylist(), sort_keys=True, default=str).encode()
    columns = [json.dumps(t.column(n).to_pylist())[1:-1].split(", ") for n in names]
    row = "{" + ", ".join(json.dumps(n).replace("%", "%%") + ": %s" for n in names) + "}"
    return ("[" + ", ".join([row % v for v in zip(*columns)]) + "]").encode()


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)


def trims_by_position(trims: pa.Table, ids: Sequence[int]) -> pa.Table | None:
    """A plan's thresholds keyed by expert position (as its manifest keys them), in (position,
    tensor_idx) order: what its hash covers since 2026-12-03, so that one plan over the same
    experts has one hash in every catalog whatever order they were registered in (checkpoint ids
    follow that order). `ids`: the plan's expert checkpoint ids, by position. None when a row names
    a checkpoint that is not one of them (a catalog edited since: its hash cannot match)."""
    at = {int(c): p for p, c in enumerate(ids)}
    checkpoint = trims.column("checkpoint_id").to_pylist()
    if not set(checkpoint) <= set(at):  # an edited catalog's rows: no such form
        return None
    if not trims.num_rows:
        return pa.table({})
    position = np.array([at[c] for c in checkpoint], np.int64)
    order = np.lexsort((trims.column("tensor_idx").to_numpy(), position)).tolist()  # stable, as sorted() was
    keyed = {"position": column(position[order])}
    for f in trims.schema:  # reordered as lists: Table.take would import pyarrow.compute (~35 ms of a first plan)
        if f.name != "checkpoint_id":
            values = trims.column(f.name).to_pylist()
            keyed[f.name] = pa.array([values[i] for i in order], f.type)
    return pa.table(keyed)


def refuse_altered(con: duckdb.DuckDBPyConnection, xp: ExecutionPlan) -> None:
    """Refuse a plan whose stored rows no longer give its hash: a catalog edited or damaged since it
    was planned, which would merge another model than the plan's, even past its budget (its mask)."""
    pid = xp.plan_id
    base_fp, base_content, strategy = con.execute(
        "SELECT base_fingerprint, base_content, strategy FROM plans WHERE plan_id = ?", [pid]
    ).fetchall()[0]
    rows = con.execute(
        "SELECT fingerprint, content_hash, weight, checkpoint_id FROM plan_experts WHERE plan_id = ? ORDER BY position",
        [pid],
    ).fetchall()
    experts = [r[:3] for r in rows]
    trims = con.sql(
        "SELECT checkpoint_id, tensor_idx, t_lo, t_hi, exact FROM plan_thresholds WHERE plan_id = $1 "
        "ORDER BY checkpoint_id, tensor_idx",
        params=[pid],
    ).to_arrow_table()
    mask = mask_digest(xp.mask)
    weighed = [list(experts)]
    if any(float(w).is_integer() for _, _, w in experts):  # plans made before weights were floats: 1, not 1.0
        weighed.append([(fp, ch, int(w) if float(w).is_integer() else w) for fp, ch, w in experts])
    # plans made before schema 004 (every one 'ranked', its default) did not hash their strategy
    strategies = [strategy, None] if strategy == "ranked" else [strategy]
    # a method planned by whole tensors (model_stock) was planned per block before 2026-12-02
    method = methods.METHODS.get(xp.method)
    units = [method.unit, "block"] if method is not None and method.unit != "block" else ["block"]
    base = (base_fp, base_content)
    # thresholds by expert position; plans made before 2026-12-03 hashed them by checkpoint id
    keyed = trims_by_position(trims, [r[3] for r in rows]) if trims.num_rows else None
    forms = [t for t in (keyed, trims) if t is not None]
    if not any(  # lazily: the first (today's) description is the usual match
        plan_hash(xp.method, xp.params, xp.seed, xp.budget_bytes, s, base, ws, t, mask, xp.tensor_params, u)
        == xp.plan_hash
        for t in forms
        for u in units
        for ws in weighed
        for s in strategies
    ):
        raise CatalogError(
            f"plan {pid}'s rows in the catalog no longer give its hash ({xp.plan_hash[:12]}…): the catalog was "
            "edited or damaged since it was planned, and would merge another model; make the plan again "
            "(`mergedb check --deep` lists the plans so altered)"
        )
