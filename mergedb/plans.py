"""Stored plans, read back: summaries for people (`PlanSummary`) and the plain `ExecutionPlan`
value the executor runs. Only reads; plans are made by planner.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from . import methods, planhash
from .checkpoint import gone
from .errors import CatalogError, ChangedFileError, PlanError
from .layout import TensorLayout, n_rows
from .manifest import ExecutionPlan, Source
from .tensorparams import COLUMNS as TENSOR_PARAM_COLUMNS
from .units import utf8


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

    plan_id: int | None  # None: a plan made and not stored (frontier.make_plans without keep)
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
    # bound on ‖θ_B − θ_F‖ of the output as written, rounded to the base's dtype (also holds for
    # --dtype fp32); None with bound_note saying why, or for plans made before schema 005
    bound_rounded: float | None = None
    bound_note: str | None = None
    # access-set rules and how est_error was estimated (schema/011, accessrules.py, deviation.py)
    value_model: str = "norm"
    min_coverage: float | None = None
    est_kind: str | None = None
    strategy: str = "ranked"  # or "random": the ablation baseline (schema/004)


_HEX = frozenset("0123456789abcdefABCDEF")


def validate_plan_name(name: str) -> None:
    """Refuse a plan name that `resolve_plan` could confuse with an id or a plan-hash prefix."""
    why = None
    if not name.strip() or name != name.strip() or any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        why = "is empty, has leading or trailing spaces, or control characters"
    elif not utf8(name):  # a name from bytes in another encoding: DuckDB refuses it deep in a statement
        why = "is not valid UTF-8 (bytes in another encoding)"
    elif name.isdigit():
        why = "looks like a plan id"
    elif len(name) >= 6 and set(name) <= _HEX:
        why = "looks like a plan-hash prefix"
    if why:
        raise PlanError(f"plan name {name!r} {why}; pick a name with a letter outside a-f, e.g. --name ties-25pct")


def resolve_plan(con: duckdb.DuckDBPyConnection, plan: int | str | PlanSummary) -> int:
    """The plan_id of a plan given by id, name or plan-hash prefix (at least 6 characters), tried
    in that order: an exact id wins over a name, an exact name over a hash prefix; or by its summary."""
    if isinstance(plan, PlanSummary):
        if plan.plan_id is not None:
            got = con.execute("SELECT plan_hash FROM plans WHERE plan_id = ?", [plan.plan_id]).fetchall()
            if got != [(plan.plan_hash,)]:
                raise PlanError(
                    f"plan {plan.plan_id} of this catalog is not the plan summarised ({plan.plan_hash[:12]}…): it was "
                    "made in another catalog (pass its id, name or hash to the catalog that holds it), or forgotten "
                    "since (`mergedb forget --with-plans`; its id may now be another plan's)"
                )
        plan = plan.plan_id
    if plan is None:
        raise PlanError(
            "no plan given (None): a frontier's plans are not stored unless it keeps them "
            "(frontier(..., keep=True), `mergedb frontier --keep`); pass a stored plan's id, name or hash"
        )
    text = str(plan).strip()
    if not utf8(text):
        raise PlanError(f"no plan matching {text!r}: it is not valid UTF-8 (bytes in another encoding)")
    if text.isascii() and text.isdigit():  # not "²": int() refuses other digits
        rows = con.execute("SELECT plan_id FROM plans WHERE plan_id = ?", [int(text)]).fetchall()
        if rows:
            return int(rows[0][0])
    rows = con.execute("SELECT plan_id FROM plans WHERE name = ?", [text]).fetchall()
    if len(rows) == 1:
        return int(rows[0][0])
    if not rows and len(text) >= 6:
        rows = con.execute("SELECT plan_id FROM plans WHERE starts_with(plan_hash, ?)", [text.lower()]).fetchall()
        if len(rows) == 1:
            return int(rows[0][0])
    if rows:  # the same request planned twice has one hash: its prefix can never pick one of them
        ids = sorted(int(r[0]) for r in rows)
        shown = ", ".join(map(str, ids[:5])) + (" …" if len(ids) > 5 else "")
        raise PlanError(f"several plans match {text!r} (ids {shown}); give one by its id, e.g. {ids[0]}")
    raise PlanError(f"no plan matching {text!r}; `mergedb plans` lists them")


def load_plan(con: duckdb.DuckDBPyConnection, plan_id: int) -> PlanSummary:
    """A stored plan's summary."""
    return load_plans(con, plan_id)[0]


