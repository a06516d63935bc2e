"""numpy arrays as Arrow arrays without `pa.array`.

`pa.array(ndarray)` checks whether the array is a masked one, which imports numpy.ma (~9 ms) on the
first call of a process: a cost the first plan of a `mergedb plan` process would pay. These build
the Arrow array from the numpy buffers instead: fixed-width values zero-copy, booleans bit-packed.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def column(a: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A 1-D numpy array (fixed-width or bool) as an Arrow array; NULL where `valid` (bool, the same
    length) is false, none without it."""
    bits = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    if a.dtype == np.bool_:
        return pa.Array.from_buffers(pa.bool_(), a.size, [bits, pa.py_buffer(np.packbits(a, bitorder="little"))])
    a = np.ascontiguousarray(a)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [bits, pa.py_buffer(a)])
