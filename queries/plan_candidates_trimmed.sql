-- plan_candidates_trimmed: like plan_candidates, for trimming methods (TIES, breadcrumbs): norm =
-- ‖Δ_kb surviving the trim‖, the survivors estimated from the block histogram: bins wholly inside
-- [t_lo, t_hi) count fully, a straddling bin by the overlapping fraction of its width. The value is
-- |c_k|·norm (candidates.py).
-- Reads temp tables _plan_positions (as plan_candidates.sql) and _plan_trim(checkpoint_id,
--   tensor_idx, t_lo, t_hi).
-- Parameters: as plan_candidates.sql.
-- Result: as plan_candidates.sql.
SELECT pp.position,
       eb.tensor_idx,
       eb.block_idx,
       eb.identical AS free,
       CASE WHEN eb.identical THEN 0.0
            ELSE sqrt(coalesce(list_sum(list_transform(
                range(1, len(eb.hist_lo) + 1),
                lambda i: eb.hist_sumsq[i] * greatest(0.0,
                    least(eb.hist_hi[i], coalesce(tr.t_hi, 'inf'::FLOAT)) - greatest(eb.hist_lo[i], tr.t_lo))
                    / (eb.hist_hi[i] - eb.hist_lo[i])
            )), 0.0))
       END AS norm,
       coalesce(eb.read_bytes, -1) AS read_bytes,
       CASE WHEN $2 IS NOT NULL THEN
           CAST(hash(pp.position, eb.tensor_idx, eb.block_idx, $2)
                % 1000000007 AS DOUBLE) / 1000000007.0
       END AS random_score
FROM expert_blocks eb
JOIN _plan_positions pp ON pp.checkpoint_id = eb.checkpoint_id
LEFT JOIN _plan_trim tr ON tr.checkpoint_id = eb.checkpoint_id AND tr.tensor_idx = eb.tensor_idx
WHERE NOT $1 OR eb.nonfinite = 0
