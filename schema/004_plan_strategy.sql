-- 004_plan_strategy: how a plan ranked its candidates: 'ranked' (value per byte, the planner)
-- or 'random' (a uniformly random mask of the same budget, an ablation baseline).

ALTER TABLE plans ADD COLUMN strategy VARCHAR NOT NULL DEFAULT 'ranked';
