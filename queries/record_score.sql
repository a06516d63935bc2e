-- record_score: store one measurement of a stored plan (Catalog.record_score).
-- Parameters: $plan_id (INTEGER, an existing plan), $metric (VARCHAR), $value (DOUBLE, finite).
-- Result: score_id of the new row (one more than the largest so far).
INSERT INTO scores (score_id, plan_id, metric, value)
SELECT coalesce(max(score_id), 0) + 1, $plan_id, $metric, $value FROM scores
RETURNING score_id;
