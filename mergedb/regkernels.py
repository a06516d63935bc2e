"""Registration's compiled kernels: deltapass.c's (native.py: loads in ~1 ms) where a C compiler built
them, else numba's (deltapass.py: ~0.2 s to import and load per process). Both give the same bits;
kernels.py chooses for the merge the same way, and MERGEDB_KERNELS=numba chooses numba for both.

Measured (benchmarks/bench_kernels.py, results/kernels-s27.json): the C statistics pass takes 0.55-0.6
of numba's time, because it takes 64 elements at a time (one vectorised pass, then the scattered
counts), and a registering process no longer imports numba at all.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def impl() -> Any:
    """The kernels this process runs: the C ones (native.Kernels, the library kernels.py loads too) or
    numba's (deltapass)."""
    from . import native

    got = native.load()
    if got is None:
        from . import deltapass as got  # type: ignore[no-redef]
    return got


def backend() -> str:
    """Which kernels this process runs: "native" (C) or "numba" (chosen now if not yet)."""
    return "numba" if isinstance(impl(), ModuleType) else "native"


def group_pass(e_raw, b_raw, e, b, raw_start, start, abs_bits, codes, summary, exc, n_exc,
               edge, edge_sq, hist_shift, summary_shift, out) -> int:  # type: ignore[no-untyped-def]  # fmt: skip
    """The statistics of consecutive blocks of one tensor (deltapass._group_pass says what each is)."""
    got = impl().group_pass(
        e_raw, b_raw, e, b, raw_start, start, abs_bits, codes, summary, exc, n_exc,
        edge, edge_sq, hist_shift, summary_shift, out,
    )  # fmt: skip
    return int(got)


def base_group(x: np.ndarray, start: np.ndarray, ss: np.ndarray, bad: np.ndarray) -> None:
    """Per block k (elements start[k]:start[k + 1] of bf16 or float32 patterns x): Σ x² over its finite
    values into ss[k], its NaN/Inf count into bad[k]."""
    impl().base_group(x, start, ss, bad)


def bucket_codes(key: np.uint64, dim: int, out: np.ndarray) -> None:
    """out[i] = 2·bucket + (sign < 0) of element i under `key` (stats.sketch_codes)."""
    impl().bucket_codes(np.uint64(key), dim, out)


def sub_histogram(abs_bits: np.ndarray, slot_of: np.ndarray, sub: np.ndarray) -> None:
    """sub[slot_of[bits >> 17], (bits >> 9) & 255] += 1 for every pattern (stats.grid_thresholds)."""
    impl().sub_histogram(abs_bits, slot_of, sub)


def low_histogram(abs_bits: np.ndarray, slot_of: np.ndarray, pair_of: np.ndarray, low: np.ndarray) -> None:
    """low[pair_of[slot_of[bits >> 17], (bits >> 9) & 255], bits & 511] += 1 for every pattern."""
    impl().low_histogram(abs_bits, slot_of, pair_of, low)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two equal-length uint8 buffers hold the same bytes."""
    return bool(impl().same_bytes(a, b))
