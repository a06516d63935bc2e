-- plan_candidates_trimmed: like plan_candidates, for trimming methods (TIES, breadcrumbs): the norm
-- of a block is ‖Δ_kb surviving the trim‖, estimated from the block histogram in memory
-- (candidates.trimmed_norms: bins wholly inside [t_lo, t_hi) count fully, a straddling bin by the
-- overlapping fraction of its width); this query returns each block's histogram, and the trims
-- are matched to rows by (position, tensor_idx) in memory. In DuckDB the same sum as a list lambda
-- cost 50–70 ms for 16.7k blocks (an `auto` layout, 8 experts), numpy ~3 ms; a LEFT JOIN to a
-- registered trims table cost ~2 ms more than the lookup.
-- Reads _plan_positions (as plan_candidates.sql: a WITH clause from $3, $4).
-- Parameters: as plan_candidates.sql.
-- Result: as plan_candidates.sql with norm 0 (filled in memory), then hist_lo, hist_hi, hist_sumsq
--   (the block's non-empty |Δ| bins).
SELECT pp.position,
       eb.tensor_idx,
       eb.block_idx,
       eb.identical AS free,
       0.0::DOUBLE AS norm,
       coalesce(eb.read_bytes, -1) AS read_bytes,
       CASE WHEN $2 IS NOT NULL THEN
           CAST(hash(pp.position, eb.tensor_idx, eb.block_idx, $2)
                % 1000000007 AS DOUBLE) / 1000000007.0
       END AS random_score,
       eb.hist_lo,
       eb.hist_hi,
       eb.hist_sumsq
FROM expert_blocks eb
JOIN _plan_positions pp ON pp.checkpoint_id = eb.checkpoint_id
WHERE NOT $1 OR eb.nonfinite = 0
