"""The budget planner: SQL window queries over the catalog choose which (expert, block) deltas to read.

`make_plan` runs inside the catalog's transaction with the connection the catalog hands it, in
three steps (resolve the request, select blocks, store the plan); the ranking, the cut and the
bounds are the SQL files in `queries/` (see each file's header). plans.py reads stored plans back.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, methods, plancost, planstats, tensorparams
from .errors import MergeDBError, PlanError
from .faults import unregister
from .manifest import mask_digest
from .plans import validate_plan_name
from .resources import query
from .units import parse_size, shown

MAX_FILL_PASSES = 256
ESTIMATE_MAX_ROWS = 2_000_000  # above this many omitted blocks the sketch estimate is opt-in (≈1 s per 1M)


@dataclass(frozen=True)
class PlanRequest:
    """What to merge and how much of the experts may be read."""

    base: str
    experts: tuple[str, ...] | None  # None: every expert of the base
    method: str
    budget: str = "all"
    weights: tuple[float, ...] | None = None  # one per expert; default 1.0 each
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    name: str | None = None
    allow_nonfinite: bool = False  # exclude non-finite blocks instead of refusing the expert
    strategy: str = "ranked"  # "ranked" (value per byte) or "random" (an ablation baseline)
    estimate: bool | None = None  # sketch error estimate: None = only up to ESTIMATE_MAX_ROWS omitted blocks
    # per-(expert, tensor) overrides of `weights` and `params`: columns position int32 (expert position
    # in this request), tensor string (family tensor name), param string (weight | density | epsilon |
    # gamma | lambda | t), value float64; lambda and t are per tensor (one value for all positions)
    tensor_params: pa.Table | None = None


_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_budget(spec: str, full_bytes: int) -> int:
    """Budget bytes from `500MB`, `2GiB`, `25%`, `all` or `0`."""
    text = str(spec).strip()
    example = "write a size with a unit (500MB, 2GiB), a percentage of the full read (25%), or all"
    if text.lower() == "all":
        return full_bytes
    m = _PERCENT.match(text)
    if m:
        pct = float(m.group(1))
        if pct > 100:
            raise PlanError(f"budget {shown(spec)} is over 100%; {example}")
        return int(full_bytes * pct / 100)
    if text.startswith("-"):
        raise PlanError(f"budget {shown(spec)} is negative; {example}")
    if re.fullmatch(r"\d+", text) and text.strip("0"):
        raise PlanError(f"budget {shown(spec)} has no unit; {example}")
    try:
        return parse_size(text, what="budget")  # at most units.MAX_BYTES; more than the full read means all
    except MergeDBError as e:
        raise PlanError(f"{e}; or a percentage of the full read (25%), or all") from None


STRATEGIES = ("ranked", "random")


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> list[tuple]:
    return con.execute(sql, params or []).fetchall()


@dataclass(frozen=True)
class _Inputs:
    """A request resolved against the catalog: ids, fingerprints, canonical parameters."""

    base_id: int
    base_fingerprint: str
    base_content: str
    names: tuple[str, ...]
    ids: tuple[int, ...]
    fingerprints: tuple[str, ...]
    contents: tuple[str, ...]
    weights: tuple[float, ...]
    params: dict[str, Any]
    coefs: tuple[float, ...]  # per expert (plan_experts.coef): per element, averaged over tensors
    values: tensorparams.TensorValues  # per (expert, tensor): what the SQL, thresholds and executor use
    mergeable: tuple[bool, ...]  # per tensor_idx
    method: methods.Method
    nonfinite: tuple[tuple[str, str, int], ...]  # (expert, tensor, count) with NaN/Inf deltas


@dataclass(frozen=True)
class _Selection:
    """What the SQL steps chose (the mask itself stays in the temporary table plan_ranked)."""

    budget: int
    full_bytes: int
    n_candidates: int
    n_free: int
    n_selected: int
    selected_bytes: int
    bound_sum: float | None  # linear methods only
    bound_blockwise: float | None
    bound_rounded: float | None  # after rounding to the output dtype (see queries/plan_bounds_rounded.sql)
    bound_note: str | None  # why bound_rounded is None for a linear method
    per_expert: dict[int, tuple]  # position -> plan_bounds row
    est_error: float | None
    trims: pa.Table
    mask_digest: str


def make_plan(con: duckdb.DuckDBPyConnection, req: PlanRequest) -> tuple[int, list[tuple[str, str, int]]]:
    """Build and store a plan; returns its plan_id and the SQL steps run (step, sql, rows).

    Three steps: resolve the request against the catalog, select blocks with the SQL in
    `queries/`, store the plan. The caller owns the transaction.
    """
    t0 = time.perf_counter()
    if isinstance(req.seed, bool) or not isinstance(req.seed, int) or not 0 <= req.seed < 2**63:
        raise PlanError(f"seed must be a whole number from 0 to 2^63 - 1, got {shown(req.seed)}; e.g. --seed 42")
    if req.strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {req.strategy!r}; use ranked or random")
    if req.name is not None:
        validate_plan_name(req.name)
    if req.name is not None and _rows(con, "SELECT 1 FROM plans WHERE name = ?", [req.name]):
        raise PlanError(f"a plan named {req.name!r} exists already; choose another --name")
    inputs = _resolve(con, req)
    steps: list[tuple[str, str, int]] = []
    sel = _select(con, req, inputs, steps)
    plan_id = _store(con, req, inputs, sel, t0)
    return plan_id, steps


def _resolve(con: duckdb.DuckDBPyConnection, req: PlanRequest) -> _Inputs:
    """Check the base, experts, weights and parameters of a request; refuse non-finite experts."""
    base = _rows(
        con, "SELECT checkpoint_id, fingerprint, content_hash, role FROM checkpoints WHERE name = ?", [req.base]
    )
    if not base or base[0][3] != "base":
        known = [r[0] for r in _rows(con, "SELECT name FROM checkpoints WHERE role = 'base' ORDER BY name")]
        raise PlanError(f"no base named {req.base!r} in the catalog (bases: {', '.join(known) or 'none'})")
    base_id, base_fp, base_content, _ = base[0]
    experts = _rows(
        con,
        "SELECT name, checkpoint_id, fingerprint, content_hash, base_id FROM checkpoints "
        "WHERE role = 'expert' ORDER BY name",
    )
    by_name = {r[0]: r for r in experts}
    names = list(req.experts) if req.experts is not None else [r[0] for r in experts if r[4] == base_id]
    if len(set(names)) != len(names):
        raise PlanError(f"an expert is listed twice in {names}")
    for n in names:
        if n not in by_name:
            raise PlanError(f"no expert named {n!r} in the catalog; `mergedb ls` lists them")
        if by_name[n][4] != base_id:
            raise PlanError(f"expert {n!r} was registered against another base, not {req.base!r}")
    weights = list(req.weights) if req.weights is not None else [1.0] * len(names)
    params = methods.validate(req.method, req.params, weights, len(names))
    ids = [by_name[n][1] for n in names]
    tensors = _rows(
        con, "SELECT name, mergeable, numel FROM family_tensors WHERE base_id = ? ORDER BY tensor_idx", [base_id]
    )
    mergeable = [bool(r[1]) for r in tensors]
    values = tensorparams.resolve(
        req.method, params, weights, req.tensor_params, tuple(names), [r[0] for r in tensors], mergeable
    )
    if req.method == "slerp":
        values = planstats.slerp_values(con, values, base_id, ids[0], names[0])
    coefs = (
        values.expert_coefs(np.array([r[2] for r in tensors]), mergeable)
        if values.per_tensor
        else methods.coefficients(req.method, params, weights)
    )
    bad = _rows(
        con,
        "SELECT c.name, ft.name, CAST(sum(eb.nonfinite) AS BIGINT) FROM expert_blocks eb "
        "JOIN checkpoints c USING (checkpoint_id) JOIN family_tensors ft ON ft.base_id = c.base_id "
        "AND ft.tensor_idx = eb.tensor_idx WHERE eb.nonfinite > 0 AND list_contains(?, eb.checkpoint_id) "
        "GROUP BY ALL ORDER BY 1, 2",
        [ids],
    )
    _refuse_nonfinite_base(con, req.base, base_id, ids)
    if bad and not req.allow_nonfinite:
        e, t, n = bad[0]
        raise PlanError(
            f"expert {e!r} has {n} NaN/Inf values in tensor {t!r}; fix or drop that checkpoint, or pass "
            "--allow-nonfinite to leave its non-finite blocks out of the merge"
        )
    return _Inputs(
        base_id=base_id,
        base_fingerprint=base_fp,
        base_content=base_content,
        names=tuple(names),
        ids=tuple(ids),
        fingerprints=tuple(by_name[n][2] for n in names),
        contents=tuple(by_name[n][3] for n in names),
        weights=tuple(weights),
        params=params,
        coefs=tuple(coefs),
        values=values,
        mergeable=tuple(mergeable),
        method=methods.get_method(req.method),
        nonfinite=tuple(bad),
    )


def _refuse_nonfinite_base(con: duckdb.DuckDBPyConnection, base: str, base_id: int, ids: list[int]) -> None:
    """Blame NaN/Inf in the base on the base (every expert's delta inherits them), with or without
    --allow-nonfinite: leaving those blocks out would still copy the base's NaN/Inf into the merge."""
    rows = _rows(
        con,
        "SELECT ft.name, CAST(sum(bl.base_nonfinite) AS BIGINT) FROM blocks bl JOIN family_tensors ft "
        "USING (base_id, tensor_idx) WHERE bl.base_id = ? AND bl.base_nonfinite > 0 "
        "GROUP BY ALL ORDER BY min(ft.tensor_idx)",
        [base_id],
    )
    fix = "fix the base and register it again under a new --name (its experts with it)"
    if rows:
        t, n = rows[0]
        more = f" (and {len(rows) - 1} more tensors)" if len(rows) > 1 else ""
        raise PlanError(f"base {base!r} has {n} NaN/Inf values in tensor {t!r}{more}; {fix}")
    known = _rows(con, "SELECT count(base_nonfinite) FROM blocks WHERE base_id = ?", [base_id])[0][0]
    if known or len(ids) < 2:
        return
    # a catalog registered before base checks: NaN/Inf in one block of every expert points at the base
    shared = _rows(
        con,
        "SELECT ft.name FROM expert_blocks eb JOIN family_tensors ft ON ft.base_id = ? "
        "AND ft.tensor_idx = eb.tensor_idx WHERE eb.nonfinite > 0 AND list_contains(?, eb.checkpoint_id) "
        "GROUP BY ft.name, eb.tensor_idx, eb.block_idx HAVING count(*) = ? "
        "ORDER BY eb.tensor_idx, eb.block_idx LIMIT 1",
        [base_id, ids, len(ids)],
    )
    if shared:
        raise PlanError(
            f"every expert has NaN/Inf values in the same block of tensor {shared[0][0]!r}: most likely base "
            f"{base!r} holds them (it was registered before mergedb checked bases); {fix}"
        )


def _select(
    con: duckdb.DuckDBPyConnection, req: PlanRequest, inp: _Inputs, steps: list[tuple[str, str, int]]
) -> _Selection:
    """Rank every (expert, block) candidate and cut at the budget: fills the temporary table
    plan_ranked (see queries/plan_*.sql) and measures the bounds and the estimate."""
    k, n = inp.values.coef.shape
    con.register(
        "_plan_experts",  # one row per (expert, tensor): its coefficient there
        pa.table(
            {
                "checkpoint_id": pa.array(np.repeat(inp.ids, n), pa.int32()),
                "position": pa.array(np.repeat(np.arange(k), n), pa.int32()),
                "tensor_idx": pa.array(np.tile(np.arange(n), k), pa.int32()),
                "coef": pa.array(inp.values.coef.reshape(-1), pa.float64()),
            }
        ),
    )
    trims = planstats.thresholds(con, inp.method, inp.values, list(inp.ids))
    con.register("_plan_trim", trims)
    try:
        candidates = "plan_candidates_trimmed" if inp.method.score == "trimmed" else "plan_candidates"
        _run(con, steps, "candidates", query(candidates), [inp.base_id], "SELECT count(*) FROM plan_candidates")
        if req.strategy == "random":
            _run(con, steps, "random", query("plan_random_scores"), [req.seed], "SELECT count(*) FROM plan_candidates")
        if req.allow_nonfinite and inp.nonfinite:
            con.execute(
                "DELETE FROM plan_candidates WHERE (checkpoint_id, tensor_idx, block_idx) IN "
                "(SELECT (checkpoint_id, tensor_idx, block_idx) FROM expert_blocks WHERE nonfinite > 0)"
            )
        steps += plancost.charge_fixed_costs(con, list(inp.ids), random_scores=req.strategy == "random")
        full_bytes, n_cand, n_free = _rows(
            con,
            "SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT), count(*), count(*) FILTER (WHERE free) "
            "FROM plan_candidates",
        )[0]
        budget = parse_budget(req.budget, full_bytes)
        cut = _rows(con, query("plan_cut"), [budget])[0][0]
        steps.append(("cut", query("plan_cut"), 1))
        cut = -(2**62) if cut is None else int(cut)  # everything fits: every bucket is above the cut
        _run(
            con, steps, "prefix", query("plan_prefix"), [budget, cut], "SELECT count(*) FROM plan_ranked WHERE selected"
        )
        _fill(con, budget, steps)
        bound_rows = _rows(con, query("plan_bounds"))
        steps.append(("bounds", query("plan_bounds"), len(bound_rows)))
        rounded, note = None, None
        if inp.method.linear:
            rounded, note = bounds.rounded_bound(con, inp.base_id, len(inp.ids), inp.values.scale)
            steps.append(("bounds_rounded", query("plan_bounds_rounded"), 1))
    finally:
        unregister(con, "_plan_experts")
        unregister(con, "_plan_trim")
    per_expert = {r[0]: r for r in bound_rows if r[0] is not None}
    total = next(r for r in bound_rows if r[0] is None)
    selected_bytes, n_selected = int(total[3] or 0), int(total[5] or 0)
    if selected_bytes > budget:  # cannot happen by construction; never store a plan that breaks it
        raise PlanError(f"internal error: selected {selected_bytes} bytes over the {budget}-byte budget")
    omitted = n_cand - n_free - n_selected
    want_estimate = req.estimate if req.estimate is not None else omitted <= ESTIMATE_MAX_ROWS
    linear = inp.method.linear
    selected = con.sql("SELECT position, tensor_idx, block_idx FROM plan_ranked WHERE selected").to_arrow_table()
    return _Selection(
        budget=budget,
        full_bytes=int(full_bytes),
        n_candidates=int(n_cand),
        n_free=int(n_free),
        n_selected=n_selected,
        selected_bytes=selected_bytes,
        bound_sum=total[1] if linear else None,
        bound_blockwise=total[2] if linear else None,
        bound_rounded=rounded,
        bound_note=note,
        per_expert=per_expert,
        est_error=bounds.sketch_estimate(con, inp.values.coef) if linear and want_estimate else None,
        trims=trims,
        mask_digest=mask_digest(selected),
    )


def _fill(con: duckdb.DuckDBPyConnection, budget: int, steps: list[tuple[str, str, int]]) -> None:
    """Greedy fill after the prefix: repeat queries/plan_fill.sql until a pass adds nothing."""
    fill = query("plan_fill")
    for _ in range(MAX_FILL_PASSES):
        used = _rows(con, "SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM plan_ranked WHERE selected")[0][0]
        added = int(con.execute(fill, [budget - used]).fetchall()[0][0])
        steps.append(("fill", fill, added))
        if added == 0:
            return
    raise PlanError(
        f"internal error: the budget fill did not settle in {MAX_FILL_PASSES} passes; nothing was stored. "
        "Please report this with the catalog's `mergedb sql 'SELECT count(*) FROM expert_blocks'`"
    )


def _store(con: duckdb.DuckDBPyConnection, req: PlanRequest, inp: _Inputs, sel: _Selection, t0: float) -> int:
    """Write the plan, its experts, thresholds and mask; returns the new plan_id."""
    base_bytes = _rows(
        con, "SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM family_tensors WHERE base_id = ?", [inp.base_id]
    )[0][0]
    description = {
        "method": req.method,
        "params": inp.params,
        "seed": req.seed,
        "budget_bytes": sel.budget,
        "strategy": req.strategy,
        "base": {"fingerprint": inp.base_fingerprint, "content": inp.base_content},
        "experts": [
            {"fingerprint": fp, "content": ch, "weight": w}
            for fp, ch, w in zip(inp.fingerprints, inp.contents, inp.weights)
        ],
        "thresholds": hashlib.sha256(_canonical_table(sel.trims)).hexdigest(),
        "mask": sel.mask_digest,
    }
    per_tensor = inp.values.table(list(inp.mergeable)) if inp.values.per_tensor else None
    if per_tensor is not None:  # plans with per-expert values keep the hash they always had
        description["tensor_params"] = hashlib.sha256(_canonical_table(per_tensor)).hexdigest()
    plan_hash = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    plan_id = int(_rows(con, "SELECT coalesce(max(plan_id), 0) + 1 FROM plans")[0][0])
    row = {
        "plan_id": plan_id,
        "name": req.name,
        "plan_hash": plan_hash,
        "method": req.method,
        "params": json.dumps(inp.params, sort_keys=True),
        "seed": req.seed,
        "budget_spec": str(req.budget),
        "budget_bytes": sel.budget,
        "base_id": inp.base_id,
        "base_fingerprint": inp.base_fingerprint,
        "base_content": inp.base_content,
        "full_bytes": sel.full_bytes,
        "selected_bytes": sel.selected_bytes,
        "base_bytes": base_bytes,
        "n_candidates": sel.n_candidates,
        "n_selected": sel.n_selected,
        "free_blocks": sel.n_free,
        "bound_sum": sel.bound_sum,
        "bound_blockwise": sel.bound_blockwise,
        "bound_rounded": sel.bound_rounded,
        "bound_note": sel.bound_note,
        "est_error": sel.est_error,
        "planning_seconds": 0.0,  # set below, once everything is stored
        "strategy": req.strategy,
    }
    _insert(con, "plans", row)
    linear = inp.method.linear
    for pos, (cid, w, c, fp, ch) in enumerate(zip(inp.ids, inp.weights, inp.coefs, inp.fingerprints, inp.contents)):
        b = sel.per_expert.get(pos)
        _insert(
            con,
            "plan_experts",
            {
                "plan_id": plan_id,
                "position": pos,
                "checkpoint_id": cid,
                "weight": w,
                "coef": c,
                "fingerprint": fp,
                "content_hash": ch,
                "full_bytes": int(b[4]) if b else 0,
                "selected_bytes": int(b[3]) if b else 0,
                "bound_sum": (b[1] if b else 0.0) if linear else None,
                "bound_blockwise": (b[2] if b else 0.0) if linear else None,
            },
        )
    con.register("_plan_trim", sel.trims)
    try:
        con.execute(
            "INSERT INTO plan_thresholds (plan_id, checkpoint_id, tensor_idx, t_lo, t_hi, exact) "
            "SELECT ?, checkpoint_id, tensor_idx, t_lo, t_hi, exact FROM _plan_trim",
            [plan_id],
        )
    finally:
        unregister(con, "_plan_trim")
    if per_tensor is not None:
        con.register("_plan_tensor_params", per_tensor)
        try:
            con.execute(
                "INSERT INTO plan_tensor_params (plan_id, position, tensor_idx, weight, coef, density, epsilon, gamma, "
                "lam, t, base_scale) SELECT ?, position, tensor_idx, weight, coef, density, epsilon, gamma, lam, t, "
                "base_scale FROM _plan_tensor_params",
                [plan_id],
            )
        finally:
            unregister(con, "_plan_tensor_params")
    con.execute(
        "INSERT INTO plan_mask (plan_id, checkpoint_id, tensor_idx, block_idx, selected, free, score, value, nbytes) "
        "SELECT ?, checkpoint_id, tensor_idx, block_idx, selected, free, score, value, nbytes FROM plan_ranked",
        [plan_id],
    )
    con.execute("UPDATE plans SET planning_seconds = ? WHERE plan_id = ?", [time.perf_counter() - t0, plan_id])
    return plan_id


def _insert(con: duckdb.DuckDBPyConnection, table: str, row: dict[str, Any]) -> None:
    """INSERT one row, naming its columns (never positional)."""
    cols = ", ".join(row)
    con.execute(f"INSERT INTO {table} ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


def _run(con: duckdb.DuckDBPyConnection, steps: list, name: str, sql: str, params: list[Any], count_sql: str) -> None:
    con.execute(sql, params).fetchall()
    steps.append((name, sql, int(_rows(con, count_sql)[0][0])))


def _canonical_table(t: pa.Table) -> bytes:
    return json.dumps(t.to_pylist(), sort_keys=True, default=str).encode()
