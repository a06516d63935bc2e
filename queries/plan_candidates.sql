-- plan_candidates: every (expert, block) of the plan's experts with what its value is made of, for
-- additive methods: the planner's value of a block is |c_k|·‖Δ_kb‖ (0 for blocks identical to the
-- base), c_k the expert's coefficient on that tensor, applied in memory (candidates.py), where the
-- byte cost is added from queries/plan_block_bytes.sql. One scan, no join: 35M rows cost one pass.
-- Parameters: $1 checkpoint_id of each expert, in plan order (INTEGER[]); $2 leave blocks with
--   NaN/Inf deltas out (BOOLEAN, --allow-nonfinite); $3 seed of the random ablation scores (BIGINT;
--   NULL: ranked plans).
-- Result: position, tensor_idx, block_idx, free, norm (‖Δ_kb‖), random_score (uniform in [0, 1)
--   per candidate from (position, tensor_idx, block_idx, seed); NULL without a seed).
SELECT CAST(list_position($1, eb.checkpoint_id) - 1 AS INTEGER) AS position,
       eb.tensor_idx,
       eb.block_idx,
       eb.identical AS free,
       eb.delta_norm AS norm,
       CASE WHEN $3 IS NOT NULL THEN
           CAST(hash(CAST(list_position($1, eb.checkpoint_id) - 1 AS INTEGER), eb.tensor_idx, eb.block_idx, $3)
                % 1000000007 AS DOUBLE) / 1000000007.0
       END AS random_score
FROM expert_blocks eb
WHERE list_contains($1, eb.checkpoint_id) AND (NOT $2 OR eb.nonfinite = 0)
