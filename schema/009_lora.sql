-- 009_lora: LoRA adapters registered as experts (mergedb/lora.py, lorascan.py). An adapter's block
-- costs what a merge reads for it, not the dense bytes of the block: the rows of its factor L
-- (rank × rows × itemsize) or of a modules_to_save tensor, plus, once per (expert, tensor), the
-- factor R every block of the tensor needs (the planner charges it to one block: see
-- queries/plan_fixed_cost.sql).
-- NULL in every row of a dense expert (and in rows registered before 009): a dense block costs
-- blocks.nbytes and a dense tensor has no fixed cost.

ALTER TABLE checkpoints ADD COLUMN adapter BOOLEAN;        -- true: a PEFT LoRA adapter folder
ALTER TABLE expert_blocks ADD COLUMN read_bytes BIGINT;    -- bytes a merge reads for this block (0: untouched)
ALTER TABLE expert_tensors ADD COLUMN fixed_bytes BIGINT;  -- bytes read once per (expert, tensor) if any block is

-- expert_costs counts what reading an expert costs: an adapter's read_bytes plus its fixed bytes
-- (a dense expert's rows are unchanged: read_bytes is NULL, fixed_bytes NULL).
CREATE OR REPLACE VIEW expert_costs AS
SELECT c.name AS expert,
       b.name AS base,
       CAST(sum(coalesce(eb.read_bytes, bl.nbytes)) + coalesce(max(f.fixed), 0) AS BIGINT) AS total_bytes,
       CAST(coalesce(sum(coalesce(eb.read_bytes, bl.nbytes)) FILTER (WHERE NOT eb.identical), 0)
            + coalesce(max(f.fixed), 0) AS BIGINT) AS changed_bytes,
       sqrt(sum(eb.delta_norm * eb.delta_norm)) AS delta_norm,
       CAST(sum(eb.nnz) AS BIGINT) AS nnz,
       CAST(sum(eb.nonfinite) AS BIGINT) AS nonfinite
FROM expert_blocks eb
JOIN checkpoints c ON c.checkpoint_id = eb.checkpoint_id
JOIN checkpoints b ON b.checkpoint_id = c.base_id
JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
LEFT JOIN (SELECT checkpoint_id, sum(fixed_bytes) AS fixed FROM expert_tensors GROUP BY checkpoint_id) f
       ON f.checkpoint_id = eb.checkpoint_id
GROUP BY c.name, b.name;
