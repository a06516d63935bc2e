"""Synthetic checkpoint families that look like real fine-tunes, for tests, the demo and benchmarks.

A family is a base model plus K experts, each expert = base + Δ where Δ has the structure of real
fine-tuning: its scale varies by orders of magnitude across layers and tensor kinds (lognormal),
it is low-rank plus sparse plus a little dense noise, some experts leave whole tensors
bit-identical to the base (frozen embeddings, untouched layers), and embedding deltas touch only a
subset of rows. Everything is deterministic for a seed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .checkpoint import INDEX
from .encoding import encode
from .errors import MergeDBError
from .layout import shard_groups, shard_names
from .tensorfile import DTYPES, SafetensorsWriter

if TYPE_CHECKING:
    from .catalog import Catalog


@dataclass(frozen=True)
class Size:
    """Llama-style model dimensions."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int


SIZES = {
    "tiny": Size(hidden=128, intermediate=344, layers=2, vocab=2048, heads=4, kv_heads=2),  # ~0.9M params
    "small": Size(hidden=512, intermediate=1376, layers=4, vocab=8192, heads=8, kv_heads=4),  # ~21M params
    "bench": Size(hidden=1024, intermediate=2816, layers=7, vocab=32000, heads=16, kv_heads=8),  # ~154M params
}
DTYPE_NAMES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}


def tensor_specs(size: Size, nonfloat_buffer: bool = True) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in the order a Llama checkpoint stores them."""
    h, i, hd = size.hidden, size.intermediate, size.hidden // size.heads
    kv = size.kv_heads * hd
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (size.vocab, h), "embed")]
    for n in range(size.layers):
        p = f"model.layers.{n}."
        specs += [
            (p + "self_attn.q_proj.weight", (h, h), "attn"),
            (p + "self_attn.k_proj.weight", (kv, h), "attn"),
            (p + "self_attn.v_proj.weight", (kv, h), "attn"),
            (p + "self_attn.o_proj.weight", (h, h), "attn"),
            (p + "mlp.gate_proj.weight", (i, h), "mlp"),
            (p + "mlp.up_proj.weight", (i, h), "mlp"),
            (p + "mlp.down_proj.weight", (h, i), "mlp"),
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    specs += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (size.vocab, h), "head")]
    if nonfloat_buffer:
        specs.append(("model.rotary_emb.position_ids", (1, 64), "buffer"))
    return specs


# typical |Δ| per kind (median of the lognormal scale across layers)
_KIND_SCALE = {"embed": 2e-3, "attn": 1e-3, "mlp": 6e-4, "norm": 3e-3, "head": 1e-3}


def _base_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "norm":
        return (1.0 + 0.05 * rng.standard_normal(shape, np.float32)).astype(np.float32)
    if kind == "buffer":
        return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    fan_in = shape[-1]
    return rng.standard_normal(shape, np.float32) * np.float32(1.0 / math.sqrt(fan_in))


def _delta(rng: np.random.Generator, shape: tuple[int, ...], kind: str, scale: float) -> np.ndarray:
    """Low-rank + sparse + a little dense noise, overall magnitude ~ `scale`."""
    if len(shape) == 1:
        return (scale * rng.standard_normal(shape, np.float32)).astype(np.float32)
    rows, cols = shape
    rank = 4
    u = rng.standard_normal((rows, rank), np.float32)
    v = rng.standard_normal((rank, cols), np.float32) * np.float32(scale / math.sqrt(rank))
    d = u @ v  # (rows, cols) float32, low rank
    d += rng.standard_normal(shape, np.float32) * np.float32(0.3 * scale)
    n_sparse = max(1, d.size // 500)
    flat = d.reshape(-1)
    idx = rng.integers(0, d.size, n_sparse)
    flat[idx] += rng.standard_normal(n_sparse, np.float32) * np.float32(8 * scale)
    if kind == "embed":  # fine-tunes touch only the rows of tokens they saw (or added)
        touched = rng.random(rows) < 0.1
        d[~touched] = 0
    return d


def _write_model(
    folder: Path,
    tensors: list[tuple[str, np.ndarray, str]],
    shard_size: int,
    size: Size,
    dtype: str,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    groups = shard_groups([arr.size * DTYPES[dt][0] for _, arr, dt in tensors], shard_size)
    shards = [[tensors[i] for i in g] for g in groups]
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in zip(names, shards):
        entries = [(n, dt, tuple(a.shape)) for n, a, dt in shard]
        with SafetensorsWriter(folder / fname, entries, {"format": "pt"}) as w:
            for n, a, dt in shard:
                w.write(n, encode(a, dt) if dt in ("BF16", "F16", "F32") else a)
                weight_map[n] = fname
        total += w.total_size
    if len(shards) > 1:
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    torch_dtype = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[dtype]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "vocab_size": size.vocab,
        "rms_norm_eps": 1e-5,
        "torch_dtype": torch_dtype,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    vocab = {f"tok{i}": i for i in range(min(size.vocab, 256))}
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": vocab}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "tok1", "eos_token": "tok2"}))


def many_tensors(out: str | Path, experts: int, n: int, seed: int = 0) -> Path:
    """A base and `experts` experts of `n` float32 tensors of 4 × 16 each, every tensor changed: a family
    whose statistic rows (one block and one tensor row per (expert, tensor)) outweigh its bytes, as a
    mixture-of-experts checkpoint's thousands of small tensors do (tests; benchmarks/bench_many_tensors)."""
    out = Path(out)
    rng = np.random.default_rng(seed)
    base = {f"layers.{i:05d}.weight": rng.standard_normal((4, 16)).astype(np.float32) for i in range(n)}
    models = {"base": base}
    for k in range(experts):
        models[f"expert_{k:02d}"] = {
            t: v + np.float32(1e-3) * rng.standard_normal(v.shape).astype(np.float32) for t, v in base.items()
        }
    for name, tensors in models.items():
        (out / name).mkdir(parents=True)
        entries = [(t, "F32", a.shape) for t, a in tensors.items()]
        with SafetensorsWriter(out / name / "model.safetensors", entries, {"format": "pt"}) as w:
            for t, a in tensors.items():
                w.write(t, encode(a, "F32"))
    return out


