-- family_tensor_names: the names of one registered base's float (mergeable) tensors, in file order,
-- for evaluating a mergekit config over them (gradients need every layer, filters match by name).
-- Integer and bool buffers (position_ids) pass through from the base: mergekit plans none of them,
-- so a config need not give them a value.
-- Parameters: $1 the base's checkpoint name.
-- Result: name (one row per mergeable family tensor, ordered by tensor_idx).
SELECT ft.name
FROM family_tensors ft
JOIN checkpoints c ON c.checkpoint_id = ft.base_id
WHERE c.name = $1 AND c.role = 'base' AND ft.mergeable
ORDER BY ft.tensor_idx
