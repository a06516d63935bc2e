"""Per-(expert, tensor) values of a plan: weights, coefficients, densities, thresholds, λ, t.

A request gives one weight per expert and plan-level parameters; `PlanRequest.tensor_params`
overrides them for single (expert, tensor) pairs (what mergekit's gradients and filters produce).
`resolve` checks the overrides and broadcasts everything to (experts, tensors) arrays; the
planner's SQL, its thresholds and bounds, and the executor all use these effective values
(`TensorParams`, one (expert, tensor); `COLUMNS`, the rows stored in plan_tensor_params and the
manifest). Thresholds and SLERP's coefficients need the catalog: planstats.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from . import methods
from .errors import PlanError

PARAMS = ("weight", "density", "epsilon", "gamma", "lambda", "t")
PER_TENSOR = ("lambda", "t")  # one value per tensor, whatever the position
_COLUMNS = {"position": "int32", "tensor": "string", "param": "string", "value": "float64"}


@dataclass(frozen=True)
class TensorParams:
    """What the merge uses for one (expert, tensor)."""

    weight: float  # sign-election weight (TIES-style methods)
    coef: float  # c_k on Δ_k (additive methods)
    density: float  # DARE / DELLA keep probability (1.0 where the method has none)
    epsilon: float | None  # DELLA
    lam: float  # λ of the tensor (TIES-style methods)
    base_scale: float = 1.0  # factor on θ₀ (SLERP: s0 + s1)


COLUMNS = (
    "position",
    "tensor_idx",
    "weight",
    "coef",
    "density",
    "epsilon",
    "gamma",
    "lam",
    "t",
    "base_scale",
)


@dataclass(frozen=True)
class TensorValues:
    """Effective values of a plan, indexed [position, tensor_idx] (per-tensor ones [tensor_idx])."""

    weight: np.ndarray  # (K, T) float64
    coef: np.ndarray  # (K, T) c_k on Δ_k in each tensor
    density: np.ndarray | None  # (K, T), None when the method has no density
    epsilon: np.ndarray | None  # (K, T)
    gamma: np.ndarray | None  # (K, T)
    lam: np.ndarray | None  # (T,)
    t: np.ndarray | None  # (T,) SLERP
    scale: np.ndarray  # (T,) factor on θ₀ (1 except SLERP)
    per_tensor: bool  # values differ by tensor (overrides given, or SLERP): stored in plan_tensor_params

    def table(self, mergeable: list[bool]) -> pa.Table:
        """One row per (position, mergeable tensor): the columns of plan_tensor_params (less plan_id)."""
        k = self.weight.shape[0]
        tix = np.flatnonzero(np.asarray(mergeable, bool))
        pos = np.repeat(np.arange(k), len(tix))
        tt = np.tile(tix, k)

        def col(a: np.ndarray | None, per_tensor: bool = False) -> pa.Array:
            if a is None:
                return pa.nulls(len(pos), pa.float64())
            return pa.array(a[tt] if per_tensor else a[pos, tt], pa.float64())

        return pa.table(
            {
                "position": pa.array(pos, pa.int32()),
                "tensor_idx": pa.array(tt, pa.int32()),
                "weight": col(self.weight),
                "coef": col(self.coef),
                "density": col(self.density),
                "epsilon": col(self.epsilon),
                "gamma": col(self.gamma),
                "lam": col(self.lam, True),
                "t": col(self.t, True),
                "base_scale": col(self.scale, True),
            }
        )

    def expert_coefs(self, numel: np.ndarray, mergeable: list[bool]) -> list[float]:
        """Each expert's coefficient per element (numel-weighted mean over its tensors): plan_experts.coef."""
        w = np.where(np.asarray(mergeable, bool), np.asarray(numel, np.float64), 0.0)
        if w.sum() == 0:
            return [float(c) for c in self.coef[:, 0]] if self.coef.shape[1] else [0.0] * self.coef.shape[0]
        return [float(c) for c in (self.coef * w).sum(axis=1) / w.sum()]


