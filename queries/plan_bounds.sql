-- plan_bounds: per expert (position) and overall (position NULL): selected and full bytes, and the
-- omitted-update error bounds. For additive methods value = |c_k|·‖Δ_kb‖, so ‖θ_B − θ_F‖ ≤
-- Σ_omitted value (triangle inequality), and blocks are disjoint, so ≤ sqrt(Σ_b (Σ_k omitted
-- value)²), which is tighter. Free blocks have value 0.
-- Parameters: none (reads plan_ranked).
-- Result: position, bound_sum, bound_blockwise, selected_bytes, full_bytes, n_selected, n_free.
WITH omitted AS (
    SELECT position, tensor_idx, block_idx,
           CASE WHEN selected THEN 0.0 ELSE value END AS v,
           CASE WHEN selected THEN nbytes ELSE 0 END AS sel_bytes,
           nbytes, selected, free
    FROM plan_ranked
),
per_block AS (
    SELECT tensor_idx, block_idx, sum(v) AS v FROM omitted GROUP BY tensor_idx, block_idx
)
SELECT position, sum(v) AS bound_sum, sqrt(sum(v * v)) AS bound_blockwise,
       CAST(sum(sel_bytes) AS BIGINT) AS selected_bytes, CAST(sum(nbytes) AS BIGINT) AS full_bytes,
       count(*) FILTER (WHERE selected) AS n_selected, count(*) FILTER (WHERE free) AS n_free
FROM omitted GROUP BY position
UNION ALL
SELECT NULL, (SELECT sum(v) FROM omitted), (SELECT sqrt(sum(v * v)) FROM per_block),
       (SELECT CAST(sum(sel_bytes) AS BIGINT) FROM omitted), (SELECT CAST(sum(nbytes) AS BIGINT) FROM omitted),
       (SELECT count(*) FILTER (WHERE selected) FROM omitted), (SELECT count(*) FILTER (WHERE free) FROM omitted)
ORDER BY position NULLS LAST;
