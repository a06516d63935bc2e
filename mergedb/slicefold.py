"""A block (or span) merged in slices of SLICE_BYTES: every expert is folded into one slice's
running sums before the next slice starts.

TIES-style running sums are 5 float32 per element (20 bytes; 1 float32 for additive methods): a
4 MiB bfloat16 block's are 40 MiB a compute thread, more than a server's L3 cache (32 MiB shared
by both cores on the machine measured), and each kernel call (one group of merger.READ_AHEAD
experts) streams them from memory and back once, K / READ_AHEAD times a block. A 512 KiB slice's
sums (5 MiB) stay in cache across those calls, and the read buffers shrink with the slice: per
compute thread 5 MiB of sums and 2 × READ_AHEAD × 512 KiB of expert bytes instead of 40 + 24 MiB,
so peak memory no longer grows while K fills the read groups. Each expert's bytes of a slice are
one read at its offset in the block (the file is still read front to back); the next group's
reads, across slice ends too, run on the I/O threads while this group is folded in.

The kernels are elementwise and keyed by element offset (DARE's draws), so every element's float32
operations are those of the whole-block call, in the same order: the output bytes are the same.
Used where spans are (Merger.spans): the fused path on local files, and none of --verify, a
sweep's shared reads or folds (read_block, fold_block), or adapters.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .merger import Merger

SLICE_BYTES = 512 * 2**10  # input bytes of one slice (bf16: 256k elements, TIES sums 5 MiB)


def merge_sliced(m: Merger, ti: int, b: int | tuple[int, ...], base_raw: np.ndarray, out: np.ndarray) -> None:
    """Block (or span) `b` of tensor `ti` into `out`, slice by slice: fold every expert group into the
    slice's sums (Merger._fold_group), then write the slice (Merger._finish)."""
    lo, n, bits_dt, base = m._block(ti, b, base_raw)
    size = bits_dt.itemsize
    step = max(1, SLICE_BYTES // size)  # elements a slice
    groups = m._groups(ti, b, n * size)  # more than SLICE_BYTES: groups of READ_AHEAD
    starts = range(0, n, step)
    steps = [(s0, gi) for s0 in starts for gi in range(len(groups))]  # reads in this order
    rows = 5 if m.method.consensus else 1
    sums = m.local.get("acc", rows * min(step, n), np.float32)
    most = max((len(g) for g in groups), default=0) * step * size  # a group's bytes of one slice
    bufs = [m.local.get(f"ex{j}", most, np.uint8) for j in range(2)]

    def submit(i: int) -> list[Future[np.ndarray]]:
        s0, gi = steps[i]
        nb = min(step, n - s0) * size
        buf = bufs[i % 2]
        return [
            m.io.submit(m._read_one, ti, b, pos, h, buf[k * nb : (k + 1) * nb], s0 * size)
            for k, (pos, h) in enumerate(groups[gi])
        ]

    reads = submit(0) if steps else []
    i = 0
    for s0 in starts:
        count = min(step, n - s0)
        acc = sums[: rows * count].reshape(rows, count)
        acc.fill(0)
        for grp in groups:
            for f in reads:
                f.result()
            if i + 1 < len(steps):
                reads = submit(i + 1)
            ex = bufs[i % 2][: len(grp) * count * size].view(bits_dt).reshape(len(grp), count)
            m._fold_group(ti, grp, base[s0 : s0 + count], ex, lo + s0, acc)
            i += 1
        m._finish(ti, b, base_raw, acc, out, part=(s0, count))
