"""The budget planner: SQL window queries over the catalog choose which (expert, block) deltas to read.

`make_plan` runs inside the catalog's transaction with the connection the catalog hands it; the
ranking, the cut and the bounds are the SQL files in `queries/` (see each file's header).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import executor, methods, stats
from .errors import ChangedFileError, PlanError
from .units import parse_size

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


@dataclass(frozen=True)
class ExpertSummary:
    name: str
    weight: float
    coef: float
    full_bytes: int
    selected_bytes: int
    bound_sum: float | None
    bound_blockwise: float | None

    @property
    def coverage(self) -> float:
        return self.selected_bytes / self.full_bytes if self.full_bytes else 1.0


@dataclass(frozen=True)
class PlanSummary:
    """A stored plan, as `mergedb plan` and `mergedb show-plan` report it."""

    plan_id: int
    plan_hash: str
    name: str | None
    method: str
    params: dict[str, Any]
    seed: int
    budget_spec: str
    budget_bytes: int
    full_bytes: int
    selected_bytes: int
    base_bytes: int
    n_candidates: int
    n_selected: int
    free_blocks: int
    bound_sum: float | None
    bound_blockwise: float | None
    est_error: float | None
    planning_seconds: float
    base: str
    experts: tuple[ExpertSummary, ...]
    explain: tuple[tuple[str, str, int], ...] = ()


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
            raise PlanError(f"budget {spec!r} is over 100%; {example}")
        return int(full_bytes * pct / 100)
    if text.startswith("-"):
        raise PlanError(f"budget {spec!r} is negative; {example}")
    if re.fullmatch(r"\d+", text) and int(text) != 0:
        raise PlanError(f"budget {spec!r} has no unit; {example}")
    try:
        return parse_size(text, what="budget")
    except Exception:
        raise PlanError(f"cannot read budget {spec!r}; {example}") from None


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> list[tuple]:
    return con.execute(sql, params or []).fetchall()


def make_plan(
    con: duckdb.DuckDBPyConnection, req: PlanRequest, load_query: Any
) -> tuple[int, list[tuple[str, str, int]]]:
    """Build and store a plan; returns its plan_id and the SQL steps run (step, sql, rows).

    The caller owns the transaction.
    """
    t0 = time.perf_counter()
    steps: list[tuple[str, str, int]] = []
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
    method = methods.get_method(req.method)
    coefs = methods.coefficients(req.method, params, weights)
    ids = [by_name[n][1] for n in names]

    bad = _rows(
        con,
        "SELECT c.name, ft.name, CAST(sum(eb.nonfinite) AS BIGINT) FROM expert_blocks eb "
        "JOIN checkpoints c USING (checkpoint_id) JOIN family_tensors ft ON ft.base_id = c.base_id "
        "AND ft.tensor_idx = eb.tensor_idx WHERE eb.nonfinite > 0 AND list_contains(?, eb.checkpoint_id) "
        "GROUP BY ALL ORDER BY 1, 2",
        [ids],
    )
    if bad and not req.allow_nonfinite:
        e, t, n = bad[0]
        raise PlanError(
            f"expert {e!r} has {n} NaN/Inf values in tensor {t!r}; fix or drop that checkpoint, or pass "
            "--allow-nonfinite to leave its non-finite blocks out of the merge"
        )

    con.register(
        "_plan_experts",
        pa.table(
            {
                "checkpoint_id": pa.array(ids, pa.int32()),
                "position": pa.array(range(len(ids)), pa.int32()),
                "coef": pa.array(coefs, pa.float64()),
            }
        ),
    )
    trim = _thresholds(con, req.method, params, ids)
    con.register("_plan_trim", trim)
    candidates = "plan_candidates_trimmed" if method.score == "trimmed" else "plan_candidates"
    _run(con, steps, "candidates", load_query(candidates), [base_id], "SELECT count(*) FROM plan_candidates")
    if req.strategy not in ("ranked", "random"):
        raise PlanError(f"unknown strategy {req.strategy!r}; use ranked or random")
    if req.strategy == "random":
        _run(con, steps, "random", load_query("plan_random_scores"), [req.seed], "SELECT count(*) FROM plan_candidates")
    if req.allow_nonfinite and bad:
        con.execute(
            "DELETE FROM plan_candidates WHERE (checkpoint_id, tensor_idx, block_idx) IN "
            "(SELECT (checkpoint_id, tensor_idx, block_idx) FROM expert_blocks WHERE nonfinite > 0)"
        )
    full_bytes, n_cand, n_free = _rows(
        con,
        "SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT), count(*), count(*) FILTER (WHERE free) FROM plan_candidates",
    )[0]
    budget = parse_budget(req.budget, full_bytes)
    cut = _rows(con, load_query("plan_cut"), [budget])[0][0]
    steps.append(("cut", load_query("plan_cut"), 1))
    cut = -(2**62) if cut is None else int(cut)  # everything fits: every bucket is above the cut
    _run(
        con,
        steps,
        "prefix",
        load_query("plan_prefix"),
        [budget, cut],
        "SELECT count(*) FROM plan_ranked WHERE selected",
    )
    fill = load_query("plan_fill")
    for _ in range(MAX_FILL_PASSES):
        used = _rows(con, "SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM plan_ranked WHERE selected")[0][0]
        added = con.execute(fill, [budget - used]).fetchall()[0][0]
        steps.append(("fill", fill, int(added)))
        if added == 0:
            break
    bounds = _rows(con, load_query("plan_bounds"))
    steps.append(("bounds", load_query("plan_bounds"), len(bounds)))
    per_expert = {r[0]: r for r in bounds if r[0] is not None}
    total = next(r for r in bounds if r[0] is None)
    selected_bytes, n_selected = int(total[3] or 0), int(total[5] or 0)
    if selected_bytes > budget:  # cannot happen by construction; never store a plan that breaks it
        raise PlanError(f"internal error: selected {selected_bytes} bytes over the {budget}-byte budget")
    omitted = n_cand - n_free - n_selected
    want_estimate = req.estimate if req.estimate is not None else omitted <= ESTIMATE_MAX_ROWS
    est = _sketch_estimate(con, coefs) if method.bound and want_estimate else None
    mask_digest = _mask_digest(con)
    base_bytes = _rows(
        con, "SELECT CAST(coalesce(sum(nbytes), 0) AS BIGINT) FROM family_tensors WHERE base_id = ?", [base_id]
    )[0][0]
    description = {
        "method": req.method,
        "params": params,
        "seed": req.seed,
        "budget_bytes": budget,
        "strategy": req.strategy,
        "base": {"fingerprint": base_fp, "content": base_content},
        "experts": [
            {"fingerprint": by_name[n][2], "content": by_name[n][3], "weight": w} for n, w in zip(names, weights)
        ],
        "thresholds": hashlib.sha256(_canonical_table(trim)).hexdigest(),
        "mask": mask_digest,
    }
    plan_hash = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    if req.name is not None and _rows(con, "SELECT 1 FROM plans WHERE name = ?", [req.name]):
        raise PlanError(f"a plan named {req.name!r} exists already; choose another --name")
    plan_id = int(_rows(con, "SELECT coalesce(max(plan_id), 0) + 1 FROM plans")[0][0])
    additive = method.bound
    con.execute(
        "INSERT INTO plans VALUES (" + ", ".join(["?"] * 21) + ", current_timestamp, ?)",
        [
            plan_id,
            req.name,
            plan_hash,
            req.method,
            json.dumps(params, sort_keys=True),
            req.seed,
            str(req.budget),
            budget,
            base_id,
            base_fp,
            base_content,
            full_bytes,
            selected_bytes,
            base_bytes,
            n_cand,
            n_selected,
            n_free,
            total[1] if additive else None,
            total[2] if additive else None,
            est,
            time.perf_counter() - t0,
            req.strategy,
        ],
    )
    full_by_pos = {pos: r[4] for pos, r in per_expert.items()}
    for pos, (n, w, c) in enumerate(zip(names, weights, coefs)):
        b = per_expert.get(pos)
        con.execute(
            "INSERT INTO plan_experts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                plan_id,
                pos,
                by_name[n][1],
                w,
                c,
                by_name[n][2],
                by_name[n][3],
                int(full_by_pos.get(pos, 0)),
                int(b[3]) if b else 0,
                (b[1] if b else 0.0) if additive else None,
                (b[2] if b else 0.0) if additive else None,
            ],
        )
    con.execute(
        "INSERT INTO plan_thresholds SELECT ?, checkpoint_id, tensor_idx, t_lo, t_hi, exact FROM _plan_trim", [plan_id]
    )
    con.execute(
        "INSERT INTO plan_mask SELECT ?, checkpoint_id, tensor_idx, block_idx, selected, free, score, value, nbytes "
        "FROM plan_ranked",
        [plan_id],
    )
    con.execute("UPDATE plans SET planning_seconds = ? WHERE plan_id = ?", [time.perf_counter() - t0, plan_id])
    for name in ("_plan_experts", "_plan_trim"):
        con.unregister(name)
    return plan_id, steps


def _run(con: duckdb.DuckDBPyConnection, steps: list, name: str, sql: str, params: list[Any], count_sql: str) -> None:
    con.execute(sql, params).fetchall()
    steps.append((name, sql, int(_rows(con, count_sql)[0][0])))


def _thresholds(con: duckdb.DuckDBPyConnection, method_name: str, params: dict[str, Any], ids: list[int]) -> pa.Table:
    """Per (expert, tensor) trim thresholds: exact from the density grid when the density is on it."""
    m = methods.get_method(method_name)
    cols: dict[str, list[Any]] = {"checkpoint_id": [], "tensor_idx": [], "t_lo": [], "t_hi": [], "exact": []}
    if m.sparsify in ("magnitude", "band"):
        gamma = params.get("gamma", 0.0) if m.sparsify == "band" else 0.0
        rows = _rows(
            con,
            "SELECT et.checkpoint_id, et.tensor_idx, et.grid_threshold, et.summary_code, et.summary_count, ft.numel "
            "FROM expert_tensors et JOIN checkpoints c USING (checkpoint_id) JOIN family_tensors ft "
            "ON ft.base_id = c.base_id AND ft.tensor_idx = et.tensor_idx WHERE list_contains(?, et.checkpoint_id) "
            "ORDER BY 1, 2",
            [ids],
        )
        for cid, tidx, grid, codes, counts, numel in rows:
            lo, lo_exact = _threshold_at(gamma + params["density"], grid, codes, counts, numel)
            hi, hi_exact = (None, True)
            if gamma > 0 and int(gamma * numel) >= 1:
                hi, hi_exact = _threshold_at(gamma, grid, codes, counts, numel)
            for k, v in zip(cols, (cid, tidx, lo, hi, lo_exact and hi_exact)):
                cols[k].append(v)
    return pa.table(
        {
            "checkpoint_id": pa.array(cols["checkpoint_id"], pa.int32()),
            "tensor_idx": pa.array(cols["tensor_idx"], pa.int32()),
            "t_lo": pa.array(cols["t_lo"], pa.float32()),
            "t_hi": pa.array(cols["t_hi"], pa.float32()),
            "exact": pa.array(cols["exact"], pa.bool_()),
        }
    )


def _threshold_at(
    density: float, grid: list[float], codes: list[int], counts: list[int], numel: int
) -> tuple[float, bool]:
    hit = np.flatnonzero(np.abs(stats.DENSITY_GRID - density) < 1e-12)
    if len(hit):
        return float(grid[int(hit[0])]), True
    return stats.threshold_from_summary(np.asarray(codes), np.asarray(counts), numel, density), False


def _sketch_estimate(con: duckdb.DuckDBPyConnection, coefs: list[float]) -> float:
    """‖Σ_omitted c_k Δ_kb‖ estimated per block: exact diagonal c_k²‖Δ_kb‖² plus sketched cross
    terms ⟨c_j S Δ_jb, c_k S Δ_kb⟩. Streams the omitted rows in batches: memory stays bounded."""
    reader = con.sql(
        "SELECT r.tensor_idx, r.block_idx, r.position, eb.delta_norm, eb.sketch FROM plan_ranked r "
        "JOIN expert_blocks eb USING (checkpoint_id, tensor_idx, block_idx) WHERE NOT r.selected AND NOT r.free "
        "ORDER BY r.tensor_idx, r.block_idx, r.position"
    ).to_arrow_reader(1 << 18)
    c_of = np.asarray(coefs, np.float64)
    total = 0.0
    carry: tuple[np.ndarray, ...] | None = None
    for batch in reader:
        key = batch.column(0).to_numpy().astype(np.int64) << 32 | batch.column(1).to_numpy()
        c = c_of[batch.column(2).to_numpy()]
        norms = batch.column(3).to_numpy()
        sk = batch.column(4).combine_chunks() if hasattr(batch.column(4), "combine_chunks") else batch.column(4)
        dim = len(sk[0]) if len(sk) else 0
        s = sk.flatten().to_numpy(zero_copy_only=False).reshape(-1, dim) if dim else np.zeros((0, 0), np.float32)
        if carry is not None:  # the last block of the previous batch may continue here
            key, c, norms, s = (np.concatenate([a, b]) for a, b in zip(carry, (key, c, norms, s)))
        cut = int(np.searchsorted(key, key[-1], side="left"))  # keep the last (maybe partial) block
        total += _estimate_blocks(key[:cut], c[:cut], norms[:cut], s[:cut])
        carry = (key[cut:], c[cut:], norms[cut:], s[cut:])
    if carry is not None:
        total += _estimate_blocks(*carry)
    return float(math.sqrt(max(total, 0.0)))


def _estimate_blocks(key: np.ndarray, c: np.ndarray, norms: np.ndarray, s: np.ndarray) -> float:
    if key.size == 0:
        return 0.0
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    cs = s.astype(np.float64) * c[:, None]  # (rows, D) c_k S Δ_kb
    summed = np.add.reduceat(cs, starts, axis=0)  # (blocks, D) sketch of Σ_k c_k Δ_kb
    cross = (summed**2).sum(axis=1) - np.add.reduceat((cs**2).sum(axis=1), starts)
    diag = np.add.reduceat((c * norms) ** 2, starts)
    return float(np.maximum(diag + cross, 0.0).sum())


def _mask_digest(con: duckdb.DuckDBPyConnection) -> str:
    sel = con.sql(
        "SELECT position, tensor_idx, block_idx FROM plan_ranked WHERE selected "
        "ORDER BY position, tensor_idx, block_idx"
    ).to_arrow_table()
    h = hashlib.sha256()
    for col in sel.columns:
        h.update(col.to_numpy().astype("<i8").tobytes())
    return h.hexdigest()


def _canonical_table(t: pa.Table) -> bytes:
    return json.dumps(t.to_pylist(), sort_keys=True, default=str).encode()


def resolve_plan(con: duckdb.DuckDBPyConnection, plan: int | str) -> int:
    """The plan_id of a plan given by id, name or plan-hash prefix."""
    text = str(plan)
    rows = con.execute(
        "SELECT plan_id FROM plans WHERE CAST(plan_id AS VARCHAR) = ? OR name = ? OR plan_hash LIKE ? || '%'",
        [text, text, text if len(text) >= 6 else "\x00"],
    ).fetchall()
    if len(rows) != 1:
        what = "no plan" if not rows else "several plans"
        raise PlanError(f"{what} matching {text!r}; `mergedb plans` lists them")
    return int(rows[0][0])


def load_plan(con: duckdb.DuckDBPyConnection, plan_id: int) -> PlanSummary:
    """A stored plan's summary."""
    p = con.execute(
        "SELECT p.plan_id, p.plan_hash, p.name, p.method, p.params, p.seed, p.budget_spec, p.budget_bytes, "
        "p.full_bytes, p.selected_bytes, p.base_bytes, p.n_candidates, p.n_selected, p.free_blocks, p.bound_sum, "
        "p.bound_blockwise, p.est_error, p.planning_seconds, b.name FROM plans p "
        "JOIN checkpoints b ON b.checkpoint_id = p.base_id WHERE p.plan_id = ?",
        [plan_id],
    ).fetchall()[0]
    experts = tuple(
        ExpertSummary(*r)
        for r in con.execute(
            "SELECT c.name, pe.weight, pe.coef, pe.full_bytes, pe.selected_bytes, pe.bound_sum, pe.bound_blockwise "
            "FROM plan_experts pe JOIN checkpoints c USING (checkpoint_id) WHERE pe.plan_id = ? ORDER BY pe.position",
            [plan_id],
        ).fetchall()
    )
    return PlanSummary(
        plan_id=p[0],
        plan_hash=p[1],
        name=p[2],
        method=p[3],
        params=json.loads(p[4]),
        seed=p[5],
        budget_spec=p[6],
        budget_bytes=p[7],
        full_bytes=p[8],
        selected_bytes=p[9],
        base_bytes=p[10],
        n_candidates=p[11],
        n_selected=p[12],
        free_blocks=p[13],
        bound_sum=p[14],
        bound_blockwise=p[15],
        est_error=p[16],
        planning_seconds=p[17],
        base=p[18],
        experts=experts,
    )


