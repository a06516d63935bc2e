"""The fused merge kernels (native.c) and registration's statistics kernels (deltapass.c), compiled by
the system C compiler and loaded with ctypes.

Why: numba's import and the load of its cached machine code cost every `mergedb execute` process
~0.2 s before its first block is merged (benchmarks/ANALYSIS.md), as much as a budgeted merge of two
experts takes to read on a fast disk. The shared library loads in about a millisecond. native.c
performs the operations of jitkernels.py's kernels in the same order, and deltapass.c those of
deltapass.py's, so the outputs are the same bits whichever ran (tests/test_native.py,
tests/test_regkernels.py).

Built once per machine and source: `cc` (or $CC) compiles native.c and deltapass.c (one unit) into
`native-<source>-<where>.so` in the package's __pycache__ (or $XDG_CACHE_HOME/mergedb where that is
not writable), named by the sources' hash and by the flags, the compiler and this CPU's model and
features (the code is compiled for this CPU, -march=native, and must not run on another one sharing
the folder). A build writes a temporary name and renames it in, so processes starting together never
load half a file, and removes libraries of earlier sources. Where no compiler works, `load` returns
None and kernels.py and regkernels.py run numba's kernels instead: slower to start, the same bits.
MERGEDB_KERNELS=numba chooses numba; =native makes a failed build an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import kernelargs as ka
from .errors import MergeDBError

SOURCES = [Path(__file__).with_name("native.c"), Path(__file__).with_name("deltapass.c")]  # one unit, in this order
FLAGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-std=c11", "-shared", "-fPIC"]
# tried in order: this CPU's widest vectors (512-bit: folds on par with numba here, the draws of DARE
# and DELLA 1.3-1.8x faster; 256-bit: the folds 10% slower), this CPU, the compiler's default target
TUNE = [["-march=native", "-mprefer-vector-width=512"], ["-march=native"], []]

_P, _I, _D, _C, _U = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int, ctypes.c_uint64
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "mdb_decode_bits": (None, [_P, _C, _I, _C, _P]),
    "mdb_draws": (None, [_U, _U, _I, _P]),
    "mdb_fold_group": (_C, [_P, _C, _P, _I, _I, _I, _C, _C, _I, _P, _P, _P, _P, _D, _D, _P, _I, _P, _I, _I]),
    "mdb_finish": (_C, [_P, _C, _I, _C, _P, _I, _I, _C, _D, _P, _P, _C, _D]),
    "mdb_dot64": (_D, [_P, _P, _I]),
    "mdb_stock_fold": (_C, [_P, _C, _P, _I, _I, _I, _C, _P, _P, _P, _I]),
    "mdb_fold_many": (_C, [_P, _C, _P, _I, _I, _I, _C, _P, _P, _P, _I, _P, _I, _I, _I]),
    "mdb_finish_many": (_C, [_P, _C, _I, _C, _P, _I, _I, _I, _P, _I, _P, _P, _D, _P, _P, _C, _I, _I]),
    "mdb_group_pass": (
        _I,
        [_P, _P, _P, _P, _C, _I, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _P, _P, _C, _C]
        + [_P] * 7
        + [_I, _P, _I, _P, _P, _P],
    ),
    "mdb_base_group": (None, [_P, _C, _P, _I, _P, _P]),
    "mdb_bucket_codes": (None, [_U, _I, _I, _P]),
    "mdb_radix_histogram": (None, [_P, _I, _P, _P, _C, _P]),
    "mdb_same_bytes": (_C, [_P, _P, _I]),
}

_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # "kernels": the Kernels of this process, or None; "why": a failed build's reason


def _cpu() -> str:
    """This CPU's model and features, as the kernel reports them (a compiled library's key)."""
    try:
        with open("/proc/cpuinfo") as f:
            keys = ("model name", "flags", "Features")
            lines = [ln for ln in f.read().splitlines() if ln.split(":")[0].strip() in keys]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _folders() -> list[Path]:
    """Where the compiled library is kept, most preferred first."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mergedb"
    return [SOURCES[0].parent / "__pycache__", cache]