def resolve(
    method: str,
    params: dict[str, Any],
    weights: list[float],
    overrides: pa.Table | None,
    experts: tuple[str, ...],
    tensors: list[str],
    mergeable: list[bool],
) -> TensorValues:
    """Broadcast the plan-level weights and parameters (already validated) to every (expert,
    tensor), apply the overrides, and check every value as `methods.validate` checks plan-level ones."""
    m = methods.get_method(method)
    k, n = len(experts), len(tensors)
    full = {
        "weight": np.repeat(np.asarray(weights, np.float64)[:, None], n, axis=1),
        **{p: np.full((k, n), float(params[p])) for p in ("density", "epsilon", "gamma") if p in params},
        **{p: np.full(n, np.nan if params[p] is None else float(params[p])) for p in PER_TENSOR if p in params},
    }
    given = overrides is not None and overrides.num_rows > 0
    if given:
        _apply(m, overrides, experts, tensors, full)
    merge = np.asarray(mergeable, bool)
    if method == "slerp":
        missing = np.flatnonzero(merge & np.isnan(full["t"]))
        if len(missing):
            raise PlanError(
                f"slerp needs t for every tensor, and tensor {tensors[missing[0]]!r} has none; give a plan-level t "
                "(--t 0.5, or t: 0.5 in a config) or a t row for that tensor in tensor_params"
            )
    _check(method, full, experts, tensors, merge, bool(params.get("normalize")))
    w = full["weight"]
    if method == "linear":
        coef = w / w.sum(axis=0, keepdims=True) if params["normalize"] else w.copy()
    elif method == "model_stock":
        coef = np.full((k, n), 1.0 / k)
    elif method == "slerp":
        coef = np.repeat(full["t"][None, :], k, axis=0)  # lerp's; `slerp_values` sets the true ones
    else:
        coef = full.get("lambda", np.ones(n))[None, :] * w
    big = np.argwhere(merge[None, :] & ~(np.abs(coef) <= methods.MAX_SCALE))
    if len(big):
        i, j = big[0]
        raise PlanError(
            f"the coefficient on {experts[i]!r}'s delta in tensor {tensors[j]!r} would be {coef[i, j]:g} (limit "
            f"{methods.MAX_SCALE:g}): the tensor's weights nearly cancel under normalize, or λ·weight is too large"
        )
    return TensorValues(
        weight=w,
        coef=coef,
        density=full.get("density"),
        epsilon=full.get("epsilon"),
        gamma=full.get("gamma"),
        lam=full.get("lambda"),
        t=full.get("t"),
        scale=np.ones(n),
        per_tensor=given or method == "slerp",
    )


def _apply(
    m: methods.Method, tbl: pa.Table, experts: tuple[str, ...], tensors: list[str], full: dict[str, np.ndarray]
) -> None:
    """Check the override rows and write them into `full`."""
    if not isinstance(tbl, pa.Table) or set(tbl.column_names) != set(_COLUMNS):
        have = tbl.column_names if isinstance(tbl, pa.Table) else type(tbl).__name__
        raise PlanError(f"tensor_params must be an Arrow table with the columns {list(_COLUMNS)}, got {have}")
    types = tbl.schema
    kinds = {
        "position": pa.types.is_integer(types.field("position").type),
        "tensor": pa.types.is_string(types.field("tensor").type)
        or pa.types.is_large_string(types.field("tensor").type),
        "param": pa.types.is_string(types.field("param").type) or pa.types.is_large_string(types.field("param").type),
        "value": pa.types.is_floating(types.field("value").type) or pa.types.is_integer(types.field("value").type),
    }
    for c, want in _COLUMNS.items():
        if not kinds[c]:
            raise PlanError(f"tensor_params column {c!r} is {types.field(c).type}, not {want}")
        if tbl.column(c).null_count:
            raise PlanError(f"tensor_params column {c!r} holds nulls; give every row a {c}")
    pos = [int(x) for x in tbl.column("position").to_pylist()]
    vals = [float(x) for x in tbl.column("value").to_pylist()]
    names, what = tbl.column("tensor").to_pylist(), tbl.column("param").to_pylist()
    index = {t: i for i, t in enumerate(tensors)}
    allowed = [p for p in PARAMS if p in full]
    if m.name in ("model_stock", "slerp"):
        allowed.remove("weight")  # their coefficients ignore weights
    seen: dict[tuple[int, str, str], float] = {}
    per_tensor: dict[tuple[str, str], float] = {}
    for i, (p, t, name, v) in enumerate(zip(pos, names, what, vals)):
        row = f"tensor_params row {i} ({name} of position {p}, tensor {t!r})"
        if not 0 <= p < len(experts):
            raise PlanError(f"{row}: position {p} is not an expert of this plan (0 to {len(experts) - 1})")
        if t not in index:
            raise PlanError(f"{row}: the family has no tensor {t!r}; `mergedb show EXPERT` lists its tensors")
        if name not in allowed:
            raise PlanError(f"{row}: method {m.name} takes no per-tensor {name!r} (it takes: {', '.join(allowed)})")
        if not math.isfinite(v):
            raise PlanError(f"{row}: value {v} is not a finite number")
        if (p, t, name) in seen:
            raise PlanError(f"{row}: {name} of position {p} in tensor {t!r} is given twice")
        seen[(p, t, name)] = v
        if name in PER_TENSOR:
            if per_tensor.setdefault((t, name), v) != v:
                raise PlanError(
                    f"{row}: {name} is one value per tensor, but tensor {t!r} is given {per_tensor[(t, name)]} "
                    f"and {v}; give every position the same {name}"
                )
            full[name][index[t]] = v
        else:
            full[name][p, index[t]] = v


