"""The budget planner: SQL window queries over the catalog choose which (expert, block) deltas to read.

`make_plan` runs inside the catalog's transaction with the connection the catalog hands it, in
three steps (resolve the request, select blocks, store the plan); the ranking, the cut and the
bounds are the SQL files in `queries/` (see each file's header). plans.py reads stored plans back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import (
    accessrules,
    bounds,
    candidates,
    consensus,
    deviation,
    greedy,
    methods,
    planhash,
    plans,
    planstats,
    tensorparams,
    tensorunit,
)
from .arrowcols import column
from .errors import PlanError, PlanExistsError
from .plans import validate_plan_name
from .units import parse_budget, reads_everything, shown

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
    strategy: str = "ranked"  # "ranked" (by value for the bytes: value_model) or "random" (an ablation baseline)
    estimate: bool | None = None  # sketch error estimate: None = only up to ESTIMATE_MAX_ROWS omitted blocks
    # per-(expert, tensor) overrides of `weights` and `params`: columns position int32 (expert position
    # in this request), tensor string (family tensor name), param string (weight | density | epsilon |
    # gamma | lambda | t), value float64; lambda and t are per tensor (one value for all positions)
    tensor_params: pa.Table | None = None
    # access-set rules (accessrules.py): the value model of a candidate ("norm-sqrt": |c_k|·‖Δ_kb‖ or
    # its trimmed norm per √byte; "norm": the same per byte; "consensus": the TIES model's leave-one-out
    # effect, consensus.py; None: norm-sqrt for ranked plans, norm for random ones) and the fraction
    # of each expert's useful bytes read before the greedy fills by value (None: no coverage rule)
    value_model: str | None = None
    min_coverage: float | None = None

    def __post_init__(self) -> None:
        """Refuse a field of the wrong type when the request is made (a set of experts would bind
        the weights in no fixed order, a str would be read letter by letter); lists become tuples."""
        for f in ("experts", "weights"):
            v = getattr(self, f)
            if isinstance(v, (list, np.ndarray)):  # weights computed with numpy are welcome
                object.__setattr__(self, f, tuple(v.tolist() if isinstance(v, np.ndarray) else v))
        for f, want, ok in (
            ("base", "a base's name", isinstance(self.base, str)),
            ("method", "a method's name, e.g. 'ties'", isinstance(self.method, str)),
            ("experts", "a list or tuple of names, in order (or None: all)", self.experts is None
             or isinstance(self.experts, tuple) and all(isinstance(e, str) for e in self.experts)),
            ("weights", "a list or tuple, one per expert (or None)", self.weights is None
             or isinstance(self.weights, tuple)),
            ("params", "a dict of parameter -> value", isinstance(self.params, dict)),
            ("name", "a str or None", self.name is None or isinstance(self.name, str)),
            ("allow_nonfinite", "True or False", isinstance(self.allow_nonfinite, bool)),
            ("estimate", "True, False or None", self.estimate is None or isinstance(self.estimate, bool)),
            ("tensor_params", "a pyarrow Table or None", self.tensor_params is None
             or isinstance(self.tensor_params, pa.Table)),
        ):  # fmt: skip
            if not ok:
                raise PlanError(f"PlanRequest {f} must be {want}, got {shown(getattr(self, f))}")
        if isinstance(self.seed, np.integer):  # a numpy whole number is one: stored (and hashed) as an int
            object.__setattr__(self, "seed", int(self.seed))
        if isinstance(self.min_coverage, (np.floating, np.integer)):  # np.float32(0.1) as the number it is
            object.__setattr__(self, "min_coverage", self.min_coverage.item())
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise PlanError(f"seed must be a whole number from 0 to 2^63 - 1, got {shown(self.seed)}; e.g. --seed 42")
        if self.strategy not in STRATEGIES:
            raise PlanError(f"unknown strategy {self.strategy!r}; use ranked or random")
        if self.name is not None:
            validate_plan_name(self.name)


def check_request(req: Any) -> None:
    if not isinstance(req, PlanRequest):
        raise PlanError(f"expected a PlanRequest(base, experts, method, budget), got {shown(req)}")


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
    numel: np.ndarray  # (T,) int64 elements per tensor_idx
    base_bytes: int  # the base's tensor bytes (streamed in full by a merge, unbudgeted)
    method: methods.Method
    nonfinite: tuple[tuple[str, str, int], ...]  # (expert, tensor, count) with NaN/Inf deltas
    fam: bounds.FamilyBlocks  # the base family's blocks


@dataclass(frozen=True)
class _Selection:
    """What the greedy chose: the candidates, the selection, its bounds and estimate."""

    budget: int
    fam: bounds.FamilyBlocks
    cands: greedy.Candidates
    sel: np.ndarray  # (N,) bool, the candidates' canonical order
    bounds: greedy.Bounds
    bound_rounded: float | None  # after rounding to the output dtype (see bounds.rounded_bound)
    bound_note: str | None  # why bound_rounded is None for a linear method
    est_error: float | None
    trims: pa.Table
    mask_digest: Callable[[], str]  # greedy.bits_digest_later: waits for the digest
    bits: tuple[np.ndarray, np.ndarray, np.ndarray]  # greedy.bit_strings: present, offsets, chars


def make_plan(con: duckdb.DuckDBPyConnection, req: PlanRequest) -> tuple[plans.PlanSummary, list[tuple[str, str, int]]]:
    """Build and store a plan; returns its summary (what `plans.load_plan` reads back from the rows
    just written, built from the same values: reading it took two statements, ~5 ms of a small
    plan) and the SQL steps run (step, sql, rows).

    Three steps: resolve the request against the catalog, select blocks with the SQL in
    `queries/`, store the plan. The caller owns the transaction.
    """
    t0 = time.perf_counter()
    check_request(req)
    # the next plan id, and whether the name is taken (asked only for a named plan: a statement costs
    # ~0.2 ms, and each aggregate or projection in it ~0.1 ms more)
    plan_id = (_rows(con, "SELECT max(plan_id) FROM plans")[0][0] or 0) + 1
    if req.name is not None and _rows(con, "SELECT plan_id FROM plans WHERE name = ?", [req.name]):
        raise PlanExistsError(f"a plan named {req.name!r} exists already; choose another --name")
    req = replace(req, value_model=accessrules.value_model(req.value_model, req.strategy))
    inputs = _resolve(con, req)
    accessrules.check(req.value_model, req.min_coverage, inputs.method, req.strategy)
    steps: list[tuple[str, str, int]] = []
    sel = _select(con, req, inputs, steps)
    return _store(con, req, inputs, sel, int(plan_id), t0), steps


def candidate_table(con: duckdb.DuckDBPyConnection, req: PlanRequest) -> pa.Table:
    """Every candidate of `req` as the planner scores it, without cutting or storing anything:
    position, tensor_idx, block_idx, nbytes, free, value, score (the caller rolls back)."""
    req = replace(req, value_model=accessrules.value_model(req.value_model, req.strategy))
    inputs = _resolve(con, req)
    accessrules.check(req.value_model, req.min_coverage, inputs.method, req.strategy)
    trims = planstats.thresholds(con, inputs.method, inputs.values, list(inputs.ids), inputs.numel)
    c = _candidates(con, req, inputs, trims)[1]
    return pa.table(
        {k: getattr(c, k) for k in ("position", "tensor_idx", "block_idx", "nbytes", "free", "value", "score")}
    )


def _resolve(con: duckdb.DuckDBPyConnection, req: PlanRequest) -> _Inputs:
    """Check the base, experts, weights and parameters of a request; refuse non-finite experts.
    Its statements have no join and no ORDER BY (the rows are matched and ordered here): each such
    operator costs DuckDB ~0.3 ms, a small plan's largest cost after the statements themselves."""
    rows = _rows(con, "SELECT name, checkpoint_id, fingerprint, content_hash, base_id, role FROM checkpoints")
    rows.sort(key=lambda r: r[0].encode())  # ORDER BY name: DuckDB compares VARCHARs by their UTF-8 bytes
    base = [r for r in rows if r[0] == req.base and r[5] == "base"]
    if not base:
        known = [r[0] for r in rows if r[5] == "base"]
        raise PlanError(f"no base named {req.base!r} in the catalog (bases: {', '.join(known) or 'none'})")
    _, base_id, base_fp, base_content, _, _ = base[0]
    experts = [r for r in rows if r[5] == "expert"]
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
    weights = [float(w) for w in weights]  # numbers of any kind: 2, 2.0 and numpy's 2.0 are one plan
    ids = [by_name[n][1] for n in names]
    tensors = sorted(  # by tensor_idx
        _rows(
            con,
            "SELECT tensor_idx, name, mergeable, numel, nbytes, dtype FROM family_tensors WHERE base_id = ?",
            [base_id],
        )
    )
    tensor_names = [r[1] for r in tensors]
    mergeable = [bool(r[2]) for r in tensors]
    numel = np.array([r[3] for r in tensors], np.int64)
    values = tensorparams.resolve(req.method, params, weights, req.tensor_params, tuple(names), tensor_names, mergeable)
    if req.method == "slerp":
        values = planstats.slerp_values(con, values, base_id, ids[0], names[0])
    coefs = (
        values.expert_coefs(numel, mergeable)
        if values.per_tensor
        else methods.coefficients(req.method, params, weights)
    )
    bad = planstats.nonfinite(con, ids, {by_name[n][1]: n for n in names}, tensor_names)
    fam = candidates.family_blocks(con, base_id, [r[5] for r in tensors])
    planstats.refuse_nonfinite_base(con, req.base, base_id, ids, fam, tensor_names)
    if bad and not req.allow_nonfinite:
        e, t, n = bad[0]
        raise PlanError(
            f"expert {e!r} has {n} NaN/Inf values in tensor {t!r} (in its file, or differences from the base "
            "beyond float32's range); fix or drop that checkpoint, or pass "
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
        numel=numel,
        base_bytes=int(sum(r[4] for r in tensors)),
        method=methods.get_method(req.method),
        nonfinite=tuple(bad),
        fam=fam,
    )