def _compile(source: bytes, folder: Path, name: str, cc: str) -> Path | str:
    """Compile `source` (the SOURCES as hashed into the name) into folder/name; the library's path, or
    why it could not be built."""
    why = ""
    for tune in TUNE:
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=".native-", suffix=".so", dir=folder)
            os.close(fd)
            cmd = [cc, *FLAGS, *tune, "-x", "c", "-", "-o", tmp, "-lm"]
            r = subprocess.run(cmd, input=source, capture_output=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp, folder / name)
                _remove_older(folder, name)
                return folder / name
            lines = (r.stderr or r.stdout).decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else f"exit status {r.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
    return f"{cc} could not compile {' and '.join(p.name for p in SOURCES)}: {why}"


STALE = 600.0  # seconds after which a temporary library is a killed build's (a build's timeout is 300 s)


def _remove_older(folder: Path, name: str) -> None:
    """Libraries built from earlier sources (other CPUs' builds of this one stay: a folder may be
    shared), and temporary files that builds killed midway left (older than STALE; a younger one may be
    a build running now). A process still running a library keeps its mapping (unlinking a loaded
    library is safe on POSIX)."""
    src = name.split("-")[1]
    now = time.time()
    for p in [*folder.glob("native-*-*.so"), *folder.glob(".native-*.so")]:
        try:
            stale = now - p.stat().st_mtime > STALE if p.name.startswith(".") else p.name.split("-")[1] != src
            if stale:
                p.unlink()
        except OSError:
            pass


def _build() -> Path | str:
    """The compiled library for this source and CPU, built if missing; or why there is none."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return "no C compiler (cc, gcc or clang) on PATH"
    source = b"\n".join(p.read_bytes() for p in SOURCES)
    where = [" ".join(FLAGS + sum(TUNE, [])), cc, _cpu(), platform.machine(), sys.platform]
    src, env = hashlib.sha256(source).hexdigest()[:12], hashlib.sha256("\0".join(where).encode()).hexdigest()[:12]
    name = f"native-{src}-{env}.so"
    why = "no writable folder for the compiled kernels"
    for folder in _folders():
        if (folder / name).exists():
            return folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if not os.access(folder, os.W_OK):
            continue
        got = _compile(source, folder, name, cc)
        if isinstance(got, Path):
            return got
        why = got
    return why


def load() -> Kernels | None:
    """This process's compiled kernels (built on first use), or None where they cannot be built
    (why_not says why) or MERGEDB_KERNELS=numba asks for numba's."""
    with _lock:
        if "kernels" not in _loaded:
            choice = os.environ.get("MERGEDB_KERNELS", "auto")
            if choice not in ("auto", "native", "numba"):
                raise MergeDBError(f"MERGEDB_KERNELS={choice!r}: use auto, native or numba")
            got: Path | str = "MERGEDB_KERNELS=numba" if choice == "numba" else _build()
            kernels = None
            if isinstance(got, Path):
                try:
                    kernels = Kernels(ctypes.CDLL(str(got)))
                except (OSError, AttributeError) as e:
                    got = f"{got} could not be loaded: {e}"
            if kernels is None and choice == "native":
                raise MergeDBError(f"MERGEDB_KERNELS=native, but the C kernels are unavailable: {got}")
            _loaded["kernels"], _loaded["why"] = kernels, None if kernels else got
        return _loaded["kernels"]


def reset() -> None:
    """Choose again on the next `load` (tests switch MERGEDB_KERNELS within one process)."""
    with _lock:
        _loaded.clear()


def why_not() -> str | None:
    """Why this process runs numba's kernels (after `load`), or None when it runs the C ones."""
    return _loaded.get("why")


# -- the calls: numba's signatures (jitkernels.py), every argument checked (kernelargs.py) ----------


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError("a merge kernel could not allocate its chunk buffers")


def _kind(kind: Any) -> int:
    return ka.whole_number(kind, 0, 3, "the raw bits' dtype (kernels.IN_KIND)")


