"""The merge kernels' C wrappers refuse every argument on which C would touch memory outside an array,
misread one, or get a number ctypes would truncate (kernelargs.py).

Each case takes a call the wrapper accepts (run first, so a check too strict for real callers fails
here too) and changes one argument. The cases are those a differential fuzz against numba found
passing the earlier checks (2026-12-03): C then read or wrote past the array under AddressSanitizer,
or computed other bits than numba, or numba refused the argument where C did not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from mergedb import kernels, native

C = native.load()
pytestmark = pytest.mark.skipif(C is None, reason=f"no C kernels here: {native.why_not()}")
N, G, SETS = 8, 2, 3


def _odd(n: int, dtype: Any) -> np.ndarray:
    """(n,) elements of `dtype` starting one byte past an aligned address."""
    return np.frombuffer(bytearray(n * np.dtype(dtype).itemsize + 1), dtype, n, offset=1)


def _uneven_rows() -> np.ndarray:
    """(G, N) uint16 whose rows are 129 bytes apart: not a whole number of elements."""
    return np.ndarray((G, N), np.uint16, buffer=bytearray(129 * G + 2 * N), strides=(129, 2))


def _good() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    if C is None:
        return {}
    base, ex = np.arange(N, dtype=np.uint16), np.arange(G * N, dtype=np.uint16).reshape(G, N)
    f32, f64, sums = np.ones(G, np.float32), np.zeros(G), np.ones((1, N), np.float32)
    fold = dict(base=base, ex=ex, kind=0, mode=0, offset=0, coefs=f32, lo=f64, hi=f64 + np.inf)
    fold |= dict(keys=np.arange(G, dtype=np.uint64), p=1.0, eps=0.0, ranks=kernels.NO_RANKS, acc=sums * 0)
    della = fold | dict(mode=3, p=0.5, eps=0.1, ranks=np.full((G, 1 << 15), 0.5), acc=np.zeros((5, N), np.float32))
    finish = dict(base=base, kind=0, acc=sums, normalize=True, lam=1.0)
    to_f32 = finish | dict(res=np.zeros(N, np.float32), bf16=np.empty(0, np.uint16))
    to_bf16 = finish | dict(res=np.empty(0, np.float32), bf16=np.zeros(N, np.uint16))
    bands = dict(coefs=np.ones((SETS, G), np.float32), lo=np.zeros((SETS, G)), hi=np.full((SETS, G), np.inf))
    many = dict(base=base, ex=ex, kind=0, acc=np.zeros((SETS, 5, N), np.float32)) | bands
    plans = dict(base=base, kind=0, acc=np.ones((SETS, 5, N), np.float32), group=np.array([0, 2]))
    plans |= dict(normalize=np.array([True, False]), lam=np.ones(2), scale=1.0, res=np.zeros(2 * N, np.float32))
    plans |= dict(bf16=np.empty(0, np.uint16), stride=N, at=0)
    stock = dict(base=base, ex=ex, kind=0, coefs=f32, acc=sums * 0, dots=np.zeros((G, G)))
    return {
        "decode_bits": (C.decode_bits, dict(raw=base, kind=0, out=np.zeros(N, np.uint32))),
        "uniform": (C.uniform, dict(key=5, offset=0, n=N)),
        "fold_group": (C.fold_group, fold),
        "fold_group della": (C.fold_group, della),
        "finish": (C.finish, to_f32),
        "finish bf16": (C.finish, to_bf16),
        "dot64": (C.dot64, dict(a=np.ones(N, np.float32), b=np.ones(N, np.float32))),
        "stock_fold": (C.stock_fold, stock),
        "fold_many": (C.fold_many, many),
        "finish_many": (C.finish_many, plans),
    }


BAD = [  # (call, its argument(s), the value, what C did with it)
    ("decode_bits", "out", lambda: np.zeros((N, 0), np.uint32), "wrote N values into an empty array"),
    ("decode_bits", "out", lambda: np.zeros((N, 2), np.uint32)[:, 1:2], "wrote a column's rows contiguously"),
    ("decode_bits", "raw", lambda: np.broadcast_to(np.zeros(1, np.uint16), (N, 1)), "read past one element"),
    ("decode_bits", "kind", lambda: 2**32, "took 2^32 as BF16 (ctypes keeps the low 32 bits)"),
    ("uniform", "key", lambda: 2**64 + 5, "drew stream 5"),
    ("uniform", "n", lambda: -1, "a negative count"),
    ("fold_group", "mode", lambda: 4, "read DELLA's rank table, which is only checked for mode 3"),
    ("fold_group", "mode", lambda: 2**32 + 1, "took it as mode 1 where numba took DELLA"),
    ("fold_group", "kind", lambda: 3, "decoded as F16"),
    ("fold_group", "coefs", lambda: np.ones((G, 0), np.float32), "read G weights from an empty array"),
    ("fold_group", "lo", lambda: np.zeros((G, 0)), "read G bands from an empty array"),
    ("fold_group", "keys", lambda: np.zeros(G - 1, np.uint64), "read a key past the array"),
    ("fold_group", "coefs", lambda: _odd(G, np.float32), "read misaligned floats"),
    ("fold_group", "base", lambda: np.broadcast_to(np.zeros(1, np.uint16), (N, 1)), "read past one element"),
    ("stock_fold", "base", lambda: np.zeros(N + 1, np.uint16), "numba's n from the base: read past the rows"),
    ("fold_group", "acc", lambda: np.zeros((1, N, 0), np.float32), "wrote N sums into an empty array"),
    ("fold_group", "ex", _uneven_rows, "rounded the row stride down (numba read the rows where they are)"),
    ("fold_group", "offset", lambda: -1, "a negative stream offset"),
    ("fold_group della", "ranks", lambda: np.full((G, 100), 0.5), "read ranks[k, 0..16383] of 100 columns"),
    ("fold_group della", "ranks", lambda: np.full(1 << 15, 0.5), "read row k from ranks + k"),
    ("fold_group della", "ranks", lambda: kernels.NO_RANKS, "read a rank table with no rows"),
    ("fold_group della", "p", lambda: 0.05, "divided by a non-positive density p - eps"),
    ("fold_group della", "p", lambda: float("nan"), "a NaN density"),
    ("finish", "res", lambda: np.zeros((N, 0), np.float32), "wrote N values into an empty array"),
    ("finish", "res", lambda: np.zeros((N, 2), np.float32)[:, 1:2], "wrote a column's rows contiguously"),
    ("finish", "acc", lambda: np.ones((1, N, 0), np.float32), "read N sums from an empty array"),
    ("finish bf16", "bf16", lambda: np.zeros((N, 0), np.uint16), "wrote N values into an empty array"),
    ("dot64", "a,b", lambda: np.ones((N, 0), np.float32), "read N floats from empty arrays"),
    ("stock_fold", "acc", lambda: np.zeros((0, N), np.float32), "wrote N sums into no row"),
    ("stock_fold", "dots", lambda: np.zeros((G, 1)), "wrote dots[0, 1] past the array"),
    ("stock_fold", "dots", lambda: np.zeros(G * G), "indexed a flat array by rows"),
    ("fold_many", "coefs", lambda: np.ones((SETS, G, 0), np.float32), "read weights from an empty array"),
    ("fold_many", "lo", lambda: np.zeros((SETS, 1)), "read bands past the array"),
    ("finish_many", "at", lambda: -N, "wrote plan 0 before the output"),
    ("finish_many", "stride", lambda: -N, "wrote plan 0 past the output's end"),
    ("finish_many", "lam", lambda: np.ones((2, 0)), "read λ from an empty array"),
    ("finish_many", "normalize", lambda: np.ones((2, 0), bool), "read flags from an empty array"),
    ("finish_many", "acc", lambda: np.ones((SETS, 0, N), np.float32), "read sums of no rows"),
    ("finish_many", "group", lambda: np.array([0, SETS]), "read a fold set past the sums"),
    ("finish_many", "group", lambda: np.array([0.9, 1.5]), "truncated float indices (numba refuses them)"),
    ("finish_many", "res", lambda: np.zeros(2 * N - 1, np.float32), "wrote past the output's end"),
]


def test_each_good_call_runs():
    """The calls the cases start from are accepted (and C computes something)."""
    for name, (call, args) in _good().items():
        got = call(**args)
        if name == "dot64":
            assert got == N
        if name == "finish":
            assert args["res"].any()


@pytest.mark.parametrize(("name", "arg", "bad", "why"), BAD, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BAD)])
def test_an_argument_c_would_misuse_is_refused(name, arg, bad, why):
    call, args = _good()[name]
    call(**args)
    with pytest.raises((TypeError, ValueError)):
        call(**(args | {a: bad() for a in arg.split(",")}))
