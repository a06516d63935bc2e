-- 002_plans: budgeted merge plans (one row per plan), their experts, and the access mask.
-- Written by `mergedb plan` in one transaction; read by `mergedb execute`.

CREATE TABLE plans (
    plan_id          INTEGER PRIMARY KEY,
    name             VARCHAR UNIQUE,            -- optional user label
    plan_hash        VARCHAR NOT NULL,          -- sha256 over method, parameters, input fingerprints, mask
    method           VARCHAR NOT NULL,
    params           VARCHAR NOT NULL,          -- canonical JSON of the method's parameters
    seed             BIGINT NOT NULL,
    budget_spec      VARCHAR NOT NULL,          -- as given: '2GiB', '25%', 'all', ...
    budget_bytes     BIGINT NOT NULL,           -- expert bytes the executor may read
    base_id          INTEGER NOT NULL,
    base_fingerprint VARCHAR NOT NULL,
    base_content     VARCHAR NOT NULL,
    full_bytes       BIGINT NOT NULL,           -- expert bytes a full read would take
    selected_bytes   BIGINT NOT NULL,           -- ≤ budget_bytes
    base_bytes       BIGINT NOT NULL,           -- base bytes streamed (not budgeted)
    n_candidates     BIGINT NOT NULL,
    n_selected       BIGINT NOT NULL,
    free_blocks      BIGINT NOT NULL,           -- identical-to-base blocks: never read, zero error
    bound_sum        DOUBLE,                    -- Σ_omitted |c_k|·‖Δ_kb‖ (additive methods)
    bound_blockwise  DOUBLE,                    -- sqrt(Σ_b (Σ_k omitted |c_k|·‖Δ_kb‖)²)
    est_error        DOUBLE,                    -- ‖Σ_omitted c_k Δ_kb‖ estimated from sketches
    planning_seconds DOUBLE NOT NULL,
    created          TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE plan_experts (
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
    bound_blockwise DOUBLE,
    PRIMARY KEY (plan_id, position)
);

-- Per (plan, expert, tensor): the magnitude thresholds a trimming method keeps between.
CREATE TABLE plan_thresholds (
    plan_id       INTEGER NOT NULL,
    checkpoint_id INTEGER NOT NULL,
    tensor_idx    INTEGER NOT NULL,
    t_lo          FLOAT NOT NULL,               -- keep |Δ| ≥ t_lo ...
    t_hi          FLOAT,                        -- ... and |Δ| < t_hi (NULL: no upper cut)
    exact         BOOLEAN NOT NULL,             -- from the exact density grid (else the summary, ≤0.8% off)
    PRIMARY KEY (plan_id, checkpoint_id, tensor_idx)
);

CREATE TABLE plan_mask (
    plan_id       INTEGER NOT NULL,
    checkpoint_id INTEGER NOT NULL,
    tensor_idx    INTEGER NOT NULL,
    block_idx     INTEGER NOT NULL,
    selected      BOOLEAN NOT NULL,
    free          BOOLEAN NOT NULL,
    score         DOUBLE NOT NULL,              -- value per byte
    value         DOUBLE NOT NULL,
    nbytes        BIGINT NOT NULL
);
