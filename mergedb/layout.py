"""Block layout: how a family's tensors split into blocks of dim-0 rows, and the row arithmetic.

A block is rows [row_start, row_end) of one tensor, so it is one contiguous byte range in every
checkpoint of the family (safetensors data is row-major). 1-D tensors, scalars and tensors whose
rows are not whole bytes are one block. The base fixes the layout; registration stores it and the
executor reads it back as `TensorLayout`s. Block sizes may differ per tensor (units.BlockSizes:
`--block-size auto` gives the vocabulary-indexed tensors small row blocks; vocab_size below).
Output shard naming lives here too, shared by the executor and the synthetic families.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .checkpoint import SINGLE
from .tensorfile import TensorInfo
from .units import BlockSizes

# last name part (before `.weight`) of the tensors that are indexed by token: embeddings and LM heads
# of Llama/Mistral/Qwen/Gemma (embed_tokens, lm_head), GPT-2 (wte), GPT-NeoX (embed_in, embed_out),
# BLOOM/BERT (word_embeddings), Meta's original Llama files (tok_embeddings, output), T5 (shared),
# Mamba (embeddings)
VOCAB_NAMES = frozenset(
    {
        "embed_tokens",
        "lm_head",
        "wte",
        "embed_in",
        "embed_out",
        "word_embeddings",
        "tok_embeddings",
        "output",
        "shared",
        "embeddings",
    }
)


@dataclass(frozen=True)
class Block:
    """One block of the family layout: rows [row_start, row_end) of tensor `tensor_idx`."""

    tensor_idx: int
    block_idx: int
    row_start: int
    row_end: int
    byte_start: int  # relative to the tensor's data start
    nbytes: int
    numel: int


@dataclass(frozen=True)
class FamilyTensor:
    """A tensor of a family, as the base defines it."""

    tensor_idx: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    row_bytes: int
    mergeable: bool
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class TensorLayout:
    """A tensor of the family and its blocks (dim-0 row ranges), as the executor needs it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    mergeable: bool
    rows: tuple[tuple[int, int], ...]
    base_hashes: tuple[str, ...] = ()


def n_rows(shape: tuple[int, ...]) -> int:
    """Rows of the block layout: dim 0 of a tensor of rank ≥ 2, else one row."""
    return shape[0] if len(shape) >= 2 else 1


def row_elems(shape: tuple[int, ...]) -> int:
    """Elements per layout row: the product of the dims after the first (all of a 1-D tensor)."""
    return math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)


def row_bytes(nbytes: int, shape: tuple[int, ...]) -> int:
    """Bytes per layout row of a tensor of `nbytes` bytes."""
    rows = n_rows(shape)
    return nbytes // rows if rows else 0


def block_bytes(t: TensorLayout, nbytes: int, b: int) -> tuple[int, int]:
    """Byte range [start, end) of block `b` of `t` within the tensor's `nbytes` bytes of data."""
    if len(t.rows) == 1:
        return 0, nbytes
    rb = row_bytes(nbytes, t.shape)
    r0, r1 = t.rows[b]
    return r0 * rb, r1 * rb


def span_bytes(t: TensorLayout, nbytes: int, b: int | tuple[int, ...]) -> tuple[int, int]:
    """Byte range of block `b`, or of a span of consecutive blocks (a tuple: first to last)."""
    if isinstance(b, int):
        return block_bytes(t, nbytes, b)
    return block_bytes(t, nbytes, b[0])[0], block_bytes(t, nbytes, b[-1])[1]


def spans(
    t: TensorLayout, nbytes: int, blocks: list[int], key: Callable[[int], object], cap: int
) -> list[tuple[int, ...]]:
    """`blocks` (ascending) cut into runs of consecutive blocks with equal `key(b)` and at most
    `cap` bytes each (a block larger than `cap` is a run of its own): what the executor merges with
    one read per expert and one kernel call (merger.Merger.units)."""
    out: list[list[int]] = []
    size = 0
    for b in blocks:
        lo, hi = block_bytes(t, nbytes, b)
        if out and out[-1][-1] == b - 1 and key(out[-1][-1]) == key(b) and size + hi - lo <= cap:
            out[-1].append(b)
            size += hi - lo
        else:
            out.append([b])
            size = hi - lo
    return [tuple(r) for r in out]


