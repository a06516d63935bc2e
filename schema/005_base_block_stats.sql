-- 005_base_block_stats: per base block, what registration now learns while hashing it, and per
-- plan, the error bound of the output as written (rounded to the base's dtype).
-- Catalogs registered before 005 hold NULL here: their plans report the float32 bound only, and
-- a NaN/Inf in such a base is reported per expert, as before.

ALTER TABLE blocks ADD COLUMN base_norm DOUBLE;          -- ‖θ₀,b‖₂ of the decoded block (float tensors)
ALTER TABLE blocks ADD COLUMN base_nonfinite BIGINT;     -- NaN/Inf values in the base's block (float tensors)
ALTER TABLE plans ADD COLUMN bound_rounded DOUBLE;       -- bound on ‖θ_B − θ_F‖ after rounding to the base's dtype
ALTER TABLE plans ADD COLUMN bound_note VARCHAR;         -- why bound_rounded is NULL, when it is (linear methods)
