-- slerp_stats: per tensor of one expert, the sums from which SLERP's coefficients follow:
-- ‖θ₀‖² = Σ_b base_norm², ‖Δ‖² = Σ_b delta_norm², ⟨θ₀, Δ⟩ = Σ_b base_dot (blocks are disjoint row
-- ranges, so the tensor's sums are the blocks' sums). Blocks with NaN/Inf deltas (left out under
-- --allow-nonfinite) count as Δ = 0.
-- Parameters: $1 base_id; $2 checkpoint_id of the expert.
-- Result: tensor_idx, base_sq, delta_sq, base_dot, missing (blocks whose base_norm or base_dot is
--   NULL: registered before mergedb stored them).
SELECT bl.tensor_idx,
       coalesce(sum(bl.base_norm * bl.base_norm), 0.0) AS base_sq,
       coalesce(sum(eb.delta_norm * eb.delta_norm) FILTER (WHERE eb.nonfinite = 0), 0.0) AS delta_sq,
       coalesce(sum(eb.base_dot) FILTER (WHERE eb.nonfinite = 0), 0.0) AS base_dot,
       count(*) FILTER (WHERE bl.base_norm IS NULL OR eb.base_dot IS NULL) AS missing
FROM blocks bl
JOIN expert_blocks eb ON eb.checkpoint_id = $2 AND eb.tensor_idx = bl.tensor_idx AND eb.block_idx = bl.block_idx
WHERE bl.base_id = $1
GROUP BY bl.tensor_idx
ORDER BY bl.tensor_idx;
