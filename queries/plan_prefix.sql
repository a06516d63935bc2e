-- plan_prefix: rank the non-free candidates by score and select the prefix that fits the budget.
-- Ties are broken by (position, tensor_idx, block_idx), a unique key, so plans repeat exactly.
-- Parameters: $1 budget in bytes.
-- Result: temp table plan_ranked(checkpoint_id, position, tensor_idx, block_idx, nbytes, value,
--   score, rank, cum_bytes, selected) with selected = cum_bytes ≤ budget (so Σ selected ≤ budget).
CREATE OR REPLACE TEMP TABLE plan_ranked AS
SELECT checkpoint_id, position, tensor_idx, block_idx, nbytes, value, score, rank, cum_bytes,
       cum_bytes <= $1 AS selected
FROM (
    SELECT *,
           row_number() OVER w AS rank,
           CAST(sum(nbytes) OVER (w ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS BIGINT) AS cum_bytes
    FROM plan_candidates
    WHERE NOT free
    WINDOW w AS (ORDER BY score DESC, position, tensor_idx, block_idx)
);
