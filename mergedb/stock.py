"""model_stock's scale t = K·cos / (1 + (K−1)·cos) per tensor, from the task vectors' pairwise dots.

A tensor's block units run on any threads; each hands in its block's exact dots, and the unit that
completes the tensor sums them in block order (so t never depends on which thread ran what).
"""

from __future__ import annotations

import threading

import numpy as np

from . import kernels
from .errors import MergeDBError
from .manifest import ExecutionPlan
from .tensorfile import tensor_nbytes


class StockDots:
    """model_stock's per-tensor t from the mean pairwise cosine of the task vectors.

    ⟨Δ_j, Δ_k⟩ is exact over blocks where both were read and estimated from the catalog's
    sketches elsewhere; ‖Δ_k‖² is exact (from the catalog).
    """

    def __init__(self, xp: ExecutionPlan, ti: int) -> None:
        self.name = xp.tensors[ti].name
        self.k = len(xp.experts)
        self.dots = np.zeros((self.k, self.k))
        self.norm2 = np.zeros(self.k)
        if xp.stock is not None:  # numpy, not pyarrow.compute: its import alone costs ~0.2 s per process
            mine = xp.stock.column("tensor_idx").to_numpy() == ti
            cols = [xp.stock.column(c).to_numpy()[mine] for c in ("j", "k", "dot")]
            for j, k, dot in zip(*(c.tolist() for c in cols)):
                if j == k:
                    self.norm2[j] = dot
                else:
                    self.dots[j, k] += dot

    def add_block(self, deltas: list[tuple[int, np.ndarray]]) -> None:
        for a in range(len(deltas)):
            for b in range(a + 1, len(deltas)):
                (j, dj), (k, dk) = deltas[a], deltas[b]
                self.dots[min(j, k), max(j, k)] += kernels.dot64(dj, dk)

    def add_dots(self, positions: list[int], dots: np.ndarray) -> None:
        """A block's pairwise dots (g, g), upper triangle, of the experts at `positions`."""
        for a in range(len(positions)):
            for b in range(a + 1, len(positions)):
                j, k = positions[a], positions[b]
                self.dots[min(j, k), max(j, k)] += dots[a, b]

    def t(self) -> float:
        if not (np.isfinite(self.norm2).all() and np.isfinite(self.dots).all()):  # never a silent cosine of 0
            raise MergeDBError(
                f"model_stock: tensor {self.name}: the task vectors' norms or dots are not finite, so its t "
                "cannot be computed; this is a bug in mergedb: please report it with the plan"
            )
        cos = []
        for j in range(self.k):
            for k in range(j + 1, self.k):
                den = np.sqrt(self.norm2[j] * self.norm2[k])
                cos.append(self.dots[j, k] / den if den > 0 else 0.0)
        c = float(np.mean(cos)) if cos else 0.0
        return self.k * c / (1 + (self.k - 1) * c) if 1 + (self.k - 1) * c != 0 else 0.0


class StockTensor:
    """model_stock's state of one tensor while its block units run on any threads: the merged
    Σ c_k Δ_k of its blocks (float32, whole tensor) and each block's exact pairwise dots. The unit
    that finishes last sums the dots in block order (so t does not depend on which thread ran what)
    and writes every block."""

    def __init__(self, xp: ExecutionPlan, ti: int, blocks: list[int]) -> None:
        self.xp, self.ti = xp, ti
        self.blocks = blocks  # the tensor's blocks that units merge, ascending
        t = xp.tensors[ti]
        self.update = np.empty(tensor_nbytes("F32", t.shape) // 4, np.float32)  # (n,) float32
        self.block_dots: dict[int, tuple[list[int], np.ndarray]] = {}
        self.lock = threading.Lock()

    def done(self, b: int, positions: list[int], dots: np.ndarray) -> bool:
        """Record block b's dots; True for the caller that completed the tensor."""
        with self.lock:
            self.block_dots[b] = (positions, dots)
            return len(self.block_dots) == len(self.blocks)

    def t(self) -> float:
        stock = StockDots(self.xp, self.ti)
        for b in self.blocks:
            stock.add_dots(*self.block_dots[b])
        return stock.t()
