"""Error bounds and estimates of a plan beyond greedy.Bounds' sums: the bound on the output as
written (rounded to its dtype) and the sketch estimate of ‖θ_B − θ_F‖.

The rounded bound (formerly queries/plan_bounds_rounded.sql), for additive methods: only blocks
where some non-free expert block is omitted (set S) can differ: elsewhere θ_B and θ_F compute the
same float32 values in the same order, or both keep the base's bytes. In a block b of S, with
M_b = |s|·‖θ₀,b‖ + Σ_k |c_k|‖Δ_kb‖ (all experts; bounds both merges elementwise; s the tensor's base
scale, 1 except SLERP), rounding and float32 arithmetic move each merge by at most
  r_b = (u·(1+γ) + γ)·M_b + ((1+u)·η₃₂ + η)·sqrt(n_b),
u, η: unit roundoff and half the smallest subnormal step of the output dtype (RNE), γ, η₃₂: the
float32 arithmetic of K experts. So ‖round(θ_B) − round(θ_F)‖ ≤ sqrt(Σ_{b∈S} (v_b + 2 r_b)²),
v_b = Σ_k omitted |c_k|‖Δ_kb‖ (greedy.Bounds.omitted_per_block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from .greedy import Bounds

# float32 arithmetic of the executor (unit roundoff 2^-24, smallest subnormal step 2^-149)
_U32 = 2.0**-24
# output dtype: (u, η, largest finite value)
_FORMATS = {
    "BF16": (2.0**-8, 2.0**-134, 3.3895313892515355e38),
    "F16": (2.0**-11, 2.0**-25, 65504.0),
    "F32": (0.0, 0.0, 3.4028234663852886e38),
}


@dataclass(frozen=True)
class FamilyBlocks:
    """The base family's blocks in (tensor_idx, block_idx) order: block g of the family."""

    first_block: np.ndarray  # (T + 1,) int64: family index of each tensor's block 0; last = block count
    tensor_idx: np.ndarray  # (B,) tensor of each block
    nbytes: np.ndarray  # (B,) int64 bytes of the block in each checkpoint file
    dtype: np.ndarray  # (B,) object: the tensor's dtype name
    base_norm: np.ndarray  # (B,) float64 ‖θ₀,b‖, NaN when unknown (registered before schema 005)
    numel: np.ndarray  # (B,) float64 elements of the block
    base_nonfinite: np.ndarray  # (B,) float64 NaN/Inf elements in the base's block, NaN when unknown


def rounded_bound(
    fam: FamilyBlocks, n_experts: int, scale: np.ndarray, b: Bounds, value_per_block: np.ndarray, differs: np.ndarray
) -> tuple[float | None, str | None]:
    """The bound on ‖θ_B − θ_F‖ of the written output (see the module note), or None and why. Each
    element is c32_k·Δ_k summed over K experts in float32 plus the base: K + 2 roundings, so γ =
    γ_{K+2} = (K+2)u/(1−(K+2)u); products can underflow by 2^-150 each. A base scale s ≠ 1
    (`scale[tensor_idx]`, SLERP) adds two (s rounded to float32, s·θ₀) and a product.
    `value_per_block`, `differs`: greedy.block_sums."""
    scaled = bool(np.any(scale != 1.0))
    k = n_experts + 2 + (2 if scaled else 0)
    gamma = k * _U32 / (1 - k * _U32)
    eta32 = (n_experts + scaled) * 2.0**-150
    known = np.isin(fam.dtype, list(_FORMATS))
    s = np.flatnonzero(differs & known)  # (|S|,) family blocks that can differ
    fmt = np.array([_FORMATS[d] for d in fam.dtype[s]], np.float64).reshape(-1, 3)
    u, eta, max_finite = fmt[:, 0], fmt[:, 1], fmt[:, 2]
    m = np.abs(np.asarray(scale, np.float64)[fam.tensor_idx[s]]) * fam.base_norm[s] + value_per_block[s]
    missing = int(np.isnan(m).sum())
    if missing:
        return None, (
            f"{missing} blocks' base norms are unknown (the base was registered before mergedb stored them); "
            "the bound is for the float32 merge before rounding to the output dtype"
        )
    overflow = int((m * (1 + gamma) >= max_finite).sum())
    if overflow:
        return None, f"{overflow} blocks could overflow the output dtype; rounding may give ±Inf there"
    r = (u * (1 + gamma) + gamma) * m + ((1 + u) * eta32 + eta) * np.sqrt(fam.numel[s])
    return float(math.sqrt(float(np.sum((b.omitted_per_block[s] + 2 * r) ** 2)))), None


def sketch_estimate(con: duckdb.DuckDBPyConnection, coefs: np.ndarray, omitted: pa.Table) -> float:
    """‖Σ_omitted c_k Δ_kb‖ estimated per block: exact diagonal c_k²‖Δ_kb‖² plus sketched cross
    terms ⟨c_j S Δ_jb, c_k S Δ_kb⟩, c_k = coefs[position, tensor_idx]. `omitted`: the omitted
    non-free candidates (checkpoint_id, position, tensor_idx, block_idx). Streams the omitted rows'
    sketches in batches: memory stays bounded."""
    _plan_omitted = omitted  # noqa: F841  (read by its name: DuckDB's replacement scan, as in planner._store)
    reader = con.sql(
        "SELECT r.tensor_idx, r.block_idx, r.position, eb.delta_norm, eb.sketch FROM _plan_omitted r "
        "JOIN expert_blocks eb USING (checkpoint_id, tensor_idx, block_idx) "
        "ORDER BY r.tensor_idx, r.block_idx, r.position"
    ).to_arrow_reader(1 << 18)
    total = _estimate_stream(reader, np.asarray(coefs, np.float64))
    return float(math.sqrt(max(total, 0.0)))


def _estimate_stream(reader: pa.RecordBatchReader, c_of: np.ndarray) -> float:
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
    return total


def _estimate_blocks(key: np.ndarray, c: np.ndarray, norms: np.ndarray, s: np.ndarray) -> float:
    if key.size == 0:
        return 0.0
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    cs = s.astype(np.float64) * c[:, None]  # (rows, D) c_k S Δ_kb
    summed = np.add.reduceat(cs, starts, axis=0)  # (blocks, D) sketch of Σ_k c_k Δ_kb
    cross = (summed**2).sum(axis=1) - np.add.reduceat((cs**2).sum(axis=1), starts)
    diag = np.add.reduceat((c * norms) ** 2, starts)
    return float(np.maximum(diag + cross, 0.0).sum())
