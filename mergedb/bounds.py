"""Error bounds and estimates of a plan, beyond plan_bounds.sql's sums: the bound on the output
as written (rounded to its dtype) and the sketch estimate of ‖θ_B − θ_F‖.

Both read the temporary table plan_ranked that the planner has just filled, in its transaction.
"""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pyarrow as pa

from .faults import unregister
from .resources import query

# float32 arithmetic of the executor (unit roundoff 2^-24, smallest subnormal step 2^-149)
_U32 = 2.0**-24


def rounded_bound(
    con: duckdb.DuckDBPyConnection, base_id: int, n_experts: int, scale: np.ndarray
) -> tuple[float | None, str | None]:
    """The bound on ‖θ_B − θ_F‖ of the written output (queries/plan_bounds_rounded.sql), or None
    and why. Each element is c32_k·Δ_k summed over K experts in float32 plus the base: K + 2
    roundings, so γ = γ_{K+2} = (K+2)u/(1−(K+2)u); products can underflow by 2^-150 each. A base
    scale s ≠ 1 (`scale[tensor_idx]`, SLERP) adds two (s rounded to float32, s·θ₀) and a product."""
    scaled = bool(np.any(scale != 1.0))
    k = n_experts + 2 + (2 if scaled else 0)
    gamma = k * _U32 / (1 - k * _U32)
    eta32 = (n_experts + scaled) * 2.0**-150
    con.register(
        "_plan_scale",
        pa.table(
            {"tensor_idx": pa.array(np.arange(len(scale)), pa.int32()), "base_scale": pa.array(scale, pa.float64())}
        ),
    )
    try:
        bound, missing, overflow = con.execute(query("plan_bounds_rounded"), [base_id, gamma, eta32]).fetchall()[0]
    finally:
        unregister(con, "_plan_scale")
    if missing:
        return None, (
            f"{missing} blocks' base norms are unknown (the base was registered before mergedb stored them); "
            "the bound is for the float32 merge before rounding to the output dtype"
        )
    if overflow:
        return None, f"{overflow} blocks could overflow the output dtype; rounding may give ±Inf there"
    return float(bound), None


def sketch_estimate(con: duckdb.DuckDBPyConnection, coefs: np.ndarray) -> float:
    """‖Σ_omitted c_k Δ_kb‖ estimated per block: exact diagonal c_k²‖Δ_kb‖² plus sketched cross
    terms ⟨c_j S Δ_jb, c_k S Δ_kb⟩, c_k = coefs[position, tensor_idx]. Streams the omitted rows in
    batches: memory stays bounded."""
    reader = con.sql(
        "SELECT r.tensor_idx, r.block_idx, r.position, eb.delta_norm, eb.sketch FROM plan_ranked r "
        "JOIN expert_blocks eb USING (checkpoint_id, tensor_idx, block_idx) WHERE NOT r.selected AND NOT r.free "
        "ORDER BY r.tensor_idx, r.block_idx, r.position"
    ).to_arrow_reader(1 << 18)
    c_of = np.asarray(coefs, np.float64)  # (K, T)
    total = 0.0
    carry: tuple[np.ndarray, ...] | None = None
    for batch in reader:
        key = batch.column(0).to_numpy().astype(np.int64) << 32 | batch.column(1).to_numpy()
        c = c_of[batch.column(2).to_numpy(), batch.column(0).to_numpy()]
        norms = batch.column(3).to_numpy()
        sk = batch.column(4)
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