MAX_EXPERTS = 10_000  # a synthetic family for tests and demos; past this a typo (1e9) filled memory first


def make_family(
    out: str | Path,
    experts: int = 4,
    size: str = "tiny",
    dtype: str = "bf16",
    seed: int = 0,
    shard_size: int = 5 * 10**9,
    nonfloat_buffer: bool = True,
) -> Path:
    """Write `out/base` and `out/expert_00` … `out/expert_{K-1}`; returns `out`. A failed write (a full
    disk) raises MergeDBError and removes the model folders this call made, so no partial checkpoint
    is left to look like one."""
    if size not in SIZES:
        raise MergeDBError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if dtype not in DTYPE_NAMES:
        raise MergeDBError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if not whole(experts) or not 0 <= experts <= MAX_EXPERTS:
        raise MergeDBError(f"--experts must be a whole number from 0 to {MAX_EXPERTS}, got {experts!r}")
    if not whole(seed) or not 0 <= seed < 2**63:
        raise MergeDBError(f"--seed must be a whole number from 0 to 2^63 - 1, got {seed!r}")
    if not whole(shard_size) or shard_size < 1:
        raise MergeDBError(f"shard_size must be a whole number of bytes ≥ 1, got {shard_size!r}")
    out = Path(out)
    models = [out / "base", *(out / f"expert_{k:02d}" for k in range(experts))]
    made = [p for p in models if not p.exists()]  # removed again if the write fails, with the new
    parents = [p for p in (out, *out.parents) if not p.exists()]  # folders holding them (deepest first)
    try:
        _write_family(out, experts, size, dtype, seed, shard_size, nonfloat_buffer)
    except BaseException as e:
        for folder in made:  # only what this call made: a model that was there stays
            shutil.rmtree(folder, ignore_errors=True)
        for folder in parents:  # empty now, unless something else was written into them meanwhile
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(e, OSError):
            raise MergeDBError(
                f"cannot write {e.filename or out}: {e.strerror or e}; nothing was left behind, {_fix(e)}"
            ) from None
        raise
    return out