class Kernels:
    """jitkernels.py's fused kernels (the same names, arguments and results), run by native.c."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (res, args) in _SIGNATURES.items():
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
        self.lib = lib
        self._local = threading.local()

    def decode_bits(self, raw: np.ndarray, kind: int, out: np.ndarray) -> None:
        p, wide = ka.raw(raw, (None,), "decode_bits: raw")
        n = raw.shape[0]
        self.lib.mdb_decode_bits(p, wide, n, _kind(kind), ka.array(out, np.uint32, (n,), "decode_bits: out", True))

    def uniform(self, key: int, offset: int, n: int) -> np.ndarray:
        out = np.empty(ka.whole_number(n, 0, 1 << 62, "uniform: n"), np.float64)
        key = ka.whole_number(key, 0, 1 << 64, "uniform: key")
        offset = ka.whole_number(offset, 0, 1 << 64, "uniform: offset")
        self.lib.mdb_draws(key, offset, n, ka.array(out, np.float64, (n,), "uniform: out", True))
        return out

    def _experts(self, base: np.ndarray, ex: np.ndarray, what: str) -> tuple[int, int, int, int, int, int]:
        """(g, n, base address, wide, experts' address, their row stride) of `base` (n,) and `ex` (g, n)."""
        pe, wide = ka.raw(ex, (None, None), f"{what}: experts")
        g, n = ex.shape
        if getattr(base, "dtype", None) != ex.dtype:
            raise TypeError(f"{what}: base bits of dtype {getattr(base, 'dtype', None)} and experts' of {ex.dtype}")
        pb = ka.raw(base, (n,), f"{what}: base")[0]
        if base.shape != (n,):  # numba takes n from the base: a longer one would read past the experts' rows
            raise ValueError(f"{what}: a base of {base.shape[0]} elements and experts' rows of {n}")
        return g, n, pb, wide, pe, ka.stride(ex)

    def fold_group(self, base, ex, kind, mode, offset, coefs, lo, hi, keys, p, eps, ranks, acc) -> None:  # noqa: ANN001
        g, n, pb, wide, pe, se = self._experts(base, ex, "fold_group")
        mode = ka.whole_number(mode, 0, 4, "fold_group: the sparsify mode (kernels.MODE)")
        p, eps = float(p), float(eps)  # DARE divides by p, DELLA by p - eps + 2·eps·rank: as methods.py allows them
        if mode == 2 and not 0 < p <= 1 or mode == 3 and not (eps >= 0 and 0 < p - eps and p + eps <= 1):
            raise ValueError(f"fold_group: density {p} (epsilon {eps}) outside (0, 1]")
        if getattr(acc, "ndim", 0) != 2 or acc.shape[0] not in (1, 5) or acc.shape[1] != n:
            raise ValueError("fold_group: the sums are not 1 or 5 rows of the block")
        table = (g, 1 << 14) if mode == 3 else (None, None)  # DELLA reads ranks[k, bits(|Δ|) >> 17]
        _check(
            self.lib.mdb_fold_group(
                pb, wide, pe, se, g, n, _kind(kind), mode, ka.whole_number(offset, 0, 1 << 62, "fold_group: offset"),
                ka.array(coefs, np.float32, (g,), "fold_group: coefs"),
                ka.array(lo, np.float64, (g,), "fold_group: lo"), ka.array(hi, np.float64, (g,), "fold_group: hi"),
                ka.array(keys, np.uint64, (g,), "fold_group: keys"), p, eps,
                ka.array(ranks, np.float64, table, "fold_group: ranks"), ka.stride(ranks),
                ka.array(acc, np.float32, (acc.shape[0], n), "fold_group: sums", True), acc.shape[0], ka.stride(acc),
            )
        )  # fmt: skip

    def finish(self, base, kind, acc, normalize, lam, res, bf16, scale=1.0) -> None:  # noqa: ANN001
        pb, wide = ka.raw(base, (None,), "finish: base")
        n = base.shape[0]
        if getattr(acc, "ndim", 0) != 2 or acc.shape[0] not in (1, 5) or acc.shape[1] != n:
            raise ValueError("finish: the sums are not 1 or 5 rows of the block")
        to_bf16 = getattr(bf16, "ndim", 0) == 1 and bf16.shape[0] > 0  # else float32 into `res`
        _check(
            self.lib.mdb_finish(
                pb, wide, n, _kind(kind), ka.array(acc, np.float32, (acc.shape[0], n), "finish: sums"), acc.shape[0],
                ka.stride(acc), bool(normalize), float(lam),
                ka.array(res, np.float32, (0 if to_bf16 else n,), "finish: res", True),
                ka.array(bf16, np.uint16, (n if to_bf16 else 0,), "finish: bf16", True), to_bf16, float(scale),
            )
        )  # fmt: skip

    def dot64(self, a: np.ndarray, b: np.ndarray) -> float:
        if getattr(a, "shape", None) != getattr(b, "shape", ()):
            raise ValueError("dot64: arrays of different shapes")
        pa, pb = ka.array(a, np.float32, (None,), "dot64: a"), ka.array(b, np.float32, (None,), "dot64: b")
        return float(self.lib.mdb_dot64(pa, pb, a.shape[0]))

    def stock_fold(self, base, ex, kind, coefs, acc, dots) -> None:  # noqa: ANN001
        g, n, pb, wide, pe, se = self._experts(base, ex, "stock_fold")
        if getattr(acc, "shape", None) != (1, n):
            raise ValueError("stock_fold: the sums are not one row of the block")
        _check(
            self.lib.mdb_stock_fold(
                pb, wide, pe, se, g, n, _kind(kind), ka.array(coefs, np.float32, (g,), "stock_fold: coefs"),
                ka.array(acc, np.float32, (1, n), "stock_fold: sums", True),
                ka.array(dots, np.float64, (g, g), "stock_fold: dots", True), ka.stride(dots),
            )
        )  # fmt: skip

    def fold_many(self, base, ex, kind, coefs, lo, hi, acc) -> None:  # noqa: ANN001
        g, n, pb, wide, pe, se = self._experts(base, ex, "fold_many")
        if getattr(acc, "ndim", 0) != 3 or acc.shape[1:] != (5, n):
            raise ValueError("fold_many: the sums are not sets of 5 rows of the block")
        sets = acc.shape[0]
        par = (sets, g)
        pc = ka.array(coefs, np.float32, par, "fold_many: coefs")
        pl, ph = ka.array(lo, np.float64, par, "fold_many: lo"), ka.array(hi, np.float64, par, "fold_many: hi")
        if not ka.stride(coefs) == ka.stride(lo) == ka.stride(hi):
            raise ValueError("fold_many: weights and bands laid out differently")
        _check(
            self.lib.mdb_fold_many(
                pb, wide, pe, se, g, n, _kind(kind), pc, pl, ph, ka.stride(coefs),
                ka.array(acc, np.float32, (sets, 5, n), "fold_many: sums", True), sets, ka.stride(acc),
                ka.stride(acc, 1),
            )
        )  # fmt: skip

    def finish_many(self, base, kind, acc, group, normalize, lam, scale, res, bf16, stride, at) -> None:  # noqa: ANN001
        pb, wide = ka.raw(base, (None,), "finish_many: base")
        n = base.shape[0]
        if np.asarray(group).dtype.kind not in "iu":  # a float index would be truncated here; numba refuses it
            raise TypeError(f"finish_many: fold set indices of dtype {np.asarray(group).dtype}")
        group = np.ascontiguousarray(group, np.int64)
        normalize = np.ascontiguousarray(normalize, np.bool_).view(np.uint8)
        lam = np.ascontiguousarray(lam, np.float64)
        plans = group.shape[0] if group.ndim == 1 else -1
        sets = acc.shape[0] if getattr(acc, "ndim", 0) == 3 else 0
        if plans < 0 or sets and (acc.shape[1] not in (1, 5) or acc.shape[2] != n):
            raise ValueError("finish_many: fold sets not one row, or sums not 1 or 5 rows of the block")
        if plans and (group.min() < 0 or group.max() >= sets):
            raise ValueError("finish_many: a plan's fold set is out of range")
        stride = ka.whole_number(stride, 0, 1 << 62, "finish_many: the plans' output stride")
        at = ka.whole_number(at, 0, 1 << 62, "finish_many: the block's first output element")
        end = (plans - 1) * stride + at + n if plans else 0  # past plan p's elements [p·stride + at, … + n)
        to_bf16 = getattr(bf16, "ndim", 0) == 1 and bf16.shape[0] > 0
        _check(
            self.lib.mdb_finish_many(
                pb, wide, n, _kind(kind), ka.array(acc, np.float32, (sets, None, n), "finish_many: sums"),
                acc.shape[1] if sets else 1, ka.stride(acc), ka.stride(acc, 1) if sets else 0,
                ka.array(group, np.int64, (plans,), "finish_many: group"), plans,
                ka.array(normalize, np.uint8, (plans,), "finish_many: normalize"),
                ka.array(lam, np.float64, (plans,), "finish_many: lam"), float(scale),
                ka.array(res, np.float32, (0 if to_bf16 else end,), "finish_many: res", True),
                ka.array(bf16, np.uint16, (end if to_bf16 else 0,), "finish_many: bf16", True), to_bf16, stride, at,
            )
        )  # fmt: skip

    # -- registration's kernels (deltapass.c; numba's twins in deltapass.py, the same arguments) --
    # Every array is checked whole (its dimensions, C order, alignment, dtype and extent), and every
    # block range: the C code indexes raw memory where numba would clip a slice or refuse a type.

    def group_pass(self, e_raw, b_raw, e, b, raw_start, start, abs_bits, codes, summary, exc, n_exc,
                   edge, edge_sq, hist_shift, summary_shift, out) -> int:  # noqa: ANN001  # fmt: skip
        ident, nonfinite, zeros, mx, hcount, hsum, hsq, sk, bd = out
        wide = ka.raw(e, (None,) * getattr(e, "ndim", 1), "group_pass: expert bits")[1]
        blocks, n = ka.ranges(start, e.size, "group_pass: block starts")
        if ka.ranges(raw_start, min(e_raw.size, b_raw.size), "group_pass: block bytes")[0] != blocks:
            raise ValueError("group_pass: block bytes and block starts of other lengths")
        if b.dtype != e.dtype or b.shape != e.shape:
            raise ValueError("group_pass: expert and base patterns of other shapes")
        if abs_bits.size < n or codes.size < n:
            raise ValueError("group_pass: |Δ| or the sketch codes shorter than the blocks")
        if (hist_shift, summary_shift, summary.shape, edge.shape, edge_sq.shape) != (22, 17, *((1 << 14,),) * 3):
            raise ValueError("group_pass: the summary, its edges and the shifts are not registration's (22, 17)")
        dim = sk.shape[1] if sk.ndim == 2 else 0
        rows = ((blocks,),) * 4 + ((blocks, 512),) * 3 + ((blocks, dim), (blocks, 4))
        if not 0 < dim <= 1 << 15 or [x.shape for x in out] != list(rows):
            raise ValueError("group_pass: output rows of other shapes")
        if not exc.size or n_exc < 0:
            raise ValueError("group_pass: an empty exception buffer, or a negative count of exceptions")
        counts, esum = self._scratch(summary.shape[0])
        got = self.lib.mdb_group_pass(
            ka.whole(e_raw, np.uint8), ka.whole(b_raw, np.uint8), ka.whole(e, e.dtype), ka.whole(b, e.dtype),
            wide, e.nbytes, ka.whole(raw_start, np.int64), ka.whole(start, np.int64), blocks,
            ka.whole(abs_bits, np.uint32, True), ka.whole(codes, np.uint16), ka.whole(summary, np.int64, True),
            summary.shape[0], ka.whole(exc, np.uint32, True), exc.shape[0], int(n_exc),
            ka.whole(edge, np.float64), ka.whole(edge_sq, np.float64), 22, 17,
            ka.whole(ident, np.bool_, True), ka.whole(nonfinite, np.int64, True), ka.whole(zeros, np.int64, True),
            ka.whole(mx, np.float64, True), ka.whole(hcount, np.int64, True), ka.whole(hsum, np.float64, True),
            ka.whole(hsq, np.float64, True), 512, ka.whole(sk, np.float64, True), dim, ka.whole(bd, np.float64, True),
            ka.whole(counts, np.int64, True), ka.whole(esum, np.float64, True),
        )  # fmt: skip
        if got == -2:
            raise ValueError(f"group_pass: a sketch code past the sketch's {dim} buckets (codes for another width?)")
        return int(got)

    def _scratch(self, bins: int) -> tuple[np.ndarray, np.ndarray]:
        """This thread's group_pass scratch: (bins,) counts that the C code leaves all zero, and the
        exceptions' per-bin sums (a fresh 128 KiB calloc per call faulted its pages in every time)."""
        got = getattr(self._local, "scratch", None)
        if got is None or got[0].shape[0] != bins:
            got = self._local.scratch = (np.zeros(bins, np.int64), np.empty(2 * bins // 32, np.float64))
        return got

    def base_group(self, x: np.ndarray, start: np.ndarray, ss: np.ndarray, bad: np.ndarray) -> None:
        wide = ka.raw(x, (None,) * getattr(x, "ndim", 1), "base_group: bits")[1]
        blocks, _ = ka.ranges(start, x.size, "base_group: block starts")
        if ss.shape != (blocks,) or bad.shape != (blocks,):
            raise ValueError("base_group: outputs of other lengths than the blocks")
        self.lib.mdb_base_group(
            ka.whole(x, x.dtype), wide, ka.whole(start, np.int64), blocks, ka.whole(ss, np.float64, True),
            ka.whole(bad, np.int64, True),
        )  # fmt: skip

    def bucket_codes(self, key: int, dim: int, out: np.ndarray) -> None:
        if not 0 < int(dim) <= 1 << 15:
            raise ValueError(f"bucket_codes: a sketch of {dim} buckets (1 to 32768)")
        key = ka.whole_number(key, 0, 1 << 64, "bucket_codes: key")
        self.lib.mdb_bucket_codes(key, int(dim), out.size, ka.whole(out, np.uint16, True))

    def sub_histogram(self, abs_bits: np.ndarray, slot_of: np.ndarray, sub: np.ndarray) -> None:
        self._radix(abs_bits, slot_of, None, sub, 256)

    def low_histogram(self, abs_bits: np.ndarray, slot_of: np.ndarray, pair_of: np.ndarray, low: np.ndarray) -> None:
        self._radix(abs_bits, slot_of, pair_of, low, 512)

    def _radix(self, abs_bits, slot_of, pair_of, counts, width) -> None:  # noqa: ANN001
        if slot_of.shape != (1 << 14,) or counts.ndim != 2 or counts.shape[1] != width:
            raise ValueError("a radix histogram's tables of other shapes")
        rows = counts.shape[0] if pair_of is None else pair_of.shape[0]
        if pair_of is not None and (pair_of.ndim != 2 or pair_of.shape[1] != 256):
            raise ValueError("a radix histogram's pair table of another shape")
        tables = [slot_of] if pair_of is None else [slot_of, pair_of]
        if any(int(t.min(initial=0)) < 0 for t in tables) or int(slot_of.max(initial=0)) >= rows:
            raise ValueError("a radix histogram's slots out of range")
        if pair_of is not None and int(pair_of.max(initial=0)) >= counts.shape[0]:
            raise ValueError("a radix histogram's pairs out of range")
        if counts.dtype not in (np.int32, np.int64):
            raise TypeError(f"radix counts of dtype {counts.dtype}, where int32 or int64 is expected")
        self.lib.mdb_radix_histogram(
            ka.whole(abs_bits, np.uint32), abs_bits.size, ka.whole(slot_of, np.int16),
            None if pair_of is None else ka.whole(pair_of, np.int16), int(counts.dtype == np.int64),
            ka.whole(counts, counts.dtype, True),
        )  # fmt: skip

    def same_bytes(self, a: np.ndarray, b: np.ndarray) -> bool:
        if a.shape != b.shape:
            raise ValueError("same_bytes: buffers of other shapes")
        return bool(self.lib.mdb_same_bytes(ka.whole(a, np.uint8), ka.whole(b, np.uint8), a.size))
