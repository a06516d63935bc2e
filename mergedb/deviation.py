"""The plan's estimate of ‖θ_B − θ_F‖ (plans.est_error), for every method, and how it was made
(plans.est_kind, schema/011).

- Additive methods (linear, task arithmetic, SLERP), kind `sketch`: θ_B − θ_F = −Σ_omitted c_k Δ_kb,
  estimated per block by the exact diagonal plus sketched cross terms (bounds.sketch_estimate).
- dare_linear, della_linear, kind `sketch + drop variance`: the kept τ_k = Δ_k·mask/p is unbiased and
  the masks are independent, so E‖Σ_omitted c_k τ_kb‖² = E‖Σ c_k Δ_kb‖² + Σ c_k² ‖Δ_kb‖² (1/p − 1):
  the sketch estimate plus each omitted block's drop variance (p the pair's density; DELLA's
  keep probability averages to it).
- breadcrumbs, kind `trimmed diagonal`: Σ_omitted c_k² ‖τ_kb‖² from the histogram's trimmed norms
  (cross terms of trimmed deltas are not in the catalog; independent deltas make them ≈ 0).
- model_stock, kind `omitted tensors, sketched`: its plans select whole tensors (tensorunit.py), so
  θ_B − θ_F is exactly minus the omitted tensors' full updates u_t = t_t·Σ_k Δ_kt/K; the estimate is
  √(Σ_omitted ‖u_t‖²) with ‖u_t‖ from the exact norms and the sketched dots (tensorunit.updates).
  Plans made before (per block, kind `sketch, t from sketches`) kept the sketch estimate of t·S_O
  plus the noise of t itself; their stored estimate stays as it was.
- TIES-style methods (ties, dare_ties, breadcrumbs_ties, della), kind `consensus model`:
  consensus.deviation for the plan's read sets (see consensus.py).
Nothing omitted (every non-free block read): 0 for every method.
"""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, consensus, greedy, methods, tensorunit
from .arrowcols import column
from .tensorparams import TensorValues


def kind(method: methods.Method) -> str:
    """est_kind of a method's estimate (see the module note)."""
    if method.unit == "tensor":
        return tensorunit.KIND
    if method.linear:
        return "sketch"
    if method.consensus:
        return "consensus model"
    if method.sparsify in ("random", "della"):
        return "sketch + drop variance"
    if method.sparsify == "band":
        return "trimmed diagonal"
    raise ValueError(f"no estimate kind for method {method.name}")  # every method row is named above


CONSENSUS_MAX_CELLS = 100_000  # above this many (expert, block) cells the consensus model is opt-in


def by_default(method: methods.Method, c: greedy.Candidates, omitted: int, max_rows: int) -> bool:
    """Whether a plan computes the estimate without being asked (PlanRequest.estimate None): up to
    `max_rows` omitted blocks (planner.ESTIMATE_MAX_ROWS), and for the consensus model (about 1 s per 100k cells of
    experts × family blocks on one core) up to CONSENSUS_MAX_CELLS cells."""
    if method.consensus:
        return int(c.position.max(initial=-1) + 1) * c.n_family_blocks <= CONSENSUS_MAX_CELLS
    if method.unit == "tensor":  # the per-tensor values the ranking reads already
        return True
    return omitted <= max_rows


def estimate(
    con: duckdb.DuckDBPyConnection,
    method: methods.Method,
    values: TensorValues,
    params: dict,
    ids: tuple[int, ...],
    trims: pa.Table,
    fam: bounds.FamilyBlocks,
    c: greedy.Candidates,
    sel: np.ndarray,
    drop_nonfinite: bool,
    unit_value: np.ndarray | None = None,
) -> float:
    """The estimate of ‖θ_B − θ_F‖ for selection `sel` of candidates `c` (see the module note);
    `unit_value`: a tensor-unit plan's tensorunit.updates when the ranking computed them."""
    left = ~sel & ~c.free
    if not left.any():
        return 0.0
    if method.unit == "tensor":
        value = unit_value if unit_value is not None else tensorunit.updates(con, ids, fam, drop_nonfinite)
        return tensorunit.omitted_norm(c, sel, value)
    if method.consensus:
        model = consensus.fetch(con, method, values, params, ids, trims, fam, drop_nonfinite)
        read = np.zeros(model.p.shape, bool)
        read[c.position[sel], c.gblock[sel]] = True
        return consensus.deviation(model, read)
    if method.sparsify == "band":  # value = |c_k|·trimmed norm (plan_candidates_trimmed.sql)
        return float(math.sqrt(float(np.sum(c.value[left] ** 2))))
    omitted = pa.table(
        {
            "checkpoint_id": column(np.asarray(ids, np.int32)[c.position[left]]),
            "position": column(c.position[left]),
            "tensor_idx": column(c.tensor_idx[left]),
            "block_idx": column(c.block_idx[left]),
        }
    )
    est = bounds.sketch_estimate(con, values.coef, omitted)
    if method.sparsify in ("random", "della"):  # value = |c_k|·‖Δ_kb‖ (plan_candidates.sql)
        p = values.density[c.position[left], c.tensor_idx[left]]
        est = math.sqrt(est**2 + float(np.sum(c.value[left] ** 2 * (1.0 / p - 1.0))))
    return est
