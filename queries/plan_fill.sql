-- plan_fill: one fill pass past a block that did not fit: among unselected non-free candidates no
-- larger than the remaining budget, select the prefix (score DESC, position, tensor_idx,
-- block_idx) that fits in it. Repeating this until nothing changes is exactly the greedy "take
-- each block, best first, if it still fits".
-- Parameters: $1 remaining budget in bytes (budget − bytes already selected).
-- Result: updates plan_ranked.selected; the row count is the number of blocks added.
UPDATE plan_ranked SET selected = true
FROM (
    SELECT position, tensor_idx, block_idx
    FROM (
        SELECT position, tensor_idx, block_idx,
               sum(nbytes) OVER (ORDER BY score DESC, position, tensor_idx, block_idx
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
        FROM plan_ranked
        WHERE NOT selected AND NOT free AND nbytes <= $1
    )
    WHERE cum <= $1
) AS fit
WHERE plan_ranked.position = fit.position AND plan_ranked.tensor_idx = fit.tensor_idx
  AND plan_ranked.block_idx = fit.block_idx;
