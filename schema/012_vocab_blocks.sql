-- 012_vocab_blocks: a base's block layout may give its vocabulary-indexed tensors other blocks
-- (`--block-size auto`, units.BlockSizes; layout.family_layout). For a base:
-- vocab_block_size: the target block size of its vocabulary tensors (2-D, dim 0 = vocab_size), NULL
--   when every tensor was split at block_size; vocab_block_rows: their most rows per block (NULL: no
--   cap); vocab_size: the vocabulary size found at registration (config.json's vocab_size when a
--   tensor has that many rows, else the rows of the tensors named like embeddings and heads;
--   layout.vocab_size), NULL when none was found or the base was registered before 012.
-- The blocks table holds every block's rows either way; nothing reads these columns to plan or merge.

ALTER TABLE checkpoints ADD COLUMN vocab_block_size BIGINT;
ALTER TABLE checkpoints ADD COLUMN vocab_block_rows BIGINT;
ALTER TABLE checkpoints ADD COLUMN vocab_size BIGINT;
