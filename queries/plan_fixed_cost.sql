-- plan_fixed_cost: charge each adapter's fixed factor R exactly once per (expert, tensor), to its
-- carrier (queries/plan_carriers.sql): the carrier's nbytes += fixed_bytes and its score becomes
-- the carrier score; every other non-free candidate of that (position, tensor_idx) has its score
-- capped strictly below the carrier's (× (1 − 2⁻⁴⁰)). So in the plan's order (score DESC,
-- position, tensor_idx, block_idx) the carrier precedes the rest of its (expert, tensor): a prefix
-- holding any of them holds the carrier, and the selected bytes count R once, exactly. The greedy
-- fill (plan_fill.sql) selects them only once their carrier is selected.
-- Parameters: none.
-- Result: updates plan_candidates; row count = candidates of adapted (expert, tensor)s.
UPDATE plan_candidates SET
    nbytes = plan_candidates.nbytes + CASE WHEN plan_candidates.block_idx = c.block_idx THEN c.fixed_bytes ELSE 0 END,
    score = CASE WHEN plan_candidates.block_idx = c.block_idx THEN c.score
                 ELSE least(plan_candidates.score, c.score * (1 - 2 ^ -40)) END
FROM plan_carriers c
WHERE plan_candidates.position = c.position AND plan_candidates.tensor_idx = c.tensor_idx
  AND NOT plan_candidates.free;
