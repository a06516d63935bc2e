-- 015_views_again: the views expert_costs (009) and plan_mask (010) as they are defined today.
-- Both migrations were edited after they first landed (2e6feb5 made expert_costs count an adapter's
-- read bytes and fixed factors; a3deedd made plan_mask's nbytes what a merge reads), so a catalog
-- migrated by a mergedb in between kept the older definitions, which count a LoRA adapter's
-- blocks at their dense bytes. Re-created here; no table or row changes. (Migrations are never
-- edited once landed: a change is a new file.)

CREATE OR REPLACE VIEW expert_costs AS
SELECT c.name AS expert,
       b.name AS base,
       CAST(sum(coalesce(eb.read_bytes, bl.nbytes)) + coalesce(max(f.fixed), 0) AS BIGINT) AS total_bytes,
       CAST(coalesce(sum(coalesce(eb.read_bytes, bl.nbytes)) FILTER (WHERE NOT eb.identical), 0)
            + coalesce(max(f.fixed), 0) AS BIGINT) AS changed_bytes,
       sqrt(sum(eb.delta_norm * eb.delta_norm)) AS delta_norm,
       CAST(sum(eb.nnz) AS BIGINT) AS nnz,
       CAST(sum(eb.nonfinite) AS BIGINT) AS nonfinite
FROM expert_blocks eb
JOIN checkpoints c ON c.checkpoint_id = eb.checkpoint_id
JOIN checkpoints b ON b.checkpoint_id = c.base_id
JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx
LEFT JOIN (SELECT checkpoint_id, sum(fixed_bytes) AS fixed FROM expert_tensors GROUP BY checkpoint_id) f
       ON f.checkpoint_id = eb.checkpoint_id
GROUP BY c.name, b.name;

CREATE OR REPLACE VIEW plan_mask AS
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
