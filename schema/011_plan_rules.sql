-- 011_plan_rules: how a plan chose its blocks and how its deviation was estimated.
-- value_model: the candidates' value ('norm': |c_k|·‖Δ_kb‖ or its trimmed norm; 'consensus': the
--   TIES model's leave-one-out effect, accessrules.py); min_coverage: the fraction of each expert's
--   useful bytes forced before the greedy's fill (NULL: no coverage rule).
-- est_kind: how plans.est_error (an estimate of ‖θ_B − θ_F‖) was computed, for every method
--   (deviation.py): 'sketch', 'sketch + drop variance', 'trimmed diagonal', 'consensus model',
--   'sketch, t from sketches' (model_stock); NULL when not estimated. Plans made before 011 keep NULL rules and,
--   where they have an est_error (additive methods), est_kind 'sketch'.

ALTER TABLE plans ADD COLUMN value_model VARCHAR NOT NULL DEFAULT 'norm';
ALTER TABLE plans ADD COLUMN min_coverage DOUBLE;
ALTER TABLE plans ADD COLUMN est_kind VARCHAR;
UPDATE plans SET est_kind = 'sketch' WHERE est_error IS NOT NULL;
