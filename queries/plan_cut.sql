-- plan_cut: the score bucket where the budget runs out, so that only that bucket's candidates
-- need an exact sort. Buckets are 1/16-octave ranges of score (monotone in score; score 0 in
-- the lowest bucket), summed over non-free candidates, then accumulated from the best bucket down.
-- Parameters: $1 budget in bytes.
-- Result: one row, cut_bucket: the best bucket whose running sum exceeds the budget (NULL when
--   every non-free candidate fits).
SELECT max(bucket) AS cut_bucket
FROM (
    SELECT bucket,
           sum(bytes) OVER (ORDER BY bucket DESC ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
    FROM (
        SELECT CASE WHEN score > 0 THEN CAST(floor(log2(score) * 16) AS BIGINT) ELSE -1000000000 END AS bucket,
               CAST(sum(nbytes) AS BIGINT) AS bytes
        FROM plan_candidates
        WHERE NOT free
        GROUP BY ALL
    )
)
WHERE cum > $1;