def _select(
    con: duckdb.DuckDBPyConnection, req: PlanRequest, inp: _Inputs, steps: list[tuple[str, str, int]]
) -> _Selection:
    """Score every (expert, block) candidate in SQL (queries/plan_candidates*.sql), fetch them once,
    and cut at the budget in memory (greedy.py): the greedy, the bounds and the estimate."""
    trims = planstats.thresholds(con, inp.method, inp.values, list(inp.ids), inp.numel)
    fam, cands = _candidates(con, req, inp, trims, steps, values=not reads_everything(req.budget))
    budget = parse_budget(req.budget, int(cands.nbytes.sum()))
    if req.min_coverage:  # accessrules.py: forced blocks first, refused if they do not fit
        cands = accessrules.with_coverage(cands, len(inp.ids), float(req.min_coverage), budget)
    drop = bool(req.allow_nonfinite and inp.nonfinite)
    unit_value = None  # tensorunit.py: whole tensors, valued by their estimated full update
    if inp.method.unit == "tensor":
        if req.strategy == "ranked" and not reads_everything(req.budget):
            unit_value = tensorunit.updates(con, inp.ids, fam, drop)
        sqrt_size = req.value_model == "norm-sqrt"
        sel, passes = tensorunit.select(cands, budget, fam.first_block, unit_value, sqrt_size, MAX_FILL_PASSES)
    else:
        sel, passes = greedy.select(cands, budget, MAX_FILL_PASSES)
    bits = greedy.bit_strings(cands, sel, len(inp.ids), fam.first_block)
    digest = greedy.bits_digest_later(bits[2], fam.first_block)  # large plans: hashed beside what follows
    k = len(inp.ids)
    b = greedy.bounds(cands, sel, k, int(fam.first_block[-1]))
    steps.append(("select", "-- greedy.select: bucket cut, sort of the cut bucket, fill passes (numpy)", b.n_selected))
    steps.append(("fill", "-- greedy fill passes until one adds nothing", passes))
    if b.selected_bytes > budget:  # cannot happen by construction; never store a plan that breaks it
        raise PlanError(f"internal error: selected {b.selected_bytes} bytes over the {budget}-byte budget")
    rounded, note = None, None
    if inp.method.linear:
        per_block = greedy.block_sums(cands, sel, int(fam.first_block[-1]))
        rounded, note = bounds.rounded_bound(fam, k, inp.values.scale, b, *per_block)
    omitted = int(cands.score.size) - b.n_free - b.n_selected
    by_default = deviation.by_default(inp.method, cands, omitted, ESTIMATE_MAX_ROWS)
    want_estimate = req.estimate if req.estimate is not None else by_default
    est = None
    if want_estimate:  # deviation.py: every method, by the kind deviation.kind names
        v = inp.values
        est = deviation.estimate(con, inp.method, v, inp.params, inp.ids, trims, fam, cands, sel, drop, unit_value)
    return _Selection(
        budget=budget,
        fam=fam,
        cands=cands,
        sel=sel,
        bounds=b,
        bound_rounded=rounded,
        bound_note=note,
        est_error=est,
        trims=trims,
        mask_digest=digest,
        bits=bits,
    )


