"""Merge operators: pure tensor math on float32 numpy arrays, and the fused block kernels' entry points.

Every operator sees an expert's delta block by block (rows [r0, r1) of a tensor, flattened
element offset `offset`) and folds it into per-block running sums, so memory does not grow with
the number of experts. Omitted blocks contribute nothing; coefficients never change. The order of
operations is fixed (experts in plan order, float32), so results repeat bit for bit.

The fused kernels (fold_group, finish, stock_fold, fold_many, finish_many, dot64, decode_bits)
run compiled C (native.py: loads in ~1 ms) where a C compiler built it, else numba (jitkernels.py:
~0.2 s to import and load per process); both give the same bits. The per-step path (`sparsify`,
`Accumulator`: the fused kernels' oracle in tests, and the path of methods the kernels lack)
always runs numba's pieces.

Random draws (DARE, DELLA) are counter-based: draw i of stream `key` is word 0 of Threefry-2x32
with 20 rounds (Random123), keyed by the 64-bit `key` with the 64-bit element index i as counter,
divided by 2^32; so a block's draws equal the whole tensor's at its offset, whatever the threads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .methods import Method

CHUNK = 16384  # elements per cache-resident chunk (jitkernels.py, native.c)
IN_KIND = {"BF16": 0, "F16": 1, "F32": 2}  # raw element bits: uint16, uint16, uint32
MODE = {"none": 0, "magnitude": 1, "band": 1, "random": 2, "della": 3}  # sparsify modes the fused path handles
NO_RANKS = np.zeros((0, 1 << 15))  # `fold_group`'s rank tables when the mode is not DELLA


def _jit() -> ModuleType:
    """jitkernels.py (imports numba: ~0.15 s on first use)."""
    from . import jitkernels

    return jitkernels


def impl() -> Any:
    """The fused kernels this process runs: the C ones (native.Kernels, loaded once and kept by
    native.load) or numba's (jitkernels)."""
    from . import native

    return native.load() or _jit()


def backend() -> str:
    """Which fused kernels this process runs: "native" (C) or "numba" (chosen now if not yet)."""
    return "numba" if isinstance(impl(), ModuleType) else "native"


def reset() -> None:
    """Choose the kernels again on the next call (tests switch MERGEDB_KERNELS in one process); the
    registration kernels (regkernels.py) follow the same choice."""
    from . import native

    native.reset()


def uniform(key: int, offset: int, n: int) -> np.ndarray:
    """Uniform [0, 1) draws for elements offset … offset+n−1 of the stream `key` (float64)."""
    return impl().uniform(key, offset, n)


def rank_table(codes: list[int], counts: list[int]) -> np.ndarray:
    """DELLA's magnitude rank from a tensor's magnitude summary, indexed by the float32 bits of |Δ|
    shifted right by 17 (2^-6-wide bins): the fraction of elements in lower bins plus half of the
    element's own bin (see README, "DELLA"). (32768,) float64."""
    below = np.zeros(1 << 15)
    np.add.at(below, np.asarray(codes, np.int64), np.asarray(counts, np.float64))
    return (np.cumsum(below) - below / 2) / max(1.0, below.sum())


def rng_key(seed: int, expert: str, tensor: str) -> int:
    """The DARE/DELLA stream key of (seed, expert name, tensor name): independent of the block layout."""
    d = hashlib.sha256(f"mergedb-drop\0{seed}\0{expert}\0{tensor}".encode()).digest()
    return int.from_bytes(d[:8], "little")


@dataclass(frozen=True)
class Trim:
    """What `sparsify` needs for one (expert, tensor)."""

    t_lo: float = 0.0  # magnitude / band: keep |Δ| ≥ t_lo
    t_hi: float | None = None  # band: and |Δ| < t_hi
    key: int = 0  # random / della: stream key
    rank: Any = None  # della: (32768,) float64 rank fraction of |Δ| by its bits >> 17 (rank_table)


def sparsify(m: Method, params: dict[str, Any], delta: np.ndarray, offset: int, trim: Trim) -> np.ndarray:
    """Δ' for one block of one expert: (n,) float32, sparsified in place where possible."""
    if m.sparsify == "none":
        return delta
    if m.sparsify in ("magnitude", "band"):  # in place
        _jit()._keep_band(delta, trim.t_lo, np.inf if trim.t_hi is None else trim.t_hi)
        return delta
    if m.sparsify == "random":  # in place: keep Δ / p where the draw is below p
        u = uniform(trim.key, offset, delta.size)  # (n,) float64
        p = float(params["density"])
        np.divide(delta, np.float32(p), out=delta)
        delta[u >= p] = 0
        return delta
    a = np.abs(delta)
    u = uniform(trim.key, offset, delta.size).reshape(delta.shape)
    # della: keep probability rises linearly with magnitude rank from density−ε to density+ε
    rank = trim.rank[np.asarray(a, np.float32).view(np.uint32) >> 17]  # (n,) float64
    p = (params["density"] - params["epsilon"] + 2 * params["epsilon"] * rank).astype(np.float32)
    return np.where(u < p, delta / p, np.float32(0)).astype(np.float32)


