-- 001_catalog: checkpoints, their files and tensors, the block layout of each family, and the
-- exact per-(expert, block) and per-(expert, tensor) statistics of every expert's delta.
-- Applied once per catalog; recorded in schema_version. Never edit: add a new numbered file.

CREATE TABLE settings (
    key   VARCHAR PRIMARY KEY,  -- e.g. 'sketch_dim'
    value VARCHAR NOT NULL
);

CREATE TABLE checkpoints (
    checkpoint_id INTEGER PRIMARY KEY,
    name          VARCHAR NOT NULL UNIQUE,
    path          VARCHAR NOT NULL,          -- absolute path the user registered (folder or file)
    root          VARCHAR NOT NULL,          -- absolute folder holding the files
    role          VARCHAR NOT NULL CHECK (role IN ('base', 'expert')),
    base_id       INTEGER,                   -- for experts: the base whose block layout they share
    architecture  VARCHAR,
    dtype         VARCHAR NOT NULL,
    n_tensors     INTEGER NOT NULL,
    bytes         BIGINT NOT NULL,           -- total bytes of its safetensors files
    fingerprint   VARCHAR NOT NULL,          -- sha256 over (file, size, mtime, header sha256)
    content_hash  VARCHAR NOT NULL,          -- xxh3 over its tensors' block hashes: same bytes, same hash
    block_size    BIGINT,                    -- for bases: the target block size of the layout
    registered_at TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE files (
    checkpoint_id INTEGER NOT NULL,
    file_idx      INTEGER NOT NULL,
    relpath       VARCHAR NOT NULL,          -- relative to checkpoints.root
    bytes         BIGINT NOT NULL,
    mtime_ns      BIGINT NOT NULL,
    header_len    BIGINT NOT NULL,
    header_sha256 VARCHAR NOT NULL,
    PRIMARY KEY (checkpoint_id, file_idx)
);

-- A family's tensors, fixed by its base: tensor_idx is the position in the base's file order.
CREATE TABLE family_tensors (
    base_id    INTEGER NOT NULL,
    tensor_idx INTEGER NOT NULL,
    name       VARCHAR NOT NULL,
    dtype      VARCHAR NOT NULL,
    shape      BIGINT[] NOT NULL,
    numel      BIGINT NOT NULL,
    nbytes     BIGINT NOT NULL,
    row_bytes  BIGINT NOT NULL,
    mergeable  BOOLEAN NOT NULL,             -- float tensor (BF16/F16/F32); others pass through
    n_blocks   INTEGER NOT NULL,
    PRIMARY KEY (base_id, tensor_idx)
);

-- Where each checkpoint stores each tensor.
CREATE TABLE tensors (
    checkpoint_id INTEGER NOT NULL,
    tensor_idx    INTEGER NOT NULL,
    file_idx      INTEGER NOT NULL,
    data_start    BIGINT NOT NULL,           -- absolute byte offset in the file
    data_end      BIGINT NOT NULL,
    PRIMARY KEY (checkpoint_id, tensor_idx)
);

-- The block layout: contiguous dim-0 row ranges, each one contiguous byte range.
CREATE TABLE blocks (
    base_id    INTEGER NOT NULL,
    tensor_idx INTEGER NOT NULL,
    block_idx  INTEGER NOT NULL,
    row_start  BIGINT NOT NULL,
    row_end    BIGINT NOT NULL,              -- exclusive
    byte_start BIGINT NOT NULL,              -- relative to the tensor's data_start
    nbytes     BIGINT NOT NULL,
    numel      BIGINT NOT NULL,
    base_hash  VARCHAR NOT NULL,             -- xxh3-128 of the base's bytes of this block
    PRIMARY KEY (base_id, tensor_idx, block_idx)
);

-- Exact statistics of Δ = expert − base per (expert, block). Δ in float32, norms in float64.
CREATE TABLE expert_blocks (
    checkpoint_id INTEGER NOT NULL,
    tensor_idx    INTEGER NOT NULL,
    block_idx     INTEGER NOT NULL,
    identical     BOOLEAN NOT NULL,          -- expert bytes == base bytes: reading it changes nothing
    delta_norm    DOUBLE NOT NULL,           -- ‖Δ‖₂ (NaN when nonfinite > 0)
    max_abs       FLOAT NOT NULL,            -- max |Δ| over finite elements
    nnz           BIGINT NOT NULL,           -- elements with Δ ≠ 0
    nonfinite     BIGINT NOT NULL,           -- elements whose Δ is NaN or ±Inf
    content_hash  VARCHAR NOT NULL,          -- xxh3-128 of the expert's bytes of this block
    hist_lo       FLOAT[] NOT NULL,          -- non-empty |Δ| bins: lower edges (edges 2^e and 1.5·2^e)
    hist_hi       FLOAT[] NOT NULL,          --   upper edges
    hist_count    BIGINT[] NOT NULL,         --   elements per bin
    hist_sum      DOUBLE[] NOT NULL,         --   Σ|Δ| per bin
    hist_sumsq    DOUBLE[] NOT NULL,         --   ΣΔ² per bin
    sketch        FLOAT[] NOT NULL,          -- CountSketch of Δ, settings.sketch_dim entries
    PRIMARY KEY (checkpoint_id, tensor_idx, block_idx)
);

-- Per (expert, tensor): exact top-k thresholds at the density grid and a fine magnitude summary.
CREATE TABLE expert_tensors (
    checkpoint_id  INTEGER NOT NULL,
    tensor_idx     INTEGER NOT NULL,
    identical      BOOLEAN NOT NULL,
    grid_threshold FLOAT[] NOT NULL,         -- [i] = k-th largest |Δ|, k = max(1, int(density_grid[i]·numel))
    summary_code   USMALLINT[] NOT NULL,     -- top 15 bits of |Δ|'s float32 pattern, ascending
    summary_count  BIGINT[] NOT NULL,        -- elements per code (relative bin width 2^-6)
    PRIMARY KEY (checkpoint_id, tensor_idx)
);

-- The densities with exact thresholds: every 0.1% up to 10%, then every 1% up to 100%.
-- grid_idx is 1-based, matching DuckDB list indexing into expert_tensors.grid_threshold.
CREATE TABLE density_grid (
    grid_idx INTEGER PRIMARY KEY,
    density  DOUBLE NOT NULL
);
INSERT INTO density_grid
SELECT row_number() OVER (ORDER BY d), d
FROM (SELECT round(i / 1000, 3) AS d FROM range(1, 101) t(i)
      UNION ALL SELECT round(i / 100, 2) FROM range(11, 101) t(i));

CREATE VIEW expert_costs AS
SELECT c.name AS expert,
       b.name AS base,
       CAST(sum(bl.nbytes) AS BIGINT) AS total_bytes,
       CAST(sum(bl.nbytes) FILTER (WHERE NOT eb.identical) AS BIGINT) AS changed_bytes,
       sqrt(sum(eb.delta_norm * eb.delta_norm)) AS delta_norm,
       CAST(sum(eb.nnz) AS BIGINT) AS nnz,
       CAST(sum(eb.nonfinite) AS BIGINT) AS nonfinite
FROM expert_blocks eb
JOIN checkpoints c ON c.checkpoint_id = eb.checkpoint_id
JOIN checkpoints b ON b.checkpoint_id = c.base_id
JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
GROUP BY c.name, b.name;

CREATE VIEW tensor_summary AS
SELECT c.name AS expert,
       ft.name AS tensor,
       ft.dtype,
       ft.shape,
       ft.n_blocks,
       CAST(sum(bl.nbytes) AS BIGINT) AS bytes,
       CAST(count(*) FILTER (WHERE NOT eb.identical) AS BIGINT) AS changed_blocks,
       sqrt(sum(eb.delta_norm * eb.delta_norm)) AS delta_norm,
       max(eb.max_abs) AS max_abs,
       CAST(sum(eb.nnz) AS BIGINT) AS nnz
FROM expert_blocks eb
JOIN checkpoints c ON c.checkpoint_id = eb.checkpoint_id
JOIN family_tensors ft ON ft.base_id = c.base_id AND ft.tensor_idx = eb.tensor_idx
JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
GROUP BY c.name, ft.name, ft.dtype, ft.shape, ft.n_blocks, ft.tensor_idx
ORDER BY c.name, ft.tensor_idx;
