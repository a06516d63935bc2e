-- plan_prefix: select the prefix of non-free candidates, in (score DESC, position, tensor_idx,
-- block_idx) order — a unique key, so plans repeat exactly — whose bytes fit the budget. Buckets
-- above the cut bucket (plan_cut.sql) fit whole; only the cut bucket is sorted, and within it the
-- running sum continues from the bytes above. The result equals a window over the whole order.
-- Free blocks (identical to the base) cost nothing and are never selected.
-- Parameters: $1 budget in bytes; $2 cut bucket (a value below every bucket when all fit).
-- Result: temp table plan_ranked(checkpoint_id, position, tensor_idx, block_idx, nbytes, free,
--   value, score, selected).
CREATE OR REPLACE TEMP TABLE plan_ranked AS
WITH bucketed AS (
    SELECT *, CASE WHEN score > 0 THEN CAST(floor(log2(score) * 16) AS BIGINT) ELSE -1000000000 END AS bucket
    FROM plan_candidates
),
above AS (
    SELECT coalesce(sum(nbytes), 0) AS bytes FROM bucketed WHERE NOT free AND bucket > $2
),
edge AS (
    SELECT position, tensor_idx, block_idx,
           sum(nbytes) OVER (ORDER BY score DESC, position, tensor_idx, block_idx
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
    FROM bucketed
    WHERE NOT free AND bucket = $2
)
SELECT b.checkpoint_id, b.position, b.tensor_idx, b.block_idx, b.nbytes, b.free, b.value, b.score,
       CASE WHEN b.free THEN false
            WHEN b.bucket > $2 THEN true
            WHEN b.bucket < $2 THEN false
            ELSE e.cum <= $1 - (SELECT bytes FROM above)
       END AS selected
FROM bucketed b
LEFT JOIN edge e ON e.position = b.position AND e.tensor_idx = b.tensor_idx AND e.block_idx = b.block_idx;
