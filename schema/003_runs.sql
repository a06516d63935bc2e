-- 003_runs: one row per execution of a plan (successful or failed), with its measurements.

CREATE TABLE runs (
    run_id           INTEGER PRIMARY KEY,
    plan_id          INTEGER NOT NULL,
    out              VARCHAR NOT NULL,
    status           VARCHAR NOT NULL CHECK (status IN ('ok', 'failed')),
    error            VARCHAR,
    manifest_hash    VARCHAR,          -- content hash of the manifest's deterministic part
    seconds          DOUBLE,
    expert_bytes     BIGINT,           -- logical bytes requested from expert files
    physical_bytes   BIGINT,           -- /proc/self/io read_bytes during the run
    base_bytes       BIGINT,
    bytes_written    BIGINT,
    peak_rss_bytes   BIGINT,
    created          TIMESTAMP NOT NULL DEFAULT current_timestamp
);
