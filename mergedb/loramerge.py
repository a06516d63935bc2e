"""LoRA adapters in a merge: their blocks formed from the factors and folded in as float32 deltas.

A block that some adapter of the plan contributes to is merged on the "wide" path: the base block
is decoded to float32, each dense expert's block is read and decoded to float32, each adapter's
block is e = float32(θ₀ + s · L[rows] @ R) (lorascan.block_values, the values registration took
its statistics from), and the same fused kernels fold e − θ₀ with the float32 kind. A dense
expert's float32 delta is the same on both paths (decoding is exact), so mixing changes nothing
for it; blocks without an adapter take the merger's usual path.

Reads: an adapter block reads its rows of L (or its replacement rows) and, once per (expert,
tensor) per run, R, kept while the tensor's selected blocks of that expert are pending and dropped
after the last one; exactly the bytes the plan charged (planner: candidates.charge_fixed).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from . import kernels
from .checkpoint import open_checkpoint, refuse_changed
from .errors import ChangedFileError
from .lora import Adapter, is_adapter, open_adapter
from .loraread import AdapterFiles, fixed_from_raw
from .lorascan import block_hash, block_values
from .manifest import ExecutionPlan

if TYPE_CHECKING:
    from .merger import Merger


class LoraInputs:
    """The plan's adapters, opened and checked against their fingerprints (`close` when done);
    forms their blocks (`values`), caching each (expert, tensor)'s R while its blocks are pending."""

    def __init__(self, xp: ExecutionPlan) -> None:
        self.xp = xp
        self.adapters: dict[int, tuple[Adapter, AdapterFiles]] = {}
        self.lock = threading.Lock()
        self.fixed: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, threading.Lock]] = {}
        self.left: dict[tuple[int, int], int] = {}
        positions = [p for p, src in enumerate(xp.experts) if is_adapter(src.path)]
        if not positions:
            return
        base = open_checkpoint(xp.base.path, name=xp.base.name)
        try:
            for pos in positions:
                src = xp.experts[pos]
                ad = open_adapter(src.path, base, src.name)
                refuse_changed(src, ad.fingerprint)
                self.adapters[pos] = (ad, AdapterFiles(ad))
        except BaseException:
            self.close()
            raise
        for ti, blocks in xp.selected().items():
            for work in blocks.values():
                for pos, _ in work:
                    if pos in self.adapters:
                        self.left[(pos, ti)] = self.left.get((pos, ti), 0) + 1

    @property
    def positions(self) -> frozenset[int]:
        return frozenset(self.adapters)

    def close(self) -> None:
        for _, files in self.adapters.values():
            files.close()

    def values(self, pos: int, ti: int, b: int, b32: np.ndarray, out: np.ndarray, h: str, verify: bool) -> int:
        """Adapter `pos`'s float32 values of block `b` of tensor `ti` into `out` (n,), given the base
        block decoded to float32 `b32`; returns the bytes read (R counted on its first use only)."""
        ad, files = self.adapters[pos]
        t = self.xp.tensors[ti]
        r0, r1 = t.rows[b]
        read = 0
        right = fixed_raw = None
        if t.name in ad.factors:
            right, fixed_raw, read = self._fixed(pos, ti, ad, files)
        e32, rows_raw = block_values(ad, files, t.name, t.shape, r0, r1, b32, right, out)
        if verify and block_hash(rows_raw, fixed_raw) != h:
            raise ChangedFileError(
                f"{ad.root}: block {b} of {t.name!r} does not match its registered hash; the adapter changed "
                "since registration: re-register it with --refresh and plan again"
            )
        with self.lock:
            self.left[(pos, ti)] -= 1
            if self.left[(pos, ti)] == 0:
                self.fixed.pop((pos, ti), None)  # the tensor's last block of this adapter: R is freed
        return read + rows_raw.nbytes

    def _fixed(self, pos: int, ti: int, ad: Adapter, files: AdapterFiles) -> tuple[np.ndarray, np.ndarray, int]:
        """R of (adapter, tensor) (rank, cols) float32 and its raw bytes, read on first use."""
        with self.lock:
            entry = self.fixed.get((pos, ti))
            if entry is None:
                entry = self.fixed[(pos, ti)] = (np.empty(0, np.float32), np.empty(0, np.uint8), threading.Lock())
        _, _, lock = entry
        with lock:  # one block reads R while the tensor's other blocks of this adapter wait for it
            cur = self.fixed[(pos, ti)]
            if cur[0].size:
                return cur[0], cur[1], 0
            f = ad.factors[self.xp.tensors[ti].name]
            info = f.fixed_factor[1]
            raw = files.read(f.fixed_factor, 0, info.nbytes, np.empty(info.nbytes, np.uint8))
            right = fixed_from_raw(f, raw)
            with self.lock:
                self.fixed[(pos, ti)] = (right, raw, lock)
            return right, raw, info.nbytes


