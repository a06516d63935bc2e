-- plan_carriers: for each (expert, tensor) of the plan with a fixed cost (a LoRA adapter's factor R,
-- expert_tensors.fixed_bytes, schema/009), the candidate that carries it: the non-free candidate
-- of that (position, tensor_idx) with the highest score, lowest block_idx on ties. Its score once it
-- carries R: value / (nbytes + fixed_bytes), or its current score when the random strategy set
-- the scores. Run after plan_candidates(_trimmed) and any rescoring, only when some expert of the
-- plan has fixed bytes; queries/plan_fixed_cost.sql applies it.
-- Parameters: $1 keep_scores (BOOLEAN: true for --strategy random).
-- Result: temp table plan_carriers(position, tensor_idx, block_idx, fixed_bytes, score).
CREATE OR REPLACE TEMP TABLE plan_carriers AS
SELECT position, tensor_idx, block_idx, fixed_bytes,
       CASE WHEN $1 THEN score ELSE value / greatest(nbytes + fixed_bytes, 1) END AS score
FROM (
    SELECT pc.position, pc.tensor_idx, pc.block_idx, pc.nbytes, pc.value, pc.score, et.fixed_bytes,
           row_number() OVER (PARTITION BY pc.position, pc.tensor_idx ORDER BY pc.score DESC, pc.block_idx
                              ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS rn
    FROM plan_candidates pc
    JOIN expert_tensors et ON et.checkpoint_id = pc.checkpoint_id AND et.tensor_idx = pc.tensor_idx
    WHERE et.fixed_bytes > 0 AND NOT pc.free
)
WHERE rn = 1;