def _fix(e: OSError) -> str:
    """What to do about a failed write."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space and retry"
    if e.errno == errno.EFBIG:
        return "free space or raise the file size limit (ulimit -f) and retry"
    return "choose a folder you can write"


def _write_family(
    out: Path, experts: int, size: str, dtype: str, seed: int, shard_size: int, nonfloat_buffer: bool
) -> None:
    dims, dt = SIZES[size], DTYPE_NAMES[dtype]
    specs = tensor_specs(dims, nonfloat_buffer)
    base: list[tuple[str, np.ndarray, str]] = []
    for ti, (name, shape, kind) in enumerate(specs):
        arr = _base_tensor(np.random.default_rng([seed, 0, ti]), shape, kind)
        base.append((name, arr, "I64" if kind == "buffer" else dt))
    _write_model(out / "base", base, shard_size, dims, dt)
    for k in range(experts):
        rng = np.random.default_rng([seed, k + 1])
        frozen_embed = rng.random() < 0.5
        untouched_layers = {n for n in range(dims.layers) if rng.random() < 0.2}
        layer_scale = np.exp(1.2 * rng.standard_normal(dims.layers + 2))  # orders of magnitude across depth
        tensors: list[tuple[str, np.ndarray, str]] = []
        for ti, ((name, shape, kind), (_, b, bdt)) in enumerate(zip(specs, base)):
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            frozen = (
                kind == "buffer"
                or (kind == "embed" and frozen_embed)
                or layer in untouched_layers
                or (kind == "norm" and rng.random() < 0.5)
            )
            if frozen:
                tensors.append((name, b, bdt))
                continue
            trng = np.random.default_rng([seed, k + 1, ti])
            scale = _KIND_SCALE[kind] * layer_scale[layer + 1] * math.exp(0.8 * trng.standard_normal())
            tensors.append((name, b + _delta(trng, shape, kind, scale), bdt))
        _write_model(out / f"expert_{k:02d}", tensors, shard_size, dims, dt)


def simulate(
    cat: Catalog,
    experts: int,
    tensors: int,
    blocks_per_tensor: int,
    *,
    block_bytes: int | list[int] = 4 * 2**20,
    identical_fraction: float = 0.1,
    seed: int = 0,
) -> None:
    """Write a synthetic family's rows straight into the catalog (no checkpoint files).

    For planner tests and benchmarks at sizes no disk here could hold: `experts × tensors ×
    blocks_per_tensor` expert-block rows with lognormal delta norms, random identical blocks and
    random sketches. Files point nowhere; only planning works on such a family.
    """
    from .register import append_rows

    rng = np.random.default_rng(seed)
    dim = cat.sketch_dim()
    with cat.duckdb_connection(write=True, create=True) as con:
        con.execute("BEGIN")
        cat.make_if_blank(con)
        base_id = int(con.execute("SELECT coalesce(max(checkpoint_id), 0) + 1 FROM checkpoints").fetchall()[0][0])
        nb = tensors * blocks_per_tensor
        sizes = np.broadcast_to(np.asarray(block_bytes, np.int64), (nb,)).reshape(tensors, blocks_per_tensor)
        for k in range(experts + 1):
            con.execute(
                "INSERT INTO checkpoints (checkpoint_id, name, path, root, role, base_id, architecture, dtype, "
                "n_tensors, bytes, fingerprint, content_hash, block_size) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    base_id + k,
                    f"sim{base_id}_base" if k == 0 else f"sim{base_id}_e{k - 1:03d}",
                    "/nonexistent",
                    "/nonexistent",
                    "base" if k == 0 else "expert",
                    None if k == 0 else base_id,
                    "Simulated",
                    "BF16",
                    tensors,
                    int(sizes.sum()),
                    f"sim-{seed}-{k}",
                    f"sim-{seed}-{k}",
                    None,
                ],
            )
        append_rows(
            con,
            "family_tensors",
            pa.table(
                {
                    "base_id": pa.array([base_id] * tensors, pa.int32()),
                    "tensor_idx": pa.array(range(tensors), pa.int32()),
                    "name": [f"t{t}" for t in range(tensors)],
                    "dtype": ["BF16"] * tensors,
                    "shape": pa.array([[int(sizes[t].sum()) // 2] for t in range(tensors)], pa.list_(pa.int64())),
                    "numel": pa.array(sizes.sum(axis=1) // 2, pa.int64()),
                    "nbytes": pa.array(sizes.sum(axis=1), pa.int64()),
                    "row_bytes": pa.array([2] * tensors, pa.int64()),
                    "mergeable": [True] * tensors,
                    "n_blocks": pa.array([blocks_per_tensor] * tensors, pa.int32()),
                }
            ),
        )
        t_idx = np.repeat(np.arange(tensors, dtype=np.int32), blocks_per_tensor)
        b_idx = np.tile(np.arange(blocks_per_tensor, dtype=np.int32), tensors)
        starts = np.concatenate([np.r_[0, np.cumsum(s)[:-1]] for s in sizes])
        append_rows(
            con,
            "blocks",
            pa.table(
                {
                    "base_id": pa.array(np.full(nb, base_id, np.int32)),
                    "tensor_idx": pa.array(t_idx),
                    "block_idx": pa.array(b_idx),
                    "row_start": pa.array(starts // 2),
                    "row_end": pa.array((starts + sizes.reshape(-1)) // 2),
                    "byte_start": pa.array(starts),
                    "nbytes": pa.array(sizes.reshape(-1)),
                    "numel": pa.array(sizes.reshape(-1) // 2),
                    "base_hash": pa.array(["0"] * nb),
                }
            ),
        )
        for k in range(experts):
            ident = rng.random(nb) < identical_fraction
            norm = np.where(ident, 0.0, np.exp(rng.normal(0, 2, nb)))
            sk = (rng.standard_normal((nb, dim)) * (norm[:, None] / np.sqrt(dim))).astype(np.float32)
            lo = (norm / 100).astype(np.float32)
            append_rows(
                con,
                "expert_blocks",
                pa.table(
                    {
                        "checkpoint_id": pa.array(np.full(nb, base_id + 1 + k, np.int32)),
                        "tensor_idx": pa.array(t_idx),
                        "block_idx": pa.array(b_idx),
                        "identical": pa.array(ident),
                        "delta_norm": pa.array(norm),
                        "max_abs": pa.array((norm / 10).astype(np.float32)),
                        "nnz": pa.array(np.where(ident, 0, sizes.reshape(-1) // 2)),
                        "nonfinite": pa.array(np.zeros(nb, np.int64)),
                        "content_hash": pa.array(["0"] * nb),
                        "hist_lo": pa.FixedSizeListArray.from_arrays(lo, 1).cast(pa.list_(pa.float32())),
                        "hist_hi": pa.FixedSizeListArray.from_arrays(lo * 2, 1).cast(pa.list_(pa.float32())),
                        "hist_count": pa.FixedSizeListArray.from_arrays(sizes.reshape(-1) // 2, 1).cast(
                            pa.list_(pa.int64())
                        ),
                        "hist_sum": pa.FixedSizeListArray.from_arrays(norm, 1).cast(pa.list_(pa.float64())),
                        "hist_sumsq": pa.FixedSizeListArray.from_arrays(norm**2, 1).cast(pa.list_(pa.float64())),
                        "sketch": pa.FixedSizeListArray.from_arrays(sk.reshape(-1), dim).cast(pa.list_(pa.float32())),
                    }
                ),
            )
        con.execute("COMMIT")