def load_plans(con: duckdb.DuckDBPyConnection, plan_id: int | None = None) -> list[PlanSummary]:
    """Stored plans' summaries by plan_id: every plan, or the one `plan_id`. Two statements whatever
    their number (a statement per plan took `mergedb plans` 5.7 ms a plan: 6 s for 1,000)."""
    one = plan_id is not None
    params = [plan_id] if one else []
    rows = con.execute(
        f"SELECT {', '.join(f'p.{c}' for c in _SUMMARISED)}, p.params, b.name FROM plans p "
        f"JOIN checkpoints b ON b.checkpoint_id = p.base_id {'WHERE p.plan_id = ?' if one else ''} ORDER BY p.plan_id",
        params,
    ).fetchall()
    experts: dict[int, list[ExpertSummary]] = {}
    for pid, *r in con.execute(
        f"SELECT pe.plan_id, c.name, {', '.join(f'pe.{c}' for c in _EXPERT_SUMMARISED)} "
        "FROM plan_experts pe JOIN checkpoints c USING (checkpoint_id) "
        f"{'WHERE pe.plan_id = ?' if one else ''} ORDER BY pe.plan_id, pe.position",
        params,
    ).fetchall():
        experts.setdefault(pid, []).append(ExpertSummary(*r))
    return [_summary(dict(zip(_SUMMARISED, p)), p[-2], p[-1], tuple(experts.get(p[0], ()))) for p in rows]


def summary_of(row: dict[str, Any], experts: dict[str, list], base: str, names: tuple[str, ...]) -> PlanSummary:
    """The summary `load_plans` would read back from a plan's rows just written: its `plans` row
    (`row`, by column), its plan_experts columns (`experts`, a list of values by column, in position
    order), its base's and experts' names. Values are given the types DuckDB gives back."""
    return _summary(
        {c: _stored(c, row[c]) for c in _SUMMARISED},
        row["params"],
        base,
        tuple(
            ExpertSummary(n, *(_stored(c, v) for c, v in zip(_EXPERT_SUMMARISED, vs)))
            for n, *vs in zip(names, *(experts[c] for c in _EXPERT_SUMMARISED))
        ),
    )


def _summary(values: dict[str, Any], params: str, base: str, experts: tuple[ExpertSummary, ...]) -> PlanSummary:
    return PlanSummary(**values, params=json.loads(params), base=base, experts=experts)


# the plans and plan_experts columns a summary holds as stored (ExpertSummary's after its name), and
# those of them that are DOUBLE or text (the others are integers)
_SUMMARISED = (
    "plan_id", "plan_hash", "name", "method", "seed", "budget_spec", "budget_bytes", "full_bytes", "selected_bytes",
    "base_bytes", "n_candidates", "n_selected", "free_blocks", "bound_sum", "bound_blockwise", "est_error",
    "planning_seconds", "bound_rounded", "bound_note", "value_model", "min_coverage", "est_kind", "strategy",
)  # fmt: skip
_EXPERT_SUMMARISED = ("weight", "coef", "full_bytes", "selected_bytes", "bound_sum", "bound_blockwise")
_DOUBLE = frozenset(
    ("weight", "coef", "bound_sum", "bound_blockwise", "est_error", "planning_seconds", "bound_rounded", "min_coverage")
)
_TEXT = frozenset(("plan_hash", "name", "method", "budget_spec", "bound_note", "value_model", "est_kind", "strategy"))


def _stored(col: str, v: Any) -> Any:
    """Column `col`'s value `v` as DuckDB reads it back: a Python float, int or str, or None (numpy's
    scalars, which the planner's arithmetic gives, are no JSON)."""
    if v is None:
        return None
    if col in _TEXT:
        return str(v)
    return float(v) if col in _DOUBLE else int(v)


