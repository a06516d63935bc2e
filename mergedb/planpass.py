"""One compiled pass per step of a large plan (candidates.py and greedy.py use these from
greedy.COMPILED_MIN_ROWS candidates up): scoring, the bucket histogram and cut, the bits, the bounds.

At 35M candidates every fresh (N,) numpy temporary is 35–280 MB of new pages: numpy hands freed
memory back to the kernel, so each temporary costs its page faults again (seconds of system time
in all, more with transparent huge pages). Each pass here reads the candidates' arrays once and
writes only into arrays its caller allocated. Every sum runs in the candidates' order, one element
after another, as np.bincount's do, so the results are the numpy paths' to the last bit; numba is
imported only for plans this large (its import and cache load cost ~0.3 s).
"""

from __future__ import annotations

import numpy as np

from .jitload import numba  # imported with Ctrl-C held

BUCKET_SHIFT = 40  # greedy._BUCKET_SHIFT: sign, exponent and 12 mantissa bits of the score


@numba.njit(nogil=True, cache=True)
def score_rows(  # pragma: no cover - compiled
    position, tensor_idx, block_idx, cost, norm, first_block, fam_nbytes, coef, ranked, sqrt_size, gblock, score
):
    """gblock = first_block[tensor_idx] + block_idx; cost: a dense block's (−1) becomes its family
    block's bytes (candidates.cost), in place; norm becomes value = |c_k|·norm in place; with
    `ranked`, score = value / max(cost, 1), or value / √max(cost, 1) with `sqrt_size` (the same
    IEEE operations as candidates.fetch's numpy path)."""
    for i in range(position.size):
        t = tensor_idx[i]
        g = first_block[t] + block_idx[i]
        gblock[i] = g
        if cost[i] < 0:
            cost[i] = fam_nbytes[g]
        v = abs(coef[position[i], t]) * norm[i]
        norm[i] = v
        if ranked:
            c = float(max(cost[i], 1))
            score[i] = v / (np.sqrt(c) if sqrt_size else c)


@numba.njit(nogil=True, cache=True)
def bucket_range(bits, free):  # pragma: no cover - compiled
    """(lowest, highest) bucket (bits >> BUCKET_SHIFT) of the non-free candidates; (0, -1): none."""
    lo, hi = np.int64(2**62), np.int64(-1)
    for i in range(bits.size):
        if not free[i]:
            b = bits[i] >> BUCKET_SHIFT
            lo = min(lo, b)
            hi = max(hi, b)
    return (lo, hi) if hi >= 0 else (np.int64(0), np.int64(-1))


@numba.njit(nogil=True, cache=True)
def bucket_bytes(bits, free, nbytes, lo, per_bucket, per_count):  # pragma: no cover - compiled
    """Bytes and candidates of the non-free candidates per bucket − lo (added into the arrays)."""
    for i in range(bits.size):
        if not free[i]:
            b = (bits[i] >> BUCKET_SHIFT) - lo
            per_bucket[b] += nbytes[i]
            per_count[b] += 1


@numba.njit(nogil=True, cache=True)
def cut_rows(bits, free, nbytes, lo, cut, sel, edge):  # pragma: no cover - compiled
    """sel[i] = a non-free candidate above bucket `cut`; edge: the rows of bucket `cut`, ascending
    (its size is that bucket's count). Returns the selected bytes."""
    taken = np.int64(0)
    j = 0
    for i in range(bits.size):
        if not free[i]:
            b = (bits[i] >> BUCKET_SHIFT) - lo
            if b > cut:
                sel[i] = True
                taken += nbytes[i]
            elif b == cut:
                edge[j] = i
                j += 1
    return taken


@numba.njit(nogil=True, cache=True)
def bit_rows(position, tensor_idx, gblock, sel, n_blocks, n_tensors, chars, present):  # pragma: no cover - compiled
    """greedy.bit_strings' chars ('1' at position·B + gblock of each selected candidate) and
    present (position·T + tensor_idx of every candidate)."""
    for i in range(position.size):
        p = np.int64(position[i])
        if sel[i]:
            chars[p * n_blocks + gblock[i]] = 49  # ord("1")
        present[p * n_tensors + tensor_idx[i]] = True


@numba.njit(nogil=True, cache=True)
def bound_rows(  # pragma: no cover - compiled
    position, gblock, value, nbytes, sel, free, v, v_sum, v_sq, s_bytes, f_bytes, omitted
):
    """greedy.bounds' sums in one pass: v = omitted value per candidate (0 where selected), per
    position Σv, Σv², selected and full bytes (float64, as np.bincount's weights), per family block
    Σv. Returns (selected bytes, full bytes, selected, free) as exact integers."""
    sel_total, full, n_sel, n_free = np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    for i in range(position.size):
        p = position[i]
        x = 0.0 if sel[i] else value[i]
        v[i] = x
        v_sum[p] += x
        v_sq[p] += x * x
        nb = nbytes[i]
        if sel[i]:
            s_bytes[p] += float(nb)
            sel_total += nb
            n_sel += 1
        else:
            s_bytes[p] += 0.0
        f_bytes[p] += float(nb)
        full += nb
        omitted[gblock[i]] += x
        if free[i]:
            n_free += 1
    return sel_total, full, n_sel, n_free


@numba.njit(nogil=True, cache=True)
def block_rows(gblock, value, sel, free, per_block, differs):  # pragma: no cover - compiled
    """greedy.block_sums: Σ value per family block, and whether a non-free candidate there is omitted."""
    for i in range(gblock.size):
        g = gblock[i]
        per_block[g] += value[i]
        if not sel[i] and not free[i]:
            differs[g] = True


@numba.njit(nogil=True, cache=True)
def key_rows(chars, start, n_blocks, tensor_of, first_block, col, out):  # pragma: no cover - compiled
    """Column `col` (0 position, 1 tensor_idx, 2 block_idx) of the selected blocks in the mask's
    chars from index `start`, into `out` until it is full: (keys written, index to go on from).
    (position, block) are carried along the scan: a division per selected block cost more than the scan."""
    n = 0
    i = start
    p = i // n_blocks
    g = i - p * n_blocks
    while i < chars.size and n < out.size:  # branch-free: every block writes, a selected one keeps it
        if col == 0:
            out[n] = p
        elif col == 1:
            out[n] = tensor_of[g]
        else:
            out[n] = g - first_block[tensor_of[g]]
        n += chars[i] == 49  # ord("1")
        i += 1
        g += 1
        if g == n_blocks:
            g = 0
            p += 1
    return n, i


@numba.njit(nogil=True, cache=True)
def fill_pool(sel, free, nbytes, budget):  # pragma: no cover - compiled
    """greedy._fill's start: the bytes left under `budget` after the selected candidates, and the
    rows (ascending) of the candidates neither selected nor free that are no larger than that."""
    taken = np.int64(0)
    for i in range(sel.size):
        if sel[i]:
            taken += nbytes[i]
    left = np.int64(budget) - taken
    n = 0
    for i in range(sel.size):
        if not sel[i] and not free[i] and nbytes[i] <= left:
            n += 1
    pool = np.empty(n, np.int64)
    j = 0
    for i in range(sel.size):
        if not sel[i] and not free[i] and nbytes[i] <= left:
            pool[j] = i
            j += 1
    return left, pool
