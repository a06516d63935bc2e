"""numpy arrays as Arrow arrays without `pa.array`.

`pa.array(ndarray)` checks whether the array is a masked one, which imports numpy.ma (~9 ms) on the
first call of a process: a cost the first plan of a `mergedb plan` process would pay. These build
the Arrow array from the numpy buffers instead: fixed-width values zero-copy, booleans bit-packed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _bits(a: np.ndarray) -> pa.Buffer:
    return pa.py_buffer(np.packbits(a, bitorder="little"))


def column(a: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A 1-D numpy array as an Arrow array; `valid` (bool, same length): False rows are null."""
    validity = None if valid is None else _bits(np.asarray(valid, bool))
    if a.dtype == np.bool_:
        return pa.Array.from_buffers(pa.bool_(), a.size, [validity, _bits(a)])
    a = np.ascontiguousarray(a)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [validity, pa.py_buffer(a)])
