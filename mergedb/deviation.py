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
- model_stock, kind `sketch, t from sketches`: per tensor θ_B − θ_F = (t_B − t_F)·S_R − t_F·S_O, with
  S_R, S_O = Σ Δ_kb/K over the read and omitted blocks and t = K·cos/(1 + (K−1)·cos) (stock.py), cos
  the mean pairwise cosine of the task vectors. t_F uses exact dots; t_B uses the sketches' dots
  for pairs not both read, whose noise has variance ‖Δ_jb‖²‖Δ_kb‖²/D per block (D the sketch
  dimension). So the estimate is the sketch estimate of t·S_O (c_kt = t_t/K, t from the exact norms
  and every block's sketched dots) plus Σ_t t'(cos)²·Var(cos_B − cos_F)·‖S_R‖² (‖S_R‖² from the
  exact norms, cross terms dropped): near cos = 0, t is steep and the noise term dominates.
- TIES-style methods (ties, dare_ties, breadcrumbs_ties, della), kind `consensus model`:
  consensus.deviation for the plan's read sets (see consensus.py).
Nothing omitted (every non-free block read): 0 for every method.
"""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, consensus, greedy, methods
from .arrowcols import column
from .tensorparams import TensorValues


def kind(method: methods.Method) -> str:
    """est_kind of a method's estimate (see the module note)."""
    if method.linear:
        return "sketch"
    if method.consensus:
        return "consensus model"
    if method.sparsify in ("random", "della"):
        return "sketch + drop variance"
    if method.sparsify == "band":
        return "trimmed diagonal"
    return "sketch, t from sketches"


CONSENSUS_MAX_CELLS = 100_000  # above this many (expert, block) cells the consensus model is opt-in


def by_default(method: methods.Method, c: greedy.Candidates, omitted: int, max_rows: int) -> bool:
    """Whether a plan computes the estimate without being asked (PlanRequest.estimate None): up to
    `max_rows` omitted blocks (planner.ESTIMATE_MAX_ROWS), and for the consensus model (about 1 s per 100k cells of
    experts × family blocks on one core) up to CONSENSUS_MAX_CELLS cells."""
    if method.consensus:
        return int(c.position.max(initial=-1) + 1) * c.n_family_blocks <= CONSENSUS_MAX_CELLS
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
) -> float:
    """The estimate of ‖θ_B − θ_F‖ for selection `sel` of candidates `c` (see the module note)."""
    left = ~sel & ~c.free
    if not left.any():
        return 0.0
    if method.consensus:
        model = consensus.fetch(con, method, values, params, ids, trims, fam, drop_nonfinite)
        read = np.zeros(model.p.shape, bool)
        read[c.position[sel], c.gblock[sel]] = True
        return consensus.deviation(model, read)
    if method.sparsify == "band":  # value = |c_k|·trimmed norm (plan_candidates_trimmed.sql)
        return float(math.sqrt(float(np.sum(c.value[left] ** 2))))
    noise = 0.0
    coef = values.coef
    if method.name == "model_stock":
        read = np.zeros((len(ids), int(fam.first_block[-1])), bool)
        read[c.position[sel], c.gblock[sel]] = True
        coef, noise = _stock_terms(con, ids, fam, read)
    omitted = pa.table(
        {
            "checkpoint_id": column(np.asarray(ids, np.int32)[c.position[left]]),
            "position": column(c.position[left]),
            "tensor_idx": column(c.tensor_idx[left]),
            "block_idx": column(c.block_idx[left]),
        }
    )
    est = math.sqrt(bounds.sketch_estimate(con, coef, omitted) ** 2 + noise)
    if method.sparsify in ("random", "della"):  # value = |c_k|·‖Δ_kb‖ (plan_candidates.sql)
        p = values.density[c.position[left], c.tensor_idx[left]]
        est = math.sqrt(est**2 + float(np.sum(c.value[left] ** 2 * (1.0 / p - 1.0))))
    return est


def _stock_terms(
    con: duckdb.DuckDBPyConnection, ids: tuple[int, ...], fam: bounds.FamilyBlocks, read: np.ndarray
) -> tuple[np.ndarray, float]:
    """model_stock: (K, T) c_kt = t_t/K, and Σ_t t'(cos)²·Var(cos_B − cos_F)·‖S_R‖² (module note);
    `read` (K, B) the plan's read blocks."""
    k, n_tensors = len(ids), fam.first_block.size - 1
    t = con.sql(
        "SELECT tensor_idx, block_idx, list_position(?, checkpoint_id) - 1 AS position, delta_norm, sketch "
        "FROM expert_blocks WHERE list_contains(?, checkpoint_id) AND NOT identical",
        params=[list(ids), list(ids)],
    ).to_arrow_table()
    tix = t.column("tensor_idx").to_numpy().astype(np.int64)
    blk = t.column("block_idx").to_numpy().astype(np.int64)
    pos = t.column("position").to_numpy().astype(np.int64)
    nsq_rows = t.column("delta_norm").to_numpy() ** 2
    dim = len(t.column("sketch")[0]) if t.num_rows else 1
    sk = t.column("sketch").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
    scale, noise = np.zeros(n_tensors), 0.0
    pairs = max(k * (k - 1) // 2, 1)
    for ti in np.flatnonzero(np.bincount(tix)):  # the tensors present, ascending (np.unique imports numpy.ma)
        rows = np.flatnonzero(tix == ti)
        nb = int(fam.first_block[ti + 1] - fam.first_block[ti])
        dense = np.zeros((nb, k, dim))  # (blocks, K, D) the tensor's sketches
        dense[blk[rows], pos[rows]] = sk[rows]
        nsq = np.zeros((nb, k))  # (blocks, K) ‖Δ_kb‖²
        nsq[blk[rows], pos[rows]] = nsq_rows[rows]
        gram = np.einsum("bjd,bkd->jk", dense, dense)
        n2 = nsq.sum(axis=0)  # (K,) exact ‖Δ_k‖²
        den = np.sqrt(np.outer(n2, n2))
        cos = np.where(den > 0, gram / np.where(den > 0, den, 1.0), 0.0)
        c = (cos.sum() - np.trace(cos)) / 2 / pairs
        d = 1 + (k - 1) * c
        scale[ti] = k * c / d if d != 0 else 0.0
        a = nsq / np.where(n2 > 0, n2, 1.0)[None, :]  # (blocks, K) ‖Δ_kb‖² / ‖Δ_k‖²
        r = read[:, fam.first_block[ti] : fam.first_block[ti + 1]].T  # (blocks, K)
        ar = a * r
        both_read = ((ar.sum(1) ** 2 - (ar**2).sum(1)) / 2).sum()  # Σ_b Σ_{j<k} a_bj a_bk, both read
        every = ((a.sum(1) ** 2 - (a**2).sum(1)) / 2).sum()
        var_c = (every - both_read) / dim / pairs**2
        slope = k / d**2 if d != 0 else 0.0
        noise += slope**2 * var_c * float((nsq * r).sum()) / k**2
    return np.repeat((scale / k)[None, :], k, axis=0), noise
