"""Low-rank algebra of merged adapters: concatenation of factors and truncated SVD without ΔW.

A LoRA adapter's delta on one weight is s·B@A, with B (out, r) and A (r, in) in PEFT's layout.
A linear merge Σ_k c_k·s_k·B_k@A_k is again a product of two factors, by concatenation:

    B' = [c_1·s_1·B_1 | c_2·s_2·B_2 | …]   (out, Σr)        A' = [A_1; A_2; …]   (Σr, in)

so B'@A' is the merged delta exactly (up to float32 rounding of c·s·B), with rank Σ r_k.
`truncate` cuts B'@A' to rank R by its singular value decomposition without forming the
(out, in) matrix: B' = Q_b R_b and A'ᵀ = Q_a R_a (reduced QR), the small core R_b R_aᵀ (Σr, Σr)
= U S Vᵀ, so B'@A' = (Q_b U) S (Q_a V)ᵀ. The best rank-R approximation (Eckart–Young) keeps the
R largest singular values; its relative Frobenius error is sqrt(Σ_{i>R} S_i²) / sqrt(Σ S_i²).
The factors are computed in float64 and split √S to each side (balanced magnitudes, so a bf16
or fp16 output loses no more on one factor than on the other).

The QR and SVD are numpy's LAPACK, run with its OpenBLAS pinned to one thread (`one_blas_thread`):
these matrices are small (Σr columns), threads buy nothing there and cost much on a busy machine
(measured: 1.57 s against 0.10 s per 2816 × 128 module on 2 loaded cores), and one thread keeps
the bytes independent of the machine's core count.

Pure numpy: no files, no catalog (the plan-driven writer is loraout.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Factors:
    """B (out, r) and A (r, in): the delta is B @ A (scaling and coefficients already folded into B)."""

    b: np.ndarray  # (out, r)
    a: np.ndarray  # (r, in)

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class Truncation:
    """A rank-R cut of B'@A': the factors, and what was cut."""

    factors: Factors
    rel_error: float  # ‖B'A' − B_R A_R‖_F / ‖B'A'‖_F (0 when B'A' = 0)


def concat(bs: Sequence[np.ndarray], as_: Sequence[np.ndarray], scales: Sequence[float]) -> Factors:
    """B' = [scale_1·B_1 | …], A' = [A_1; …] in float32: the exact factors of Σ scale_k·B_k@A_k.

    `scales` are c_k·s_k (merge coefficient times the adapter's own scaling); each element of
    scale·B is computed in float64 and rounded once to float32."""
    if not bs:
        raise ValueError("concat needs at least one factor pair")
    b = np.concatenate([(float(c) * np.asarray(x, np.float64)).astype(np.float32) for x, c in zip(bs, scales)], axis=1)
    a = np.concatenate([np.asarray(x, np.float32) for x in as_], axis=0)
    return Factors(b, a)  # (out, Σr), (Σr, in)


def truncate(f: Factors, rank: int) -> Truncation:
    """The best rank-`rank` approximation of f.b @ f.a, from the factors alone (float64 inside,
    float32 out). The result has rank min(rank, Σr, out, in) columns; trailing singular values
    that are exactly 0 are kept as zero columns only if `rank` asks for them."""
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    b = np.asarray(f.b, np.float64)  # (out, r)
    a = np.asarray(f.a, np.float64)  # (r, in)
    with one_blas_thread():
        qb, rb = np.linalg.qr(b)  # (out, k1), (k1, r)
        qa, ra = np.linalg.qr(a.T)  # (in, k2), (k2, r)
        u, s, vt = np.linalg.svd(rb @ ra.T)  # core (k1, k2) = U S Vᵀ
        keep = min(rank, s.size)
        root = np.sqrt(s[:keep])
        b_r = (qb @ u[:, :keep]) * root  # (out, keep)
        a_r = (root[:, None] * vt[:keep]) @ qa.T  # (keep, in)
    total = float(np.sqrt(np.sum(s * s)))
    cut = float(np.sqrt(np.sum(s[keep:] * s[keep:])))
    rel = cut / total if total > 0 else 0.0
    return Truncation(Factors(b_r.astype(np.float32), a_r.astype(np.float32)), rel)


# OpenBLAS's thread-count entry points under the names numpy's builds export them
_SET = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
_GET = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")


def _openblas() -> list[tuple[Any, Any]]:
    """(set, get) thread-count functions of every OpenBLAS loaded in this process (Linux: read from
    /proc/self/maps); empty where there is none or it cannot be found (the work then runs as is)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({ln.split()[-1] for ln in maps if "openblas" in ln.lower() and ln.split()[-1][:1] == "/"})
    except OSError:
        return []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        set_ = next((getattr(lib, n) for n in _SET if hasattr(lib, n)), None)
        get_ = next((getattr(lib, n) for n in _GET if hasattr(lib, n)), None)
        if set_ is not None and get_ is not None:
            found.append((set_, get_))
    return found


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the body with numpy's OpenBLAS on one thread, restoring its count after."""
    libs = _openblas()
    before = [get_() for _, get_ in libs]
    for set_, _ in libs:
        set_(1)
    try:
        yield
    finally:
        for (set_, _), n in zip(libs, before):
            set_(n)
