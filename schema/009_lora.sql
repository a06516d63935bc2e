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
