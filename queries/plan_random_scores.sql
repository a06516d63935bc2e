-- plan_random_scores: the "random" ablation strategy: replace every candidate's score by a
-- uniform pseudo-random number, so the prefix cut picks a uniformly random set of blocks of the
-- same byte budget. Values and bounds stay true; only the ranking changes.
-- Parameters: $1 seed (BIGINT).
-- Result: updates plan_candidates.score; row count = candidates rescored.
UPDATE plan_candidates
SET score = CAST(hash(position, tensor_idx, block_idx, $1) % 1000000007 AS DOUBLE) / 1000000007.0;
