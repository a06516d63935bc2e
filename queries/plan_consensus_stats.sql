-- plan_consensus_stats: per (expert, block) of the plan, what the consensus model (consensus.py)
-- needs: how many elements the method's trim keeps and their Σ|Δ| and ΣΔ², from the block
-- histogram as plan_candidates_trimmed.sql estimates them (bins wholly inside [t_lo, t_hi) count
-- fully, a straddling bin by the overlapping fraction of its width); a pair without a _plan_trim row
-- (methods that do not trim by magnitude) keeps every bin. Also the untrimmed nnz and ‖Δ‖.
-- Reads temp tables _plan_positions(checkpoint_id, position) and _plan_trim(checkpoint_id,
--   tensor_idx, t_lo, t_hi).
-- Parameters: $1 leave blocks with NaN/Inf deltas out (BOOLEAN, --allow-nonfinite).
-- Result: position, tensor_idx, block_idx, nnz, norm, kept, kept_abs, kept_sq (DOUBLE; 0 for
--   blocks identical to the base).
WITH f AS (
    SELECT pp.position,
           eb.tensor_idx,
           eb.block_idx,
           eb.nnz,
           eb.delta_norm,
           eb.identical,
           eb.hist_count,
           eb.hist_sum,
           eb.hist_sumsq,
           list_transform(range(1, len(eb.hist_lo) + 1),
               lambda i: CASE WHEN eb.hist_hi[i] > eb.hist_lo[i] THEN greatest(0.0,
                   least(eb.hist_hi[i], coalesce(tr.t_hi, 'inf'::FLOAT))
                   - greatest(eb.hist_lo[i], coalesce(tr.t_lo, 0.0::FLOAT))) / (eb.hist_hi[i] - eb.hist_lo[i])
               ELSE CAST(eb.hist_lo[i] >= coalesce(tr.t_lo, 0.0::FLOAT)  -- a zero-width bin: kept if inside the band
                         AND eb.hist_lo[i] < coalesce(tr.t_hi, 'inf'::FLOAT) AS DOUBLE) END) AS frac
    FROM expert_blocks eb
    JOIN _plan_positions pp ON pp.checkpoint_id = eb.checkpoint_id
    LEFT JOIN _plan_trim tr ON tr.checkpoint_id = eb.checkpoint_id AND tr.tensor_idx = eb.tensor_idx
    WHERE NOT $1 OR eb.nonfinite = 0
)
SELECT position,
       tensor_idx,
       block_idx,
       CAST(nnz AS DOUBLE) AS nnz,
       CASE WHEN identical THEN 0.0 ELSE delta_norm END AS norm,
       CASE WHEN identical THEN 0.0 ELSE coalesce(list_sum(list_transform(range(1, len(frac) + 1),
           lambda i: hist_count[i] * frac[i])), 0.0) END AS kept,
       CASE WHEN identical THEN 0.0 ELSE coalesce(list_sum(list_transform(range(1, len(frac) + 1),
           lambda i: hist_sum[i] * frac[i])), 0.0) END AS kept_abs,
       CASE WHEN identical THEN 0.0 ELSE coalesce(list_sum(list_transform(range(1, len(frac) + 1),
           lambda i: hist_sumsq[i] * frac[i])), 0.0) END AS kept_sq
FROM f
