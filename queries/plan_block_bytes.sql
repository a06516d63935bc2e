-- plan_block_bytes: the base family's blocks in (tensor_idx, block_idx) order with the byte cost of
-- reading one expert's copy of each — the cost of a candidate (expert, block) in the budget — and
-- what the bounds and checks need (dtype, ‖θ₀,b‖, elements, the base's NaN/Inf count).
-- Parameters: $1 base_id.
-- Result: tensor_idx, block_idx, nbytes (the candidate's cost), dtype, base_norm, numel,
--   base_nonfinite (NULL for blocks registered before schema 005).
SELECT ft.tensor_idx, bl.block_idx, bl.nbytes, ft.dtype, bl.base_norm, bl.numel, bl.base_nonfinite
FROM family_tensors ft
JOIN blocks bl USING (base_id, tensor_idx)
WHERE ft.base_id = $1
ORDER BY ft.tensor_idx, bl.block_idx
