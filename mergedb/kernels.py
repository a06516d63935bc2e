"""Merge operators: pure tensor math on float32 numpy arrays (compiled with numba).

Every operator sees an expert's delta block by block (rows [r0, r1) of a tensor, flattened
element offset `offset`) and folds it into per-block running sums, so memory does not grow with
the number of experts. Omitted blocks contribute nothing; coefficients never change. The order of
operations is fixed (experts in plan order, float32), so results repeat bit for bit.

Random draws (DARE, DELLA) are counter-based: draw i of stream `key` is splitmix64(key + i)
mapped to [0, 1) by its top 53 bits, so a block's draws equal the whole tensor's at its offset.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from .methods import Method


@numba.njit(nogil=True, cache=True, inline="always")
def _splitmix_unit(key, i):  # pragma: no cover - compiled
    # draw i of stream `key`: splitmix64's finaliser of key + i, top 53 bits as a float64 in [0, 1)
    z = (key + np.uint64(i)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(nogil=True, cache=True)
def _uniform(key, offset, n):  # pragma: no cover - compiled
    out = np.empty(n, np.float64)
    for i in range(n):
        out[i] = _splitmix_unit(key, offset + i)
    return out


@numba.njit(nogil=True, cache=True)
def _drop_random(d, key, offset, p):  # pragma: no cover - compiled
    # DARE in place: keep d[i] / p where u_i < p, else 0
    p32 = np.float32(p)
    for i in range(d.shape[0]):
        u = _splitmix_unit(key, offset + i)
        d[i] = d[i] / p32 if u < p else np.float32(0.0)


@numba.njit(nogil=True, cache=True)
def _keep_band(d, lo, hi):  # pragma: no cover - compiled
    # magnitude / band trim in place: keep lo ≤ |d| < hi
    lo32, hi32 = np.float32(lo), np.float32(hi)
    for i in range(d.shape[0]):
        a = abs(d[i])
        if not (a >= lo32 and a < hi32):
            d[i] = np.float32(0.0)


@numba.njit(nogil=True, cache=True)
def _add_scaled(total, d, c):  # pragma: no cover - compiled
    c32 = np.float32(c)
    for i in range(d.shape[0]):
        total[i] += c32 * d[i]


@numba.njit(nogil=True, cache=True)
def _add_consensus(total, pos, neg, pos_w, neg_w, d, w):  # pragma: no cover - compiled
    w32 = np.float32(w)
    for i in range(d.shape[0]):
        x = d[i]
        wd = w32 * x
        total[i] += wd
        if x > 0:
            pos[i] += wd
            pos_w[i] += w32
        elif x < 0:
            neg[i] += wd
            neg_w[i] += w32


def uniform(key: int, offset: int, n: int) -> np.ndarray:
    """Uniform [0, 1) draws for elements offset … offset+n−1 of the stream `key` (float64)."""
    return _uniform(np.uint64(key), offset, n)


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
    rank: Any = None  # della: callable |Δ| -> rank fraction in [0, 1] (0 = smallest)


def sparsify(m: Method, params: dict[str, Any], delta: np.ndarray, offset: int, trim: Trim) -> np.ndarray:
    """Δ' for one block of one expert: (n,) float32, sparsified in place where possible."""
    if m.sparsify == "none":
        return delta
    if m.sparsify in ("magnitude", "band"):  # in place
        _keep_band(delta, trim.t_lo, np.inf if trim.t_hi is None else trim.t_hi)
        return delta
    if m.sparsify == "random":  # in place
        _drop_random(delta, np.uint64(trim.key), offset, float(params["density"]))
        return delta
    a = np.abs(delta)
    u = uniform(trim.key, offset, delta.size).reshape(delta.shape)
    # della: keep probability rises linearly with magnitude rank from density−ε to density+ε
    p = (params["density"] - params["epsilon"] + 2 * params["epsilon"] * trim.rank(a)).astype(np.float32)
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
            _add_scaled(self.total, d, coef)
            return
        _add_consensus(self.total, self.pos, self.neg, self.pos_w, self.neg_w, d, weight)

    def merged_delta(self) -> np.ndarray:
        """The merged update added to the base (float32)."""
        if not self.m.consensus:
            return self.total
        up = self.total >= 0  # elected sign, +1 on zero (mergekit)
        num = np.where(up, self.pos, self.neg)
        if self.params.get("normalize", True):
            den = np.where(up, self.pos_w, self.neg_w)
            den = np.where(np.abs(den) < 1e-8, np.float32(1), den)
            num = num / den
        return np.float32(self.params.get("lambda", 1.0)) * num
