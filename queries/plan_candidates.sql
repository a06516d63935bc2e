-- plan_candidates: every (expert, block) of the plan's float tensors, with its byte cost and value.
-- Reads temp tables _plan_experts(checkpoint_id, position, coef) and
--   _plan_trim(checkpoint_id, tensor_idx, t_lo, t_hi) (rows only for trimming methods).
-- Parameters: $1 base_id; $2 trimmed (BOOLEAN): value from the trim's surviving mass.
-- Result: temp table plan_candidates(checkpoint_id, position, tensor_idx, block_idx, nbytes, free,
--   value, score). value = |c_k|·‖Δ_kb‖ (additive) or |c_k|·‖Δ_kb surviving the trim‖, the
--   survivors estimated from the block histogram (bins wholly inside [t_lo, t_hi) count fully,
--   a straddling bin by the overlapping fraction of its width); score = value / nbytes.
CREATE OR REPLACE TEMP TABLE plan_candidates AS
SELECT eb.checkpoint_id,
       pe.position,
       eb.tensor_idx,
       eb.block_idx,
       bl.nbytes,
       eb.identical AS free,
       v.value,
       v.value / greatest(bl.nbytes, 1) AS score
FROM expert_blocks eb
JOIN _plan_experts pe ON pe.checkpoint_id = eb.checkpoint_id
JOIN blocks bl ON bl.base_id = $1 AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
LEFT JOIN _plan_trim tr ON tr.checkpoint_id = eb.checkpoint_id AND tr.tensor_idx = eb.tensor_idx,
LATERAL (
    SELECT CASE
        WHEN eb.identical THEN 0.0
        WHEN NOT $2 THEN abs(pe.coef) * eb.delta_norm
        ELSE abs(pe.coef) * sqrt(coalesce(list_sum(list_transform(
            range(1, len(eb.hist_lo) + 1),
            lambda i: eb.hist_sumsq[i] * greatest(0.0,
                     least(eb.hist_hi[i], coalesce(tr.t_hi, 'inf'::FLOAT)) - greatest(eb.hist_lo[i], tr.t_lo))
                 / (eb.hist_hi[i] - eb.hist_lo[i])
        )), 0.0))
    END AS value
) v;
