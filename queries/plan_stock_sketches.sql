-- plan_stock_sketches: model_stock's inputs per changed (expert, block) for the planner's estimate of
-- each tensor's full update t·Σ_k Δ_k/K (tensorunit.updates): the exact norm and the CountSketch.
-- Reads _plan_positions(checkpoint_id, position): the plan's experts in plan order (a WITH clause
--   candidates.positions puts before the statement, from list parameters $2 and $3).
-- Parameters: $1 leave blocks with NaN/Inf deltas out (BOOLEAN, --allow-nonfinite).
-- Result: tensor_idx, block_idx, position, delta_norm (‖Δ_kb‖), sketch (FLOAT[], the CountSketch of
--   Δ_kb); blocks identical to the base (Δ = 0: norm and sketch 0) are left out. Rows in no order.
SELECT eb.tensor_idx,
       eb.block_idx,
       pp.position,
       eb.delta_norm,
       eb.sketch
FROM expert_blocks eb
JOIN _plan_positions pp ON pp.checkpoint_id = eb.checkpoint_id
WHERE NOT eb.identical AND (NOT $1 OR eb.nonfinite = 0)