def execution_plan(con: duckdb.DuckDBPyConnection, pid: int) -> executor.ExecutionPlan:
    """Everything the executor needs for plan `pid`: a plain value, no connection inside."""
    p = con.execute(
        "SELECT p.plan_hash, p.method, p.params, p.seed, p.budget_bytes, b.name, b.path, b.fingerprint, "
        "b.content_hash, p.base_id FROM plans p JOIN checkpoints b ON b.checkpoint_id = p.base_id "
        "WHERE p.plan_id = ?",
        [pid],
    ).fetchall()[0]
    experts = con.execute(
        "SELECT c.name, c.path, pe.fingerprint, pe.content_hash, pe.weight, pe.coef, c.fingerprint "
        "FROM plan_experts pe JOIN checkpoints c USING (checkpoint_id) WHERE pe.plan_id = ? "
        "ORDER BY pe.position",
        [pid],
    ).fetchall()
    for name, _, planned, _, _, _, current in experts:
        if planned != current:
            raise ChangedFileError(f"expert {name!r} was re-registered after this plan was made; plan again")
    tensors = con.execute(
        "SELECT ft.tensor_idx, ft.name, ft.dtype, ft.shape, ft.mergeable, "
        "list(row_start ORDER BY block_idx), list(row_end ORDER BY block_idx), list(base_hash ORDER BY block_idx) "
        "FROM family_tensors ft JOIN blocks bl USING (base_id, tensor_idx) WHERE ft.base_id = ? "
        "GROUP BY ALL ORDER BY ft.tensor_idx",
        [p[9]],
    ).fetchall()
    mask = con.sql(
        "SELECT pe.position, m.tensor_idx, m.block_idx, eb.content_hash FROM plan_mask m "
        "JOIN plan_experts pe ON pe.plan_id = m.plan_id AND pe.checkpoint_id = m.checkpoint_id "
        "JOIN expert_blocks eb ON eb.checkpoint_id = m.checkpoint_id AND eb.tensor_idx = m.tensor_idx "
        "AND eb.block_idx = m.block_idx WHERE m.plan_id = $1 AND m.selected "
        "ORDER BY 1, 2, 3",
        params=[pid],
    ).to_arrow_table()
    della = json.loads(p[2]).get("epsilon") is not None
    trims = con.sql(
        "SELECT pe.position, et.tensor_idx, t.t_lo, t.t_hi, "
        + (
            "et.summary_code AS rank_codes, et.summary_count AS rank_counts "
            if della
            else "NULL AS rank_codes, NULL AS rank_counts "
        )
        + "FROM plan_experts pe JOIN expert_tensors et ON et.checkpoint_id = pe.checkpoint_id "
        "LEFT JOIN plan_thresholds t ON t.plan_id = pe.plan_id AND t.checkpoint_id = pe.checkpoint_id "
        "AND t.tensor_idx = et.tensor_idx WHERE pe.plan_id = $1 "
        + ("" if della else "AND t.tensor_idx IS NOT NULL ")
        + "ORDER BY 1, 2",
        params=[pid],
    ).to_arrow_table()
    stock = _stock_dots(con, pid, len(experts)) if p[1] == "model_stock" else None
    return executor.ExecutionPlan(
        plan_id=pid,
        plan_hash=p[0],
        method=p[1],
        params=json.loads(p[2]),
        seed=p[3],
        base=executor.Source(p[5], p[6], p[7], p[8]),
        experts=tuple(executor.Source(n, path, fp, ch, w, c) for n, path, fp, ch, w, c, _ in experts),
        tensors=tuple(
            executor.TensorLayout(n, d, tuple(s), m, tuple(zip(r0, r1)), tuple(h))
            for _, n, d, s, m, r0, r1, h in tensors
        ),
        mask=mask,
        trims=trims,
        budget_bytes=p[4],
        stock=stock,
    )