def _refuse_other_stream(pid: int, method: str, rng: str | None, name: str | None) -> None:
    """Refuse a DARE/DELLA plan made for another random stream than the one this mergedb draws from
    (schema/014): its merge would write other bytes than the plan's, under the plan's hash."""
    if rng == methods.RNG or methods.METHODS.get(method) is None or not methods.METHODS[method].draws:
        return
    stream = (
        f"the stream {rng!r}"
        if rng
        else "a stream it does not record (made before schema 014, before or within a day of its catalog "
        "reaching schema 009: by a mergedb that may have drawn from splitmix64)"
    )
    again = f"make it again under another --name than {name!r}" if name else "make it again"
    raise PlanError(
        f"plan {pid} ({method}) draws its random masks from {stream}, but this mergedb draws from "
        f"{methods.RNG!r}: executing it would write other bytes than the plan's, under its hash; {again} "
        "(the same options and --seed then draw from this stream; its older outputs replay with the mergedb "
        "that wrote them)"
    )


def _refuse_broken_layout(con: duckdb.DuckDBPyConnection, base_id: int, tensors: list[tuple]) -> None:
    """Refuse a base whose block rows no longer tile each tensor's rows (rows deleted or edited): the
    merge would index blocks that are not there."""
    rows = {  # each tensor's layout rows: n_rows of its shape; a simulated catalog's (synth.simulate) lays
        # 1-D tensors out in rows of row_bytes: its bytes over those
        t: {n_rows(tuple(shape)), nb // rb if rb else n_rows(tuple(shape))}
        for t, nb, rb, shape in con.execute(
            "SELECT tensor_idx, nbytes, row_bytes, shape FROM family_tensors WHERE base_id = ?", [base_id]
        ).fetchall()
    }
    broken = [t[1] for t in tensors if t[5][0] != 0 or t[6][-1] not in rows.get(t[0], ()) or t[6][:-1] != t[5][1:]]
    n = len(rows)
    if broken or len(tensors) != n:
        what = f"tensor {broken[0]!r}" if broken else f"{n - len(tensors)} tensor(s)"
        raise CatalogError(
            f"the catalog is damaged: the block rows of {what} of this plan's base no longer cover it; "
            "`mergedb check` lists the damage (register the family into a new catalog to repair it)"
        )


def refuse_gone(xp: ExecutionPlan) -> None:
    """Refuse a plan whose base or experts are no longer at the local paths they were registered
    from, naming every one and how to keep the catalog's rows and plans when they only moved."""
    missing = [
        (role, src)
        for role, src in [("base", xp.base)] + [("expert", e) for e in xp.experts]
        if "://" not in src.path and gone(src.path)
    ]
    if not missing:
        return
    what = ", ".join(f"{role} {src.name!r} ({src.path})" for role, src in missing)
    how = "; ".join(
        f"mergedb register NEW_PATH --name {src.name} "
        + ("--base" if role == "base" else f"--base-model {xp.base.name}")
        for role, src in missing[:3]
    )
    raise ChangedFileError(
        f"plan {xp.plan_id} reads checkpoints that are gone from where they were registered: {what}. Restore them, "
        f"or if they moved, register each where it is now under its name ({how}{'; …' if len(missing) > 3 else ''}; "
        f"a moved family folder: mergedb register NEW_FOLDER --base-model {xp.base.name}): the catalog keeps "
        "their statistics and plans (nothing was merged)"
    )


def execution_plan(con: duckdb.DuckDBPyConnection, pid: int, merge: bool = True) -> ExecutionPlan:
    """Everything the executor needs for plan `pid`: a plain value, no connection inside. Its rows
    are checked against its hash; with `merge` (it is to be merged), its random stream against this
    mergedb's too (a plan read for anything else, e.g. as a mergekit config, draws nothing here)."""
    p = con.execute(
        "SELECT p.plan_hash, p.method, p.params, p.seed, p.budget_bytes, b.name, b.path, b.fingerprint, "
        "b.content_hash, p.base_id, p.rng, p.name, b.root, b.side_files FROM plans p "
        "JOIN checkpoints b ON b.checkpoint_id = p.base_id "
        "WHERE p.plan_id = ?",
        [pid],
    ).fetchall()[0]
    experts = con.execute(
        "SELECT c.name, c.path, pe.fingerprint, pe.content_hash, pe.weight, pe.coef, c.fingerprint, c.content_hash "
        "FROM plan_experts pe LEFT JOIN checkpoints c USING (checkpoint_id) WHERE pe.plan_id = ? "
        "ORDER BY pe.position",
        [pid],
    ).fetchall()
    if any(name is None for name, *_ in experts):  # a merge without it would be another merge
        raise CatalogError(
            f"plan {pid} merges an expert the catalog no longer holds (its checkpoint rows are gone); the "
            f"catalog is damaged: `mergedb check` lists what is missing"
        )
    for name, _, _, planned_content, _, _, _, content in experts:
        if planned_content != content:  # re-registered with other bytes (--refresh of a file changed in place)
            raise ChangedFileError(f"expert {name!r} was re-registered after this plan was made; plan again")
    tensors = con.execute(
        "SELECT ft.tensor_idx, ft.name, ft.dtype, ft.shape, ft.mergeable, "
        "list(row_start ORDER BY block_idx), list(row_end ORDER BY block_idx), list(base_hash ORDER BY block_idx) "
        "FROM family_tensors ft JOIN blocks bl USING (base_id, tensor_idx) WHERE ft.base_id = ? "
        "GROUP BY ALL ORDER BY ft.tensor_idx",
        [p[9]],
    ).fetchall()
    _refuse_broken_layout(con, p[9], tensors)
    mask = con.sql(  # the selected blocks, expanded from the plan's bit strings (schema/010)
        "SELECT pe.position, m.tensor_idx, eb.block_idx, eb.content_hash FROM plan_mask_bits m "
        "JOIN plan_experts pe ON pe.plan_id = m.plan_id AND pe.checkpoint_id = m.checkpoint_id "
        "JOIN expert_blocks eb ON eb.checkpoint_id = m.checkpoint_id AND eb.tensor_idx = m.tensor_idx "
        "WHERE m.plan_id = $1 AND get_bit(m.selected, eb.block_idx) = 1 "
        "ORDER BY 1, 2, 3",
        params=[pid],
    ).to_arrow_table()
    params = json.loads(p[2])
    della = params.get("epsilon") is not None
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
    stock = _stock_dots(con, pid) if p[1] == "model_stock" else None
    per_tensor = con.sql(
        f"SELECT {', '.join(TENSOR_PARAM_COLUMNS)} FROM plan_tensor_params WHERE plan_id = $1 "
        "ORDER BY position, tensor_idx",
        params=[pid],
    ).to_arrow_table()
    xp = ExecutionPlan(
        plan_id=pid,
        plan_hash=p[0],
        method=p[1],
        params=params,
        seed=p[3],
        base=Source(p[5], p[6], p[7], p[8]),
        # each expert's files as registered now: a re-registration of the same bytes (moved, new file times:
        # --refresh) keeps its plans, as a base's does; the hash holds the fingerprints as planned
        experts=tuple(Source(n, path, fp, ch, w, c) for n, path, _, ch, w, c, fp, _ in experts),
        tensors=tuple(
            TensorLayout(n, d, tuple(s), m, tuple(zip(r0, r1)), tuple(h)) for _, n, d, s, m, r0, r1, h in tensors
        ),
        mask=mask,
        trims=trims,
        budget_bytes=p[4],
        stock=stock,
        tensor_params=per_tensor if per_tensor.num_rows else None,
        side_files=(p[12], p[13]),
    )
    planhash.refuse_altered(con, xp)
    if merge:  # after the hash: `check --deep` reads every plan for its hash, whatever its stream
        _refuse_other_stream(pid, p[1], p[10], p[11])
    return xp


def _stock_dots(con: duckdb.DuckDBPyConnection, pid: int) -> pa.Table:
    """model_stock inputs per tensor: exact ‖Δ_k‖² (j == k rows) and, for each expert pair, the
    sketch estimate of ⟨Δ_j, Δ_k⟩ over the blocks where the pair is not both read. A block whose Δ
    holds a NaN/Inf (a plan with allow_nonfinite leaves it out) adds to neither: Δ is 0 there, as
    merged (its NaN norm made every cosine of that expert 0 before)."""
    tbl = con.sql(
        "SELECT eb.tensor_idx, eb.block_idx, pe.position, eb.delta_norm, eb.sketch, coalesce(m.selected, false) AS sel "
        "FROM plan_experts pe JOIN expert_blocks eb ON eb.checkpoint_id = pe.checkpoint_id "
        "LEFT JOIN plan_mask m ON m.plan_id = pe.plan_id AND m.checkpoint_id = eb.checkpoint_id "
        "AND m.tensor_idx = eb.tensor_idx AND m.block_idx = eb.block_idx "
        "WHERE pe.plan_id = $1 AND eb.nonfinite = 0 ORDER BY 1, 2, 3",
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
