-- plan_block_bytes: the base family's blocks with the byte cost of reading one expert's copy of
-- each — the cost of a candidate (expert, block) in the budget — and what the bounds and checks
-- need (‖θ₀,b‖, elements, the base's NaN/Inf count). The dtype is the tensor's (family_tensors).
-- No join and no ORDER BY: candidates.family_blocks sorts the rows by (tensor_idx, block_idx) in
-- numpy, which costs a small plan less than DuckDB's sort operator and join (~1 ms of ~15).
-- Parameters: $1 base_id.
-- Result, in no particular order: tensor_idx, block_idx, nbytes (the candidate's cost), base_norm,
--   numel, base_nonfinite (NULL for blocks registered before schema 005).
SELECT tensor_idx, block_idx, nbytes, base_norm, numel, base_nonfinite
FROM blocks
WHERE base_id = $1
