-- 010_plan_mask_bits: a plan's mask stored as one bit string per (plan, expert, tensor) instead of
-- one row per (plan, expert, block): a plan of 1,000 experts × a 70B layout at 4 MiB blocks has
-- ~35M candidates, which were 35M rows (~1 GB, seconds to write); as bits they are ~4 MB in
-- ~700k rows, whatever the pattern of selected blocks. Runs of selected blocks (one row per run)
-- were measured too: ~0.9 rows per selected block on simulated scores (900k runs for 1M selected
-- of 10M), 0.8 on the bench family at 10% (125 runs for 152 blocks), so bits it is.
-- `plan_mask` becomes a view that expands the bits to the old (plan, expert, tensor, block) rows
-- for people and queries: selected, free and nbytes (a merge's read cost, see the view). The
-- per-candidate score and value are no longer stored (they are the planner's working data:
-- `Catalog.plan_candidates` recomputes them for a request); candidates left out under --allow-nonfinite are not rows of the view.
-- Existing plans' masks are converted here; plans, hashes and manifests are unchanged.

CREATE TABLE plan_mask_bits (
    plan_id       INTEGER NOT NULL,
    checkpoint_id INTEGER NOT NULL,
    tensor_idx    INTEGER NOT NULL,
    selected      BIT NOT NULL               -- bit b (get_bit(selected, b), 0 = leftmost) is block b:
                                             -- 1 = the plan reads it; one bit per block of the tensor
);

INSERT INTO plan_mask_bits (plan_id, checkpoint_id, tensor_idx, selected)
SELECT g.plan_id, g.checkpoint_id, g.tensor_idx,
       CAST(string_agg(CASE WHEN coalesce(m.selected, false) THEN '1' ELSE '0' END, ''
                       ORDER BY bl.block_idx) AS BIT)
FROM (SELECT DISTINCT plan_id, checkpoint_id, tensor_idx FROM plan_mask) g
JOIN plans p ON p.plan_id = g.plan_id
JOIN blocks bl ON bl.base_id = p.base_id AND bl.tensor_idx = g.tensor_idx
LEFT JOIN plan_mask m ON m.plan_id = g.plan_id AND m.checkpoint_id = g.checkpoint_id
    AND m.tensor_idx = g.tensor_idx AND m.block_idx = bl.block_idx
GROUP BY g.plan_id, g.checkpoint_id, g.tensor_idx;

DROP TABLE plan_mask;

-- One row per candidate (expert block of a plan's expert on a tensor the plan scored). nbytes is
-- what a merge reads for the block: the block's bytes for a dense expert, expert_blocks.read_bytes
-- for a LoRA adapter (schema/009), and on the first selected block of each adapter (expert,
-- tensor) also the factor read once for the tensor (expert_tensors.fixed_bytes). So
-- sum(nbytes) FILTER (WHERE selected) of a plan is its selected bytes, each fixed factor counted
-- once. (The planner charges the factor to its best-scored block, the carrier, which scores
-- are not stored to name; the bytes are the same.)
CREATE VIEW plan_mask AS
SELECT m.plan_id, m.checkpoint_id, m.tensor_idx, eb.block_idx,
       get_bit(m.selected, eb.block_idx) = 1 AS selected,
       eb.identical AS free,
       coalesce(eb.read_bytes, bl.nbytes)
           + CASE WHEN bit_position('1'::BIT, m.selected) = eb.block_idx + 1 THEN coalesce(et.fixed_bytes, 0)
                  ELSE 0 END AS nbytes
FROM plan_mask_bits m
JOIN plans p ON p.plan_id = m.plan_id
JOIN expert_blocks eb ON eb.checkpoint_id = m.checkpoint_id AND eb.tensor_idx = m.tensor_idx
JOIN blocks bl ON bl.base_id = p.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
LEFT JOIN expert_tensors et ON et.checkpoint_id = m.checkpoint_id AND et.tensor_idx = m.tensor_idx
WHERE eb.nonfinite = 0 OR get_bit(m.selected, eb.block_idx) = 1;
