-- 006_base_dot: per (expert, block), the inner product of the base's block with the expert's delta,
-- so that ‖θ_k,b‖² = ‖θ₀,b‖² + 2⟨θ₀,b, Δ_kb⟩ + ‖Δ_kb‖² and the angle between two checkpoints
-- (SLERP) follow from catalog statistics alone, without reading weights.
-- base_dot = Σ_i float64(θ₀,b[i]) · float64(Δ_kb[i]) over the decoded block (Δ computed in float32,
-- as for delta_norm), accumulated in float64; 0 for blocks identical to the base; NaN when the
-- block's delta holds a NaN/Inf (nonfinite > 0), as delta_norm is.
-- NULL for every block registered before 006 (registering the family into a new catalog fills
-- it) and for non-float (pass-through) tensors, which mergedb never diffs (they have no rows here
-- today; a row for one would hold NULL).

ALTER TABLE expert_blocks ADD COLUMN base_dot DOUBLE;    -- ⟨θ₀,b, Δ_b⟩ of the decoded block, float64
