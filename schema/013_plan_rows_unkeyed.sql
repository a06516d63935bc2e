-- 013_plan_rows_unkeyed: plan_experts and plan_thresholds lose their primary keys, as plan_mask_bits
-- (010) never had one. Their rows are written only by the planner, in the one transaction that
-- writes the plan's row, under a plan_id the plans table's own key makes unique (planner._store),
-- so the keys could never refuse a row; they cost every plan an index insert each (~1.3 ms of a
-- ~20 ms plan, and more the first time a process touches a catalog whose tables hold a long history:
-- benchmarks/ANALYSIS.md, thirteenth session). `mergedb check` still finds child rows without a
-- plan. The columns, their order, types and NOT NULLs are those of 002; no row changes.

CREATE TABLE plan_experts_013 (
    plan_id        INTEGER NOT NULL,
    position       INTEGER NOT NULL,            -- order given by the user (0-based)
    checkpoint_id  INTEGER NOT NULL,
    weight         DOUBLE NOT NULL,
    coef           DOUBLE NOT NULL,             -- fixed coefficient on Δ_k (see methods.coefficients)
    fingerprint    VARCHAR NOT NULL,
    content_hash   VARCHAR NOT NULL,
    full_bytes     BIGINT NOT NULL,
    selected_bytes BIGINT NOT NULL,
    bound_sum      DOUBLE,
    bound_blockwise DOUBLE
);
INSERT INTO plan_experts_013 SELECT * FROM plan_experts ORDER BY plan_id, position;
DROP TABLE plan_experts;
ALTER TABLE plan_experts_013 RENAME TO plan_experts;

-- Per (plan, expert, tensor): the magnitude thresholds a trimming method keeps between.
CREATE TABLE plan_thresholds_013 (
    plan_id       INTEGER NOT NULL,
    checkpoint_id INTEGER NOT NULL,
    tensor_idx    INTEGER NOT NULL,
    t_lo          FLOAT NOT NULL,               -- keep |Δ| ≥ t_lo ...
    t_hi          FLOAT,                        -- ... and |Δ| < t_hi (NULL: no upper cut)
    exact         BOOLEAN NOT NULL              -- from the exact density grid (else the summary, ≤0.8% off)
);
INSERT INTO plan_thresholds_013 SELECT * FROM plan_thresholds ORDER BY plan_id, checkpoint_id, tensor_idx;
DROP TABLE plan_thresholds;
ALTER TABLE plan_thresholds_013 RENAME TO plan_thresholds;
