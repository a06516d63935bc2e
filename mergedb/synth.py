"""Synthetic checkpoint families that look like real fine-tunes, for tests, the demo and benchmarks.

A family is a base model plus K experts, each expert = base + Δ where Δ has the structure of real
fine-tuning: its scale varies by orders of magnitude across layers and tensor kinds (lognormal),
it is low-rank plus sparse plus a little dense noise, some experts leave whole tensors
bit-identical to the base (frozen embeddings, untouched layers), and embedding deltas touch only a
subset of rows. Everything is deterministic for a seed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import INDEX, SINGLE
from .errors import MergeDBError
from .tensorfile import DTYPES, SafetensorsWriter, encode


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
    shards: list[list[tuple[str, np.ndarray, str]]] = [[]]
    used = 0
    for name, arr, dt in tensors:
        nbytes = arr.size * DTYPES[dt][0]
        if shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append((name, arr, dt))
        used += nbytes
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
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


def make_family(
    out: str | Path,
    experts: int = 4,
    size: str = "tiny",
    dtype: str = "bf16",
    seed: int = 0,
    shard_size: int = 5 * 10**9,
    nonfloat_buffer: bool = True,
) -> Path:
    """Write `out/base` and `out/expert_00` … `out/expert_{K-1}`; returns `out`."""
    if size not in SIZES:
        raise MergeDBError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if dtype not in DTYPE_NAMES:
        raise MergeDBError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_NAMES)}")
    if experts < 0:
        raise MergeDBError(f"--experts must be ≥ 0, got {experts}")
    out = Path(out)
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
    return out
