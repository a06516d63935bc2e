-- family_tensor_names: the tensor names of one registered base's family, in file order, for
-- evaluating a mergekit config over them (gradients need every layer, filters match by name).
-- Parameters: $1 the base's checkpoint name.
-- Result: name (one row per family tensor, ordered by tensor_idx).
SELECT ft.name
FROM family_tensors ft
JOIN checkpoints c ON c.checkpoint_id = ft.base_id
WHERE c.name = $1 AND c.role = 'base'
ORDER BY ft.tensor_idx
