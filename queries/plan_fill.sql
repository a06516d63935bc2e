-- plan_fill: one fill pass past a block that did not fit: among unselected candidates no larger
-- than the remaining budget, select the score-ordered prefix that fits in it. Repeating this
-- until nothing changes is exactly the greedy "take each block, best first, if it still fits".
-- Parameters: $1 remaining budget in bytes (budget − bytes already selected).
-- Result: updates plan_ranked.selected; the row count is the number of blocks added.
UPDATE plan_ranked SET selected = true
WHERE rank IN (
    SELECT rank
    FROM (
        SELECT rank,
               sum(nbytes) OVER (ORDER BY rank ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
        FROM plan_ranked
        WHERE NOT selected AND nbytes <= $1
    )
    WHERE cum <= $1
);
