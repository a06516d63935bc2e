-- plan_fill: one fill pass past a block that did not fit: among unselected non-free candidates no
-- larger than the remaining budget, select the prefix (score DESC, position, tensor_idx,
-- block_idx) that fits in it. Repeating this until nothing changes is exactly the greedy "take
-- each block, best first, if it still fits". A block of a LoRA adapter's (expert, tensor) that is
-- not its carrier (plan_carriers.sql) waits until the carrier, which pays the fixed factor, is
-- selected (plan_carriers is empty for dense plans).
-- Parameters: $1 remaining budget in bytes (budget − bytes already selected).
-- Result: updates plan_ranked.selected; the row count is the number of blocks added.
UPDATE plan_ranked SET selected = true
FROM (
    SELECT position, tensor_idx, block_idx
    FROM (
        SELECT position, tensor_idx, block_idx,
               sum(nbytes) OVER (ORDER BY score DESC, position, tensor_idx, block_idx
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
        FROM plan_ranked p
        WHERE NOT selected AND NOT free AND nbytes <= $1
          AND NOT EXISTS (SELECT 1 FROM plan_carriers c JOIN plan_ranked r USING (position, tensor_idx, block_idx)
                          WHERE c.position = p.position AND c.tensor_idx = p.tensor_idx
                            AND c.block_idx <> p.block_idx AND NOT r.selected)
    )
    WHERE cum <= $1
) AS fit
WHERE plan_ranked.position = fit.position AND plan_ranked.tensor_idx = fit.tensor_idx
  AND plan_ranked.block_idx = fit.block_idx;