def wide_inputs(m: Merger, ti: int, b: int, base: np.ndarray, kind: int) -> tuple[np.ndarray, list]:
    """The base block `base` (n,) raw bits decoded to float32 bits (n,) uint32, and the block's work."""
    b32 = np.empty(base.shape[0], np.uint32)
    kernels.decode_bits(base, kind, b32)
    return b32, m.sel.get(ti, {}).get(b, [])


def expert_values(m: Merger, ti: int, b: int, pos: int, h: str, b32: np.ndarray, kind: int, out: np.ndarray) -> None:
    """Expert `pos`'s float32 bits of block `b` into `out` (n,) uint32: an adapter's formed values,
    or a dense expert's bytes decoded."""
    lora = m.lora
    if lora is not None and pos in lora.adapters:
        n = lora.values(pos, ti, b, b32.view(np.float32), out.view(np.float32), h, m.verify)
        with m._lock:
            m.count.expert += n
        return
    nb = b32.shape[0] * (2 if kind < 2 else 4)
    raw = m._read_one(ti, b, pos, h, m.local.get("wide_raw", nb, np.uint8))
    kernels.decode_bits(raw.view(np.uint16 if kind < 2 else np.uint32), kind, out)


def fused_block(m: Merger, ti: int, b: int, base_raw: np.ndarray, out: np.ndarray) -> None:
    """Merger._fused_block for a block with an adapter: experts one at a time (plan order), each
    folded as float32 (kind F32) against the decoded base."""
    t = m.xp.tensors[ti]
    kind = kernels.IN_KIND[t.dtype]
    lo, n, _, base = m._block(ti, b, base_raw)
    b32, work = wide_inputs(m, ti, b, base, kind)
    acc = m.local.get("acc", (5 if m.method.consensus else 1) * n, np.float32).reshape(-1, n)  # (1 or 5, n)
    acc.fill(0)
    ex = m.local.get("wide_ex", n, np.uint32).reshape(1, n)  # (1, n) float32 bits of one expert
    mode = kernels.MODE[m.method.sparsify]
    f32 = kernels.IN_KIND["F32"]
    for pos, h in work:
        expert_values(m, ti, b, pos, h, b32, kind, ex[0])
        v = m._values(pos, ti)
        tr = m._trim(pos, ti, t, m.xp.experts[pos])
        coef = np.array([v.weight if m.method.consensus else v.coef], np.float32)
        t_hi = np.array([np.inf if tr.t_hi is None else tr.t_hi], np.float64)
        ranks = tr.rank[None, :] if mode == kernels.MODE["della"] else kernels.NO_RANKS
        kernels.fold_group(
            b32, ex, f32, mode, lo, coef, np.array([tr.t_lo], np.float64), t_hi,
            np.array([tr.key], np.uint64), v.density, v.epsilon or 0.0, ranks, acc,
        )  # fmt: skip
    m._finish(ti, b, base_raw, acc, out)


def stock_inputs(m: Merger, ti: int, b: int, base: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, int]:
    """model_stock's block with an adapter: (base float32 bits (n,), every expert's float32 bits
    (g, n), the F32 kind) for kernels.stock_fold."""
    b32, work = wide_inputs(m, ti, b, base, kind)
    ex = np.empty((len(work), base.shape[0]), np.uint32)  # (g, n): every expert of the block at once
    for k, (pos, h) in enumerate(work):
        expert_values(m, ti, b, pos, h, b32, kind, ex[k])
    return b32, ex, kernels.IN_KIND["F32"]


def slow_delta(m: Merger, ti: int, b: int, pos: int, h: str, base: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The per-step path's Δ (n,) float32 of adapter `pos` in block `b`: its formed values − base."""
    n = m.lora.values(pos, ti, b, base, out, h, m.verify)  # type: ignore[union-attr]
    with m._lock:
        m.count.expert += n
    np.subtract(out, base, out=out)
    return out
