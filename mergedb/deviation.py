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
- model_stock, kind `sketch, t from sketches`: θ_B − θ_F ≈ −t·Σ_omitted Δ_kb/K with the tensor's
  t = K·cos/(1 + (K−1)·cos) (the executor's, stock.py), cos the mean pairwise cosine of the tensor's
  task vectors from the exact norms and the sketched dots of every block: the sketch estimate with
  c_kt = t_t/K. (The executor uses exact dots where both blocks are read, so its t differs a little.)
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
    coef = values.coef if method.name != "model_stock" else _stock_coefs(con, ids, values.coef.shape[1])
    omitted = pa.table(
        {
            "checkpoint_id": pa.array(np.asarray(ids, np.int32)[c.position[left]]),
            "position": pa.array(c.position[left]),
            "tensor_idx": pa.array(c.tensor_idx[left]),
            "block_idx": pa.array(c.block_idx[left]),
        }
    )
    est = bounds.sketch_estimate(con, coef, omitted)
    if method.sparsify in ("random", "della"):  # value = |c_k|·‖Δ_kb‖ (plan_candidates.sql)
        p = values.density[c.position[left], c.tensor_idx[left]]
        est = math.sqrt(est**2 + float(np.sum(c.value[left] ** 2 * (1.0 / p - 1.0))))
    return est


def _stock_coefs(con: duckdb.DuckDBPyConnection, ids: tuple[int, ...], n_tensors: int) -> np.ndarray:
    """(K, T) model_stock's t_t/K per tensor, t from the exact norms and every block's sketched dots."""
    k = len(ids)
    t = con.sql(
        "SELECT tensor_idx, block_idx, list_position(?, checkpoint_id) - 1 AS position, delta_norm, sketch "
        "FROM expert_blocks WHERE list_contains(?, checkpoint_id) AND NOT identical",
        params=[list(ids), list(ids)],
    ).to_arrow_table()
    tix = t.column("tensor_idx").to_numpy().astype(np.int64)
    blk = t.column("block_idx").to_numpy().astype(np.int64)
    pos = t.column("position").to_numpy().astype(np.int64)
    dim = len(t.column("sketch")[0]) if t.num_rows else 0
    sk = t.column("sketch").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)
    gram = np.zeros((n_tensors, k, k))
    dense = np.zeros((int(blk.max(initial=0)) + 1, k, dim))  # one tensor's blocks at a time
    for ti in np.unique(tix):
        rows = np.flatnonzero(tix == ti)
        dense[:] = 0.0
        dense[blk[rows], pos[rows]] = sk[rows]
        gram[ti] = np.einsum("bjd,bkd->jk", dense, dense)
        norm2 = np.bincount(pos[rows], weights=t.column("delta_norm").to_numpy()[rows] ** 2, minlength=k)
        np.fill_diagonal(gram[ti], norm2)
    norms = np.sqrt(np.einsum("tkk->tk", gram))  # (T, K)
    den = norms[:, :, None] * norms[:, None, :]
    cos = np.where(den > 0, gram / np.where(den > 0, den, 1.0), 0.0)
    pairs = max(k * (k - 1) // 2, 1)
    c = (cos.sum(axis=(1, 2)) - np.einsum("tkk->t", cos)) / 2 / pairs  # (T,) mean over j < k
    scale = np.where(1 + (k - 1) * c != 0, k * c / np.where(1 + (k - 1) * c != 0, 1 + (k - 1) * c, 1.0), 0.0)
    return np.repeat((scale / k)[None, :], k, axis=0)
