"""`execute --as-lora`: a linear or task-arithmetic plan over LoRA adapters, written as one PEFT adapter.

A sum of low-rank deltas is low-rank. For every base tensor some selected adapter touches, in the
base tensor's orientation (lora.py: ΔW_k = s_k · L_k @ R_k), the merged delta is

    Σ_k c_k s_k L_k R_k = [c_1 s_1 L_1 | c_2 s_2 L_2 | …] @ [R_1; R_2; …]

with c_k the plan's coefficient of expert k in that tensor (linear: w_k/Σw; task arithmetic: λ·w_k).
Written as PEFT factors (B = L, A = R for a Linear; A = Lᵀ, B = Rᵀ for an Embedding or a
fan_in_fan_out Conv1D), with the coefficients and scalings folded into the rows factor L, so
the module's rank is the sum of the adapters' ranks and lora_alpha = rank gives peft's scaling 1.
The factors are computed in float64 and rounded once to the output dtype (float32 by default).

Budgets: the plan's mask selects blocks of rows of ΔW per (expert, tensor). An omitted block
means that expert's Δ is 0 there, so its rows of L are zero in the output (the rows factor is
read only for the selected blocks, R once per (expert, tensor)); an (expert, tensor) with no
selected block contributes nothing and no rank.

`rank=R` replaces each module's factors by the best rank-R approximation of their product
(lowrank.truncate: QR of both factors and an SVD of the small core, never the full ΔW); the
manifest records each tensor's relative Frobenius error. Modules whose summed rank differs from
the most common one get `rank_pattern` / `alpha_pattern` entries (the module name, regex-escaped).

Refused, before anything is read or written: other methods (their result is not a sum of the
deltas), experts that are not adapters, and modules_to_save tensors the plan selects (a dense
replacement cannot be expressed as factors; execute without --as-lora for a full model).

The output folder holds adapter_config.json, adapter_model.safetensors, mergedb_manifest.json
(the executor's manifest plus a `lora` section) and mask.parquet, written like the executor's
(a temporary sibling, fsynced, renamed into place by outdir.py).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import xxhash

from . import lora, loraread, outdir
from .checkpoint import open_checkpoint, refuse_changed
from .encoding import encode
from .errors import ChangedFileError, MergeDBError, PlanError
from .executor import ExecuteResult
from .executor import replay as replay_model
from .jsondoc import write_json
from .lowrank import Factors, concat, truncate
from .manifest import (
    MANIFEST,
    MASK,
    ExecutionPlan,
    build_manifest,
    mask_table,
    plan_from_manifest,
)
from .measure import peak_rss, physical_read_bytes
from .tensorfile import PT_METADATA, SafetensorsWriter, normalize_dtype

METHODS = ("linear", "task_arithmetic")
PREFIX = "base_model.model."


@dataclass(frozen=True)
class Term:
    """One expert's part of one output module: where to read it and what to multiply it by."""

    position: int
    factor: lora.LoraFactor
    coef: float  # the plan's c_k in this tensor (the adapter's own scaling is factor.scale)
    blocks: tuple[int, ...]  # selected blocks of ΔW rows


@dataclass(frozen=True)
class Module:
    """One module of the output adapter: the base tensor it adapts and the experts' terms."""

    tensor_idx: int
    tensor: str
    module: str
    embedding: bool
    transposed: bool
    rows: int  # ΔW rows (the base tensor's dim 0)
    cols: int
    terms: tuple[Term, ...]

    def rank(self, cut: int | None) -> int:
        total = sum(t.factor.rank for t in self.terms)
        return total if cut is None else min(cut, total, self.rows, self.cols)

    def keys(self) -> tuple[str, str]:
        """peft's keys of (A, B) for this module."""
        if self.embedding:
            return f"{PREFIX}{self.module}.lora_embedding_A", f"{PREFIX}{self.module}.lora_embedding_B"
        return f"{PREFIX}{self.module}.lora_A.weight", f"{PREFIX}{self.module}.lora_B.weight"

    def shapes(self, cut: int | None) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of (A, B) in peft's layout: A (r, in), B (out, r); ΔW = (B @ A)ᵀ when transposed."""
        r = self.rank(cut)
        if self.transposed:
            return (r, self.rows), (self.cols, r)
        return (r, self.cols), (self.rows, r)


