-- plan_bounds_rounded: the bound on ‖θ_B − θ_F‖ for the output as written — every element
-- rounded to its tensor's dtype (the default output: the base's) — for additive methods.
-- Only blocks where some non-free expert block is omitted (set S) can differ: elsewhere θ_B and
-- θ_F compute the same float32 values in the same order, or both keep the base's bytes. In a block
-- b of S, with M_b = |s|·‖θ₀,b‖ + Σ_k |c_k|‖Δ_kb‖ (all experts; bounds both merges elementwise;
-- s the tensor's base scale, 1 except SLERP),
-- rounding and float32 arithmetic move each merge by at most
--   r_b = (u·(1+γ) + γ)·M_b + ((1+u)·η₃₂ + η)·sqrt(n_b),
-- u, η: unit roundoff and half the smallest subnormal step of the output dtype (RNE), γ, η₃₂: the
-- float32 arithmetic of K experts (parameters). So ‖round(θ_B) − round(θ_F)‖ ≤
-- sqrt(Σ_{b∈S} (v_b + 2 r_b)²), v_b = Σ_k omitted |c_k|‖Δ_kb‖ (plan_bounds.sql's block-wise terms).
-- Reads temp table _plan_scale(tensor_idx, base_scale).
-- Parameters: $1 base_id; $2 γ (relative error of the float32 sum); $3 η₃₂ (its absolute error).
-- Result: one row: bound_rounded (NULL when a base norm is unknown), blocks_without_norm (blocks
--   of S registered before base norms were stored), overflow (S blocks whose M_b·(1+γ) could
--   reach the dtype's largest finite value, so rounding could give ±Inf).
WITH fmt(dtype, u, eta, max_finite) AS (
    VALUES ('BF16', 2.0 ^ -8, 2.0 ^ -134, 3.3895313892515355e38),
           ('F16', 2.0 ^ -11, 2.0 ^ -25, 65504.0),
           ('F32', 0.0, 0.0, 3.4028234663852886e38)
),
per_block AS (
    SELECT tensor_idx, block_idx,
           sum(CASE WHEN selected THEN 0.0 ELSE value END) AS v,
           sum(value) AS update_norm,
           bool_or(NOT selected AND NOT free) AS differs
    FROM plan_ranked GROUP BY tensor_idx, block_idx
),
s AS (
    SELECT p.v, abs(sc.base_scale) * bl.base_norm + p.update_norm AS m, bl.numel, f.u, f.eta, f.max_finite
    FROM per_block p
    JOIN blocks bl ON bl.base_id = $1 AND bl.tensor_idx = p.tensor_idx AND bl.block_idx = p.block_idx
    JOIN family_tensors ft ON ft.base_id = $1 AND ft.tensor_idx = p.tensor_idx
    JOIN fmt f ON f.dtype = ft.dtype
    JOIN _plan_scale sc ON sc.tensor_idx = p.tensor_idx
    WHERE p.differs
)
SELECT CASE WHEN count(*) FILTER (WHERE m IS NULL) > 0 THEN NULL
            ELSE coalesce(sqrt(sum(power(v + 2 * ((u * (1 + $2) + $2) * m
                                                  + ((1 + u) * $3 + eta) * sqrt(numel)), 2))), 0.0)
       END AS bound_rounded,
       count(*) FILTER (WHERE m IS NULL) AS blocks_without_norm,
       count(*) FILTER (WHERE m * (1 + $2) >= max_finite) AS overflow
FROM s;
