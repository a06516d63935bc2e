-- plan_candidates: every (expert, block) of the plan's float tensors, with its byte cost and value,
-- for additive methods: value = |c_k|·‖Δ_kb‖ (0 for blocks identical to the base).
-- Reads temp table _plan_experts(checkpoint_id, position, tensor_idx,
--   coef): one row per (expert, tensor), c_k of that tensor.
-- Parameters: $1 base_id.
-- Result: temp table plan_candidates(checkpoint_id, position, tensor_idx, block_idx, nbytes, free,
--   value, score) with score = value / nbytes. nbytes: the bytes a merge reads for the block, the
--   block's bytes for a dense expert, expert_blocks.read_bytes for a LoRA adapter (schema/009).
CREATE OR REPLACE TEMP TABLE plan_candidates AS
SELECT eb.checkpoint_id,
       pe.position,
       eb.tensor_idx,
       eb.block_idx,
       coalesce(eb.read_bytes, bl.nbytes) AS nbytes,
       eb.identical AS free,
       abs(pe.coef) * eb.delta_norm AS value,
       abs(pe.coef) * eb.delta_norm / greatest(coalesce(eb.read_bytes, bl.nbytes), 1) AS score
FROM expert_blocks eb
JOIN _plan_experts pe ON pe.checkpoint_id = eb.checkpoint_id AND pe.tensor_idx = eb.tensor_idx
JOIN blocks bl ON bl.base_id = $1 AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx;
