-- plan_consensus_stats: per (expert, block) of the plan, what the consensus model (consensus.py)
-- is made of: the untrimmed nnz and ‖Δ‖, and the block's |Δ| histogram (count, Σ|Δ| and ΣΔ² per
-- non-empty bin). consensus.kept_stats turns the bins into how many elements the method's trim
-- keeps and their Σ|Δ| and ΣΔ², in memory, as plan_candidates_trimmed.sql's values are made (bins
-- wholly inside [t_lo, t_hi) count fully, a straddling bin by the overlapping fraction of its
-- width): the same sums as list lambdas here cost 54 ms for 16.7k blocks (8 experts, `auto`
-- layout), 126 ms for 41.7k, numpy ~10 and ~20.
-- Reads _plan_positions (a WITH clause from $2, $3, as plan_candidates.sql).
-- Parameters: $1 leave blocks with NaN/Inf deltas out (BOOLEAN, --allow-nonfinite); $2, $3 as above.
-- Result: position, tensor_idx, block_idx, identical, nnz, norm (0 for blocks identical to the
--   base), hist_lo, hist_hi, hist_count, hist_sum, hist_sumsq.
SELECT pp.position,
       eb.tensor_idx,
       eb.block_idx,
       eb.identical,
       CAST(eb.nnz AS DOUBLE) AS nnz,
       CASE WHEN eb.identical THEN 0.0 ELSE eb.delta_norm END AS norm,
       eb.hist_lo,
       eb.hist_hi,
       eb.hist_count,
       eb.hist_sum,
       eb.hist_sumsq
FROM expert_blocks eb
JOIN _plan_positions pp ON pp.checkpoint_id = eb.checkpoint_id
WHERE NOT $1 OR eb.nonfinite = 0