def _check(
    method: str,
    full: dict[str, np.ndarray],
    experts: tuple[str, ...],
    tensors: list[str],
    merge: np.ndarray,
    normalize: bool,
):
    """The plan-level rules of methods.validate, for every (expert, tensor) value."""

    def refuse(bad: np.ndarray, what: str) -> None:
        hit = np.argwhere(bad)
        if len(hit):
            i, j = hit[0] if bad.ndim == 2 else (None, hit[0][0])
            who = f"{experts[i]!r} in " if i is not None else ""
            raise PlanError(f"per-tensor values: {who}tensor {tensors[j]!r}: {what}; fix that tensor_params row")

    lim = methods.MAX_SCALE
    for name in ("weight", "lambda", "t"):
        if name in full:
            refuse(np.abs(full[name]) > lim, f"{name} outside ±{lim:g}")  # NaN: t not given (checked above)
    if "density" in full:
        d = full["density"]
        refuse(~((d > 0) & (d <= 1)), "density must be in (0, 1]")
        if "gamma" in full:
            g = full["gamma"]
            refuse(~((g >= 0) & (g < 1) & (g + d <= 1)), "gamma must be in [0, 1) with gamma + density ≤ 1")
        if "epsilon" in full:
            e = full["epsilon"]
            refuse(~((e >= 0) & (d - e > 0) & (d + e <= 1)), "epsilon must keep density ± epsilon inside (0, 1]")
    if "weight" in full:  # as methods.validate: float32's sums lose a weight below its normal range
        w, tiny = full["weight"], np.finfo(np.float32).tiny
        refuse(
            merge & (w != 0) & (np.abs(w) < tiny),
            f"a weight below float32's normal range ({tiny:.3g}), where the merge's float32 sums lose it; "
            "give 0 or scale the weights up",
        )
    if methods.get_method(method).consensus:
        refuse(merge & (full["weight"] < 0), "a negative weight: " + methods.NEGATIVE_CONSENSUS.format(method=method))
    if method == "linear" and normalize:
        w = full["weight"]
        refuse(
            merge & methods.cancel(w.sum(axis=0), np.abs(w).sum(axis=0)),
            "linear with normalize needs weights that do not sum to zero",
        )


# -- the stored rows, as the manifest carries them --------------------------------------------------


def _finite_or_int(v: Any, kind: type) -> bool:
    """JSON type check as the manifest does it: bool is not a number, an int is a valid float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) if kind is int else math.isfinite(v)


def row_problem(r: Any, k: int, n_tensors: int) -> str | None:
    """What is wrong with one manifest row of per-tensor values (None when nothing is)."""
    if not isinstance(r, dict) or set(r) != set(COLUMNS):
        return f"must have exactly the fields {list(COLUMNS)}"
    if not (_finite_or_int(r["position"], int) and 0 <= r["position"] < k):
        return f"position must be an expert index below {k}"
    if not (_finite_or_int(r["tensor_idx"], int) and 0 <= r["tensor_idx"] < n_tensors):
        return f"tensor_idx must be below {n_tensors}"
    for c in COLUMNS[2:]:
        required = c in ("weight", "coef", "base_scale")
        ok = _finite_or_int(r[c], float) and abs(r[c]) <= methods.MAX_SCALE
        if not ok and (required or r[c] is not None):
            return f"{c} must be a finite number within ±{methods.MAX_SCALE:g}" + ("" if required else " or null")
    d, e = r["density"], r["epsilon"]
    if d is not None and not 0 < d <= 1:
        return "density must be in (0, 1]"
    if e is not None and not (d is not None and 0 <= e and d - e > 0 and d + e <= 1):
        return "epsilon must keep density ± epsilon inside (0, 1]"
    return None


def table_from_rows(rows: list[dict[str, Any]]) -> pa.Table:
    """The manifest's rows back as the table `ExecutionPlan.tensor_params` holds."""
    ints = ("position", "tensor_idx")
    return pa.table({c: pa.array([r[c] for r in rows], pa.int32() if c in ints else pa.float64()) for c in COLUMNS})