def element_offset(ft: FamilyTensor, blk: Block) -> int:
    """Index of the block's first element in the flattened tensor."""
    return blk.row_start * row_elems(ft.shape) if len(ft.shape) >= 2 else 0


def _part(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] == "weight" else parts[-1]


def vocab_size(tensors: list[TensorInfo], config_vocab: int | None = None) -> int | None:
    """The vocabulary size of a model's tensors, or None when it has none.

    `config_vocab` (config.json's vocab_size, read without network beside the weights) when some
    2-D tensor has that many rows; else the largest dim 0 of the 2-D tensors named like an
    embedding or LM head (VOCAB_NAMES: `model.embed_tokens.weight`, `lm_head.weight`,
    `transformer.wte.weight`, …); else None. A tied head is one tensor; an untied one is another
    tensor with the same dim 0."""
    two_d = [t for t in tensors if len(t.shape) == 2]
    if config_vocab and any(t.shape[0] == config_vocab for t in two_d):
        return config_vocab
    named = [t.shape[0] for t in two_d if _part(t.name) in VOCAB_NAMES]
    return max(named) if named else None


def is_vocab_tensor(t: TensorInfo, vocab: int | None) -> bool:
    """Whether `t` is indexed by token: 2-D with dim 0 equal to the vocabulary size."""
    return vocab is not None and len(t.shape) == 2 and t.shape[0] == vocab


def blocks_of(idx: int, t: TensorInfo, block_size: int, max_rows: int | None = None) -> FamilyTensor:
    """Split tensor `t` (index `idx` in the family) into blocks of about `block_size` bytes of whole
    rows, and at most `max_rows` rows when given."""
    rows = n_rows(t.shape)
    rb = row_bytes(t.nbytes, t.shape)
    splittable = len(t.shape) >= 2 and rb > 0 and rb * rows == t.nbytes
    if not splittable:  # 1-D, empty, or rows that are not whole bytes (packed sub-byte dtypes): one block
        blk = Block(idx, 0, 0, rows, 0, t.nbytes, t.numel)
        return FamilyTensor(idx, t.name, t.dtype, t.shape, t.numel, t.nbytes, t.nbytes, t.is_float, (blk,))
    per_row = row_elems(t.shape)
    rows_per_block = max(1, block_size // rb)
    if max_rows is not None:
        rows_per_block = min(rows_per_block, max(1, max_rows))
    blocks = []
    for b, r0 in enumerate(range(0, rows, rows_per_block)):
        r1 = min(rows, r0 + rows_per_block)
        blocks.append(Block(idx, b, r0, r1, r0 * rb, (r1 - r0) * rb, (r1 - r0) * per_row))
    return FamilyTensor(idx, t.name, t.dtype, t.shape, t.numel, t.nbytes, rb, t.is_float, tuple(blocks))


def family_layout(
    tensors: list[TensorInfo], block_size: int | BlockSizes, vocab: int | None = None
) -> list[FamilyTensor]:
    """The layout of a base's tensors, in the base's order: blocks of `block_size` bytes, or with a
    BlockSizes rule, its vocabulary block for the tensors with `vocab` rows (is_vocab_tensor;
    `vocab`: vocab_size(), None for no vocabulary) and its size for the others."""
    rule = block_size if isinstance(block_size, BlockSizes) else BlockSizes(block_size)
    out = []
    for i, t in enumerate(tensors):
        if rule.vocab is not None and is_vocab_tensor(t, vocab):
            out.append(blocks_of(i, t, rule.vocab, rule.vocab_rows))
        else:
            out.append(blocks_of(i, t, rule.size))
    return out


def shard_names(n: int) -> list[str]:
    """File names of an n-shard output, as transformers writes them."""
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def shard_groups(sizes: list[int], max_shard_size: int) -> list[list[int]]:
    """Indices of consecutive items grouped into shards of at most `max_shard_size` bytes (an
    item larger than that gets a shard of its own)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, nbytes in enumerate(sizes):
        if groups[-1] and used + nbytes > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += nbytes
    return groups


def output_dtype(t: TensorLayout, dtype: str | None) -> str:
    """The dtype tensor `t` is written in: the asked `dtype` for a merged tensor, else its own."""
    return (dtype or t.dtype) if t.mergeable else t.dtype
