-- plan_candidates: every (expert, block) of the plan's experts with what its value is made of, for
-- additive methods: the planner's value of a block is |c_k|·‖Δ_kb‖ (0 for blocks identical to the
-- base), c_k the expert's coefficient on that tensor, applied in memory (candidates.py), where the
-- byte cost is added from queries/plan_block_bytes.sql (and plan_fixed_bytes.sql for adapters). One
-- scan joined to the K plan experts only: 35M rows cost one pass.
-- Reads _plan_positions(checkpoint_id, position): the plan's experts in plan order (a WITH clause
--   candidates.py puts before the statement, from list parameters $3 and $4).
-- Parameters: $1 leave blocks with NaN/Inf deltas out (BOOLEAN, --allow-nonfinite); $2 seed of the
--   random ablation scores (BIGINT; NULL: ranked plans).
-- Result: position, tensor_idx, block_idx, free, norm (‖Δ_kb‖), read_bytes (what a merge reads for
--   a LoRA adapter's block, expert_blocks.read_bytes of schema/009; -1 for a dense expert's block,
--   whose cost is the block's bytes), random_score (uniform in [0, 1) per candidate from
--   (position, tensor_idx, block_idx, seed); NULL without a seed).
SELECT pp.position,
       eb.tensor_idx,
       eb.block_idx,
       eb.identical AS free,
       eb.delta_norm AS norm,
       coalesce(eb.read_bytes, -1) AS read_bytes,
       CASE WHEN $2 IS NOT NULL THEN
           CAST(hash(pp.position, eb.tensor_idx, eb.block_idx, $2)
                % 1000000007 AS DOUBLE) / 1000000007.0
       END AS random_score
FROM expert_blocks eb
JOIN _plan_positions pp ON pp.checkpoint_id = eb.checkpoint_id
WHERE NOT $1 OR eb.nonfinite = 0
