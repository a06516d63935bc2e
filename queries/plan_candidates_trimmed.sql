-- plan_candidates_trimmed: like plan_candidates, for trimming methods (TIES, breadcrumbs): value
-- = |c_k|·‖Δ_kb surviving the trim‖, the survivors estimated from the block histogram: bins
-- wholly inside [t_lo, t_hi) count fully, a straddling bin by the overlapping fraction of its width.
-- Reads temp tables _plan_experts(checkpoint_id, position, tensor_idx,
--   coef): one row per (expert, tensor), c_k of that tensor and
--   _plan_trim(checkpoint_id, tensor_idx, t_lo, t_hi).
-- Parameters: $1 base_id.
-- Result: temp table plan_candidates(checkpoint_id, position, tensor_idx, block_idx, nbytes, free,
--   value, score) with score = value / nbytes; nbytes as in plan_candidates.sql (read_bytes of a
--   LoRA adapter's block).
CREATE OR REPLACE TEMP TABLE plan_candidates AS
SELECT checkpoint_id, position, tensor_idx, block_idx, nbytes, free, value, value / greatest(nbytes, 1) AS score
FROM (
    SELECT eb.checkpoint_id,
           pe.position,
           eb.tensor_idx,
           eb.block_idx,
           coalesce(eb.read_bytes, bl.nbytes) AS nbytes,
           eb.identical AS free,
           CASE WHEN eb.identical THEN 0.0
                ELSE abs(pe.coef) * sqrt(coalesce(list_sum(list_transform(
                    range(1, len(eb.hist_lo) + 1),
                    lambda i: eb.hist_sumsq[i] * greatest(0.0,
                        least(eb.hist_hi[i], coalesce(tr.t_hi, 'inf'::FLOAT)) - greatest(eb.hist_lo[i], tr.t_lo))
                        / (eb.hist_hi[i] - eb.hist_lo[i])
                )), 0.0))
           END AS value
    FROM expert_blocks eb
    JOIN _plan_experts pe ON pe.checkpoint_id = eb.checkpoint_id AND pe.tensor_idx = eb.tensor_idx
    JOIN blocks bl ON bl.base_id = $1 AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
    LEFT JOIN _plan_trim tr ON tr.checkpoint_id = eb.checkpoint_id AND tr.tensor_idx = eb.tensor_idx
);