def _candidates(
    con: duckdb.DuckDBPyConnection,
    req: PlanRequest,
    inp: _Inputs,
    trims: pa.Table,
    steps: list[tuple[str, str, int]] | None = None,
    values: bool = True,
) -> tuple[bounds.FamilyBlocks, greedy.Candidates]:
    """The scored candidates; values=False: a trimming method's blocks valued by their whole delta's
    norm instead of the trimmed one, for a plan that selects every candidate (reads_everything)."""
    fam = inp.fam
    sc = candidates.Scoring(
        inp.ids,
        inp.values.coef,
        trims,
        trimmed=inp.method.score == "trimmed" and values,
        random_seed=req.seed if req.strategy == "random" else None,
        drop_nonfinite=bool(req.allow_nonfinite and inp.nonfinite),
        sqrt_size=req.value_model == "norm-sqrt",  # accessrules.py: the default, value / √bytes
    )
    cands = candidates.fetch(con, sc, fam, [] if steps is None else steps)
    if req.value_model == "consensus" and values:  # accessrules.py: the TIES model's leave-one-out value
        model = consensus.fetch(con, inp.method, inp.values, inp.params, inp.ids, trims, fam, sc.drop_nonfinite)
        cands = accessrules.with_consensus_value(cands, consensus.leave_one_out(model))
    # an expert's blocks in a tensor where its coefficient is 0 (weight 0, say, in a sweep's grid)
    # add nothing to any method's merge: they are not candidates, so no budget is spent reading them
    if not inp.values.coef.all():  # (K, T): looked up per candidate (a gather over all of them) only then
        cands = cands.without(inp.values.coef[cands.position, cands.tensor_idx] == 0)
    return fam, cands