def check_plan(xp: ExecutionPlan) -> tuple[list[lora.Adapter], list[Module]]:
    """The plan's adapters and the output's modules, or a one-line refusal (nothing read yet)."""
    if xp.method not in METHODS:
        raise PlanError(
            f"--as-lora writes linear and task_arithmetic merges only (a sum of low-rank deltas); plan "
            f"{xp.plan_id or xp.plan_hash[:12]} is {xp.method}: execute it without --as-lora for a full model"
        )
    base = open_checkpoint(xp.base.path, name=xp.base.name)
    if base.fingerprint != xp.base.fingerprint:
        raise ChangedFileError(
            f"{xp.base.name} ({xp.base.path}) changed since it was registered; re-register it with "
            "`mergedb register --refresh` and plan again"
        )
    adapters = []
    for src in xp.experts:
        if not lora.is_adapter(src.path):
            raise PlanError(
                f"expert {src.name} ({src.path}) is a full checkpoint, not a LoRA adapter; --as-lora needs every "
                "expert of the plan to be an adapter: plan the adapters alone, or execute without --as-lora"
            )
        ad = lora.open_adapter(src.path, base, src.name)
        refuse_changed(src, ad.fingerprint)
        adapters.append(ad)
    sel = xp.selected()
    values = xp.tensor_values()
    modules = []
    for ti, blocks in sorted(sel.items()):
        t = xp.tensors[ti]
        by_pos: dict[int, list[int]] = {}
        for b, entries in sorted(blocks.items()):
            for pos, _ in entries:
                by_pos.setdefault(pos, []).append(b)
        terms = []
        for pos, bl in sorted(by_pos.items()):
            ad = adapters[pos]
            if t.name in ad.dense:
                raise PlanError(
                    f"adapter {ad.name} saves tensor {t.name!r} whole (modules_to_save), and the plan merges it: a "
                    "LoRA output holds factors only; execute without --as-lora for a full model, or plan without "
                    "that adapter"
                )
            if t.name not in ad.factors:  # no delta there (free blocks are never selected, but be safe)
                continue
            coef = values.get((pos, ti), xp.default_values(pos)).coef
            terms.append(Term(pos, ad.factors[t.name], float(coef), tuple(bl)))
        if not terms:
            continue
        kinds = {(x.factor.embedding, x.factor.fan_in_fan_out) for x in terms}
        if len(kinds) > 1:
            raise PlanError(
                f"the adapters of plan {xp.plan_id} adapt {t.name!r} in different layouts (fan_in_fan_out or "
                "embedding differ); one LoRA output cannot hold both: execute without --as-lora"
            )
        f0 = terms[0].factor
        rows, cols = t.shape
        modules.append(
            Module(ti, t.name, t.name.removesuffix(".weight"), f0.embedding, f0.transposed, rows, cols, tuple(terms))
        )
    if not modules:
        raise PlanError(
            f"plan {xp.plan_id} selects no adapter block (its budget reads nothing), so its merge is the base "
            "itself and there is no adapter to write; plan with a larger --budget"
        )
    fifo = {m.terms[0].factor.fan_in_fan_out for m in modules if not m.embedding}
    if len(fifo) > 1:
        raise PlanError(
            f"plan {xp.plan_id} mixes fan_in_fan_out and plain Linear modules; peft's config holds one "
            "fan_in_fan_out for the whole adapter: execute without --as-lora"
        )
    return adapters, modules


def _factors(files: list[loraread.AdapterFiles], xp: ExecutionPlan, m: Module) -> Factors:
    """[c_k s_k L_k | …] (rows, Σr) and [R_k; …] (Σr, cols) of module `m`, base orientation; L's rows
    of omitted blocks are zero (never read)."""
    layout = xp.tensors[m.tensor_idx]
    ls, rs, scales = [], [], []
    for term in m.terms:
        f = term.factor
        left = np.zeros((m.rows, f.rank), np.float32)  # (rows, r)
        for b in term.blocks:
            r0, r1 = layout.rows[b]
            left[r0:r1] = loraread.read_rows(files[term.position], f, r0, r1)[0]
        ls.append(left)
        rs.append(loraread.read_fixed(files[term.position], f)[0])  # (r, cols)
        scales.append(term.coef * f.scale)
    return concat(ls, rs, scales)