def _stock_dots(con: duckdb.DuckDBPyConnection, pid: int, k: int) -> pa.Table:
    """model_stock inputs per tensor: exact ‖Δ_k‖² (j == k rows) and, for each expert pair, the
    sketch estimate of ⟨Δ_j, Δ_k⟩ over the blocks where the pair is not both read."""
    tbl = con.sql(
        "SELECT eb.tensor_idx, eb.block_idx, pe.position, eb.delta_norm, eb.sketch, coalesce(m.selected, false) AS sel "
        "FROM plan_experts pe JOIN expert_blocks eb ON eb.checkpoint_id = pe.checkpoint_id "
        "LEFT JOIN plan_mask m ON m.plan_id = pe.plan_id AND m.checkpoint_id = eb.checkpoint_id "
        "AND m.tensor_idx = eb.tensor_idx AND m.block_idx = eb.block_idx "
        "WHERE pe.plan_id = $1 ORDER BY 1, 2, 3",
        params=[pid],
    ).to_arrow_table()
    dots: dict[tuple[int, int, int], float] = {}
    rows = tbl.to_pylist()
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and (rows[j]["tensor_idx"], rows[j]["block_idx"]) == (
            rows[i]["tensor_idx"],
            rows[i]["block_idx"],
        ):
            j += 1
        group = rows[i:j]
        ti = group[0]["tensor_idx"]
        s = np.array([g["sketch"] for g in group], np.float64)  # (experts, D)
        gram = s @ s.T
        for a, ga in enumerate(group):
            dots[(ti, ga["position"], ga["position"])] = (
                dots.get((ti, ga["position"], ga["position"]), 0.0) + ga["delta_norm"] ** 2
            )
            for b in range(a + 1, len(group)):
                gb = group[b]
                if not (ga["sel"] and gb["sel"]):
                    key = (ti, min(ga["position"], gb["position"]), max(ga["position"], gb["position"]))
                    dots[key] = dots.get(key, 0.0) + float(gram[a, b])
        i = j
    keys = sorted(dots)
    return pa.table(
        {
            "tensor_idx": pa.array([x[0] for x in keys], pa.int32()),
            "j": pa.array([x[1] for x in keys], pa.int32()),
            "k": pa.array([x[2] for x in keys], pa.int32()),
            "dot": pa.array([dots[x] for x in keys], pa.float64()),
        }
    )