class Accumulator:
    """Running sums of one tensor's merge: plain weighted sums, or TIES-style sign consensus."""

    def __init__(self, m: Method, params: dict[str, Any], n: int) -> None:
        self.m, self.params = m, params
        self.total = np.zeros(n, np.float32)  # Σ c_k Δ'_k (additive) / Σ w_k Δ'_k (consensus)
        if m.consensus:
            self.pos = np.zeros(n, np.float32)
            self.neg = np.zeros(n, np.float32)
            self.pos_w = np.zeros(n, np.float32)
            self.neg_w = np.zeros(n, np.float32)

    def add(self, coef: float, weight: float, d: np.ndarray) -> None:
        """Fold one expert's Δ'_k (n,) float32 into the sums: coef for additive, weight for consensus."""
        if not self.m.consensus:
            _jit()._add_scaled(self.total, d, coef)
            return
        _jit()._add_consensus(d, np.float32(weight), self.total, self.pos, self.neg, self.pos_w, self.neg_w)

    def merged_delta(self) -> np.ndarray:
        """The merged update added to the base (float32)."""
        if not self.m.consensus:
            return self.total
        up = self.total >= 0  # elected sign, +1 on zero (mergekit)
        num = np.where(up, self.pos, self.neg)
        if self.params.get("normalize", True):
            den = np.where(up, self.pos_w, self.neg_w)
            den = np.where(den == 0, np.float32(1), den)  # mergekit's: only a zero divisor is 1
            num = num / den
        return np.float32(self.params.get("lambda", 1.0)) * num


# -- fused block kernels (jitkernels.py documents them; native.c computes the same bits) -------------


def fold_group(base, ex, kind, mode, offset, coefs, lo, hi, keys, p, eps, ranks, acc) -> None:  # noqa: ANN001
    """Fold experts ex[0..g) (each (n,) raw bits of one block) into the sums `acc` (jitkernels.fold_group)."""
    impl().fold_group(base, ex, kind, mode, offset, coefs, lo, hi, keys, p, eps, ranks, acc)


def finish(base, kind, acc, normalize, lam, res, bf16, scale=1.0) -> None:  # noqa: ANN001
    """scale·base + merged update from `fold_group`'s sums, into `res` or as bf16 bits (jitkernels.finish)."""
    impl().finish(base, kind, acc, normalize, lam, res, bf16, scale)


def stock_fold(base, ex, kind, coefs, acc, dots) -> None:  # noqa: ANN001
    """model_stock's block: Σ c_k Δ_k into `acc` and the pairwise dots (jitkernels.stock_fold)."""
    impl().stock_fold(base, ex, kind, coefs, acc, dots)


def fold_many(base, ex, kind, coefs, lo, hi, acc) -> None:  # noqa: ANN001
    """Fold experts into several TIES-style trims' sums at once (jitkernels.fold_many)."""
    impl().fold_many(base, ex, kind, coefs, lo, hi, acc)


def finish_many(base, kind, acc, group, normalize, lam, scale, res, bf16, stride, at) -> None:  # noqa: ANN001
    """`finish` for several plans of one fold set, the base decoded once (jitkernels.finish_many)."""
    impl().finish_many(base, kind, acc, group, normalize, lam, scale, res, bf16, stride, at)


def dot64(a: np.ndarray, b: np.ndarray) -> float:
    """⟨a, b⟩ of two (n,) float32 arrays in float64, in the fixed order `stock_fold` uses."""
    return impl().dot64(a, b)


def decode_bits(raw: np.ndarray, kind: int, out: np.ndarray) -> None:
    """Raw element bits (uint16 or uint32) of dtype `kind` -> float32 bits in `out` (uint32)."""
    impl().decode_bits(raw, kind, out)


def warm(bits: Any, stock: bool = False) -> None:
    """Load (or build, or compile) the fused kernels for raw element bits of dtype `bits` (np.uint16
    or np.uint32) with tiny arrays of the argument types the merger passes. The merger runs this on a
    compute thread while the I/O threads read the first inputs: numba's first call of a cached kernel
    costs ~0.07-0.2 s of CPU, the C kernels' first load ~1 ms (a first build on a machine ~1 s)."""
    base, ex = np.zeros(8, bits), np.zeros((1, 8), bits)
    acc, one, zeros = np.zeros((1, 8), np.float32), np.ones(1, np.float32), np.zeros(1)
    if stock:
        stock_fold(base, ex, 0, one, acc, np.zeros((1, 1)))
    else:
        fold_group(base, ex, 0, 0, 0, one, zeros, zeros, np.zeros(1, np.uint64), 1.0, 0.0, NO_RANKS, acc)
    finish(base, 0, acc, True, 1.0, np.empty(0, np.float32), np.empty(8, np.uint16))