def _merge(
    xp: ExecutionPlan, adapters: list[lora.Adapter], modules: list[Module], rank: int | None
) -> Iterator[tuple[Module, np.ndarray, np.ndarray, float | None]]:
    files = []
    try:
        for ad in adapters:
            files.append(loraread.AdapterFiles(ad))
        for m in modules:
            f = _factors(files, xp, m)
            err = None
            if rank is not None:
                cut = truncate(f, rank)
                f, err = cut.factors, cut.rel_error
            if m.transposed:  # ΔW_peft = ΔW_baseᵀ = Rᵀ Lᵀ: B = Rᵀ, A = Lᵀ
                yield m, np.ascontiguousarray(f.b.T), np.ascontiguousarray(f.a.T), err
            else:
                yield m, f.a, f.b, err
    finally:
        for fl in files:
            fl.close()


def adapter_config(xp: ExecutionPlan, modules: list[Module], rank: int | None) -> dict[str, Any]:
    """adapter_config.json: scaling 1 everywhere (lora_alpha = r per module), full module names."""
    ranks = {m.module: m.rank(rank) for m in modules}
    common = max(Counter(ranks.values()).most_common(), key=lambda kv: (kv[1], kv[0]))[0] if ranks else 1
    other = {re.escape(mod): r for mod, r in sorted(ranks.items()) if r != common}
    fifo = any(m.terms[0].factor.fan_in_fan_out for m in modules)
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": xp.base.path,
        "r": common,
        "lora_alpha": common,
        "rank_pattern": other,
        "alpha_pattern": dict(other),
        "target_modules": sorted(ranks),
        "fan_in_fan_out": fifo,
        "use_rslora": False,
        "use_dora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": None,
        "inference_mode": True,
        "task_type": None,
    }