def _store(
    con: duckdb.DuckDBPyConnection, req: PlanRequest, inp: _Inputs, sel: _Selection, plan_id: int, t0: float
) -> plans.PlanSummary:
    """Write the plan `plan_id`, its experts, thresholds and mask; its summary, as load_plan reads it."""
    per_tensor = inp.values.table(list(inp.mergeable)) if inp.values.per_tensor else None
    linear = inp.method.linear
    b = sel.bounds
    k = len(inp.ids)
    per = np.array(b.per_position, np.float64).reshape(k, 4)  # (K, 4): bound_sum, blockwise, selected, full
    # the experts' rows as list parameters of the INSERT (unnest zips them); as an Arrow table read by
    # name, as the tables below are, they measured the same
    experts = {
        "position": ("INTEGER", list(range(k))),
        "checkpoint_id": ("INTEGER", [int(i) for i in inp.ids]),
        "weight": ("DOUBLE", [float(w) for w in inp.weights]),
        "coef": ("DOUBLE", [float(c) for c in inp.coefs]),
        "fingerprint": ("VARCHAR", list(inp.fingerprints)),
        "content_hash": ("VARCHAR", list(inp.contents)),
        "full_bytes": ("BIGINT", per[:, 3].astype(np.int64).tolist()),
        "selected_bytes": ("BIGINT", per[:, 2].astype(np.int64).tolist()),
        "bound_sum": ("DOUBLE", per[:, 0].tolist() if linear else [None] * k),
        "bound_blockwise": ("DOUBLE", per[:, 1].tolist() if linear else [None] * k),
    }
    present, offsets, chars = sel.bits
    n_tensors = len(inp.mergeable)
    bit_table = pa.table(  # every (position, tensor); the INSERT keeps those with candidates (`present`)
        {
            "checkpoint_id": column(np.repeat(np.asarray(inp.ids, np.int32), n_tensors)),
            "tensor_idx": column(np.tile(np.arange(n_tensors, dtype=np.int32), k)),
            "bits": pa.LargeStringArray.from_buffers(present.size, pa.py_buffer(offsets), pa.py_buffer(chars)),
            "present": column(present),
        }
    )  # filtered in SQL: Table.filter would import pyarrow.compute, ~35 ms of the first plan of a process
    # DuckDB reads these Arrow tables by their names here, the local variables of this frame (its
    # replacement scan): ~0.4 ms less per table than registering and unregistering a view
    _plan_bits, _plan_trim, _plan_tensor_params = bit_table, sel.trims, per_tensor  # noqa: F841
    unnest = ", ".join(f"unnest(${i}::{t}[])" for i, (t, _) in enumerate(experts.values(), 2))
    con.execute(
        f"INSERT INTO plan_experts (plan_id, {', '.join(experts)}) SELECT $1, {unnest}",
        [plan_id, *(v for _, v in experts.values())],
    )
    if sel.trims.num_rows:
        con.execute(
            "INSERT INTO plan_thresholds (plan_id, checkpoint_id, tensor_idx, t_lo, t_hi, exact) "
            "SELECT $1, checkpoint_id, tensor_idx, t_lo, t_hi, exact FROM _plan_trim",
            [plan_id],
        )
    if per_tensor is not None:
        con.execute(
            "INSERT INTO plan_tensor_params (plan_id, position, tensor_idx, weight, coef, density, epsilon, gamma, "
            "lam, t, base_scale) SELECT $1, position, tensor_idx, weight, coef, density, epsilon, gamma, lam, t, "
            "base_scale FROM _plan_tensor_params",
            [plan_id],
        )
    con.execute(
        "INSERT INTO plan_mask_bits (plan_id, checkpoint_id, tensor_idx, selected) "
        "SELECT $1, checkpoint_id, tensor_idx, CAST(bits AS BIT) FROM _plan_bits WHERE present",
        [plan_id],
    )
    plan_hash = planhash.plan_hash(
        req.method,
        inp.params,
        req.seed,
        sel.budget,
        req.strategy,
        (inp.base_fingerprint, inp.base_content),
        list(zip(inp.fingerprints, inp.contents, inp.weights)),
        planhash.trims_by_position(sel.trims, inp.ids),
        sel.mask_digest(),  # the digest thread has run beside the inserts above
        per_tensor,
        inp.method.unit,
    )
    n_candidates = int(sel.cands.score.size)
    row = _insert(  # last, so that planning_seconds counts every step
        con,
        "plans",
        {
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
            "full_bytes": b.full_bytes,
            "selected_bytes": b.selected_bytes,
            "base_bytes": inp.base_bytes,
            "n_candidates": n_candidates,
            "n_selected": b.n_selected,
            "free_blocks": b.n_free,
            "bound_sum": b.bound_sum if linear else None,
            "bound_blockwise": b.bound_blockwise if linear else None,
            "bound_rounded": sel.bound_rounded,
            "bound_note": sel.bound_note,
            "est_error": sel.est_error,
            "planning_seconds": time.perf_counter() - t0,
            "strategy": req.strategy,
            "value_model": req.value_model,
            "min_coverage": req.min_coverage,
            "est_kind": deviation.kind(inp.method) if sel.est_error is not None else None,
            "rng": methods.RNG,  # schema/014: the stream a DARE/DELLA merge of this plan draws from
        },
    )
    return plans.summary_of(row, {c: v for c, (_, v) in experts.items()}, req.base, inp.names)


def _insert(con: duckdb.DuckDBPyConnection, table: str, row: dict[str, Any]) -> dict[str, Any]:
    """INSERT one row, naming its columns (never positional); the row."""
    cols = ", ".join(row)
    con.execute(f"INSERT INTO {table} ({cols}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    return row
