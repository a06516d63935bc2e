"""Values into a file's element encoding: float32 → bfloat16 bits (round to nearest even, NaN stays
NaN) and `encode` for every float dtype of tensorfile.DTYPES. The rounding kernel is compiled with
numba on first use, so modules that only read headers (the planner among them) never load numba."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .tensorfile import DTYPES


def _bf16_round(bits, out):  # pragma: no cover - compiled by _bf16_kernel
    for i in range(bits.shape[0]):
        b = bits[i]
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[i] = np.uint16(0x7FC0)  # NaN stays NaN
        else:
            out[i] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@functools.cache
def _bf16_kernel() -> Any:
    """_bf16_round compiled on first use: numba is loaded by what writes bf16, never by `mergedb plan`."""
    from .jitload import numba  # imported with Ctrl-C held

    return numba.njit(nogil=True, cache=True)(_bf16_round)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 bits (uint16), round-to-nearest-even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
    out = np.empty(bits.size, np.uint16)
    _bf16_kernel()(bits, out)
    return out.reshape(np.shape(x))


def encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32/float64 array -> array whose bytes are `dtype`'s on-disk representation."""
    if dtype == "BF16":
        return float32_to_bf16(np.asarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=DTYPES[dtype][1])