def execute(
    xp: ExecutionPlan,
    out: str | os.PathLike[str],
    *,
    rank: int | None = None,
    dtype: str | None = None,
    force: bool = False,
    expect_hashes: dict[str, str] | None = None,
) -> ExecuteResult:
    """Write the plan's merge as a PEFT adapter folder `out` (see the module docstring), atomically.

    `rank`: cut every module to at most that rank (truncated SVD); None: exact concatenation.
    `dtype`: of the factors (bf16 | fp16 | fp32, default fp32). With `expect_hashes` (a replay)
    a mismatch raises and installs nothing."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise PlanError(f"--rank must be a whole number of at least 1, got {rank!r}")
    out_dt = normalize_dtype(dtype) or "F32"
    adapters, modules = check_plan(xp)  # refusals before any folder is made
    shown = Path(out)
    out = outdir.resolve_out(shown)
    outdir.check_clear_of(out, [xp.base.path, *(e.path for e in xp.experts)], "an input of this plan")
    if not force:
        outdir.check_out(out, force)
    with outdir.output_lock(out):
        outdir.remove_stale(out)
        outdir.check_out(out, force)
        t0, phys0 = time.perf_counter(), physical_read_bytes()
        tmp = outdir.temp_folder(out)
        try:
            tmp.mkdir()
            doc, run = _write(xp, adapters, modules, tmp, rank, out_dt)
            if expect_hashes is not None and doc["tensor_hashes"] != expect_hashes:
                raise MergeDBError(
                    f"the adapter written into {out} differs from the recorded one; nothing was installed (an "
                    "input changed since, or the manifest does not describe these files)"
                )
            run["seconds"] = time.perf_counter() - t0
            run["physical_read_bytes"] = physical_read_bytes() - phys0
            write_json(tmp / MANIFEST, {**doc, "run": run})
            outdir.fsync_dir(tmp)
            outdir.install(tmp, out, force)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise MergeDBError(f"writing {out} failed: {outdir.os_advice(e, out)}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ExecuteResult(
        shown,
        doc,
        run["seconds"],
        run["expert_bytes_logical"],
        run["physical_read_bytes"],
        0,
        run["bytes_written"],
        run["peak_rss_bytes"],
    )


def _write(
    xp: ExecutionPlan, adapters: list[lora.Adapter], modules: list[Module], tmp: Path, rank: int | None, out_dt: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The adapter files in `tmp`; (manifest without run, run record)."""
    entries: list[tuple[str, str, tuple[int, ...]]] = []
    for m in modules:
        (ka, kb), (sa, sb) = m.keys(), m.shapes(rank)
        entries += [(ka, out_dt, sa), (kb, out_dt, sb)]
    cfg = adapter_config(xp, modules, rank)
    write_json(tmp / lora.CONFIG, cfg)
    # tensor_hashes (the manifest's, checked by replay): per base tensor, xxh3-128 of the bytes written
    # for it (A then B; nothing for a tensor no adapter touches); key_hashes: per adapter key (check --output)
    hashes = {t.name: xxhash.xxh3_128_hexdigest(b"") for t in xp.tensors}
    key_hashes: dict[str, str] = {}
    facts: list[dict[str, Any]] = []
    errors: list[float] = []
    read = 0
    with SafetensorsWriter(tmp / lora.SINGLE, entries, PT_METADATA) as w:
        for m, a, b, err in _merge(xp, adapters, modules, rank):
            both = xxhash.xxh3_128()
            for key, x in zip(m.keys(), (a, b)):
                data = np.ascontiguousarray(encode(x, out_dt))
                w.write(key, data)
                key_hashes[key] = xxhash.xxh3_128_hexdigest(data)
                both.update(data)
            hashes[m.tensor] = both.hexdigest()
            read += sum(_term_bytes(xp, m, t) for t in m.terms)
            facts.append({"tensor": m.tensor, "module": m.module, "rank": int(a.shape[0]), "rel_error": err})
            errors.append(err or 0.0)
        written = w.total_size
    pq.write_table(mask_table(xp), tmp / MASK)
    facts_doc = {
        "format": "peft-lora",
        "rank": rank,
        "exact": rank is None,
        "config": cfg,
        "modules": facts,
        "key_hashes": key_hashes,
        "max_rel_error": max(errors, default=0.0),
    }
    doc = build_manifest(xp, out_dt, hashes, {"lora": facts_doc})
    run = {
        "expert_bytes_logical": read,
        "base_bytes": 0,
        "bytes_written": written,
        "peak_rss_bytes": peak_rss(),
        "files": sorted(p.name for p in tmp.iterdir()) + [MANIFEST],
        "file_stats": outdir.file_stats(tmp),  # what --force may replace: the files as written (outdir._edited)
    }
    return doc, run


def _term_bytes(xp: ExecutionPlan, m: Module, t: Term) -> int:
    """Bytes read for one term: its rows factor over the selected blocks, plus R once."""
    rows = sum(xp.tensors[m.tensor_idx].rows[b][1] - xp.tensors[m.tensor_idx].rows[b][0] for b in t.blocks)
    return rows * t.factor.row_bytes() + t.factor.fixed_bytes


def replay(
    manifest_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ExecuteResult:
    """Re-write any mergedb output from its manifest and mask, installing it only if every hash matches:
    an --as-lora adapter here (no progress: its factors are small), a model by executor.replay."""
    xp, doc = plan_from_manifest(manifest_path)
    if "lora" not in doc:
        return replay_model(manifest_path, out, force=force, progress=progress, on_total=on_total)
    lo = doc.get("lora")
    if not isinstance(lo, dict) or "rank" not in lo or not (lo["rank"] is None or isinstance(lo["rank"], int)):
        raise MergeDBError(f"{manifest_path}: the manifest's lora section is missing or malformed")
    return execute(xp, out, rank=lo["rank"], dtype=doc["dtype"], force=force, expect_hashes=doc["tensor_hashes"])
