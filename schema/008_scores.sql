-- 008_scores: measurements of merged plans (an eval loss, a distance to a target, an accuracy),
-- one row per recording, so a search can stop, resume from what it measured, and be queried in SQL.
-- Written by `mergedb score PLAN METRIC VALUE` / Catalog.record_score (queries/record_score.sql).
-- `plan_scores` joins each score to its plan's name, method, parameters (JSON) and budget.

CREATE TABLE scores (
    score_id   INTEGER PRIMARY KEY,
    plan_id    INTEGER NOT NULL,
    metric     VARCHAR NOT NULL,
    value      DOUBLE NOT NULL,
    created    TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE VIEW plan_scores AS
SELECT s.score_id, s.plan_id, p.name AS plan, p.method, p.params, p.budget_spec, p.selected_bytes,
       s.metric, s.value, s.created
FROM scores s JOIN plans p USING (plan_id);
