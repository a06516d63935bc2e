-- plan_fixed_bytes: the fixed read cost of each (expert, tensor) of the plan that has one: a LoRA
-- adapter's factor that every block of the tensor needs, read once however many of its blocks a
-- merge reads (expert_tensors.fixed_bytes, schema/009). candidates.py charges it to one block of
-- the (expert, tensor), its carrier. No rows for dense experts.
-- Reads _plan_positions(checkpoint_id, position) (as plan_candidates.sql; from list parameters $1, $2).
-- Parameters: none of its own.
-- Result: position, tensor_idx, fixed_bytes (> 0), ordered by (position, tensor_idx).
SELECT pp.position, et.tensor_idx, et.fixed_bytes
FROM expert_tensors et
JOIN _plan_positions pp ON pp.checkpoint_id = et.checkpoint_id
WHERE et.fixed_bytes > 0
ORDER BY pp.position, et.tensor_idx
