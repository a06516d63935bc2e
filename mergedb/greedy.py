"""The budget cut in memory: the exact greedy over the scored candidates, its bounds, the mask.

The planner scores every (expert, block) candidate in SQL (queries/plan_candidates*.sql: the value
model and the byte cost) and fetches the candidates once; what follows is a few O(N) passes over
numpy arrays, so a plan of 35M candidates costs seconds, not one SQL statement per step.

Order: the plan's order is (score DESC, position, tensor_idx, block_idx), a unique key, so plans
repeat exactly. `slot` = position·B + first block of the tensor + block_idx (B blocks in the family)
is the tie-break part as one integer. Candidates stay in the order SQL returned them (sorting 35M
rows would cost more than everything else); only the few rows whose order matters are sorted.

The greedy ("take each block, best first, if it still fits") in three steps, equal to walking the
whole order: (1) bucket the scores by the top bits of their IEEE-754 patterns (monotone for scores
≥ 0) and find, from the best bucket down, the bucket where the budget runs out; every block above it
fits; (2) sort that bucket alone and take the prefix that fits; (3) fill: among the blocks not taken
that are no larger than what is left, take the prefix (in plan order) that fits, and repeat until a
pass adds nothing — after a block that does not fit, the greedy can only take smaller ones.
Small plans (≤ SORT_MAX non-free candidates) skip the buckets: one sort of them in plan order gives
the same prefix (the buckets span every octave the scores cover, ~4M bins when some are 0). Large
plans (≥ COMPILED_MIN_ROWS) run the buckets, bits and bounds as compiled passes (planpass.py).

Fixed costs (LoRA adapters, candidates.charge_fixed): a dependent candidate may be taken only once
its carrier, which pays its (expert, tensor)'s fixed bytes, is. The carrier precedes its dependents
in the plan's order, so steps (1) and (2), which take a prefix of the order, hold it already; a
fill pass drops the dependents whose carrier is neither taken nor in the pass's pool (too large for
what is left, it never will be), and in the pass's prefix a dependent comes after its carrier. That
is the walk "take each block, best first, if it fits and its carrier is taken", exactly.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from . import freshmem
from .errors import PlanError

_BUCKET_SHIFT = 40  # keep sign, exponent and 12 mantissa bits: 4096 buckets per octave of score
SORT_MAX = 1 << 17  # up to this many non-free candidates one sort is cheaper than the buckets' histogram
COMPILED_MIN_ROWS = freshmem.LARGE  # from here planpass.py (numba: ~0.5 CPU-s to load; saves ~0.14 per 1M rows)


@dataclass(frozen=True)
class Candidates:
    """Every (expert, block) candidate of a plan, in any order; arrays of length N."""

    position: np.ndarray  # (N,) int32 expert position in the plan
    tensor_idx: np.ndarray  # (N,) int32
    block_idx: np.ndarray  # (N,) int32
    nbytes: np.ndarray  # (N,) int64 the candidate's byte cost (plan_candidates.sql)
    free: np.ndarray  # (N,) bool identical to the base: never read, zero error
    value: np.ndarray  # (N,) float64
    score: np.ndarray  # (N,) float64 ≥ 0
    gblock: np.ndarray  # (N,) int64 family block index: first block of the tensor + block_idx
    n_family_blocks: int  # B: slot = position·B + gblock is the unique tie-break key
    dependent: np.ndarray  # (M,) int64 rows that wait for a carrier (candidates.charge_fixed); empty: dense
    carrier: np.ndarray  # (M,) int64 the carrier row of each dependent row

    @classmethod
    def build(cls, cols: dict[str, Any], **derived: Any) -> Candidates:
        """From the fetched columns (position, tensor_idx, block_idx, free) and the derived ones."""
        if not np.all(derived["score"] >= 0):  # NaN fails too; the buckets need scores ≥ 0
            raise PlanError("internal error: a candidate's score is negative or NaN; nothing was stored")
        return cls(**cols, **derived)

    def without(self, drop: np.ndarray) -> Candidates:
        """These candidates less the rows where `drop` (N,) bool is set; dependent/carrier pairs
        follow their rows (a pair loses a dropped dependent; a dropped carrier drops its dependents,
        which the caller must drop too)."""
        keep = ~drop
        new_row = np.cumsum(keep) - 1  # (N,) each kept row's index after the cut
        pairs = keep[self.dependent]
        if np.any(pairs & ~keep[self.carrier]):
            raise PlanError("internal error: a candidate kept without its fixed-cost carrier; nothing was stored")
        arrays = {f: getattr(self, f)[keep] for f in _ROW_FIELDS}
        return replace(self, **arrays, dependent=new_row[self.dependent[pairs]], carrier=new_row[self.carrier[pairs]])

    def slot(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows),) int64 position·B + gblock of `rows`: (position, tensor_idx, block_idx) as one key."""
        return self.position[rows].astype(np.int64) * self.n_family_blocks + self.gblock[rows]


_ROW_FIELDS = ("position", "tensor_idx", "block_idx", "nbytes", "free", "value", "score", "gblock")


def _plan_order(c: Candidates, rows: np.ndarray) -> np.ndarray:
    """`rows` in plan order: score DESC, then slot."""
    return rows[np.lexsort((c.slot(rows), -c.score[rows]))]


def select(c: Candidates, budget: int, max_passes: int, *, sort_max: int = SORT_MAX) -> tuple[np.ndarray, int]:
    """The greedy's selection as a bool array, and the number of fill passes run. Up to `sort_max`
    non-free candidates, one sort of them in plan order gives the cut (the longest prefix that fits)
    and the fill's pool; above it, the score buckets (module note) spare sorting them all. Both
    give the same selection."""
    nonfree = ~c.free
    sel = np.zeros(c.score.size, bool)
    pool = None
    if int(c.nbytes.sum()) - int(c.nbytes[c.free].sum()) <= budget:  # all fit (a full budget): no order needed
        sel, pool = nonfree, np.zeros(0, np.int64)  # (sorting 17k candidates cost a small plan ~0.6 ms)
    elif np.count_nonzero(nonfree) <= sort_max:
        pool = _plan_order(c, np.flatnonzero(nonfree))
        sel[pool[np.cumsum(c.nbytes[pool]) <= budget]] = True  # nbytes ≥ 0: the cumsum is monotone
    elif c.score.size >= COMPILED_MIN_ROWS:
        _bucket_cut_compiled(c, budget, sel)
    elif nonfree.any():  # whole-array passes, no index arrays
        bucket = c.score.view(np.int64) >> _BUCKET_SHIFT  # (N,) monotone in the score (scores ≥ 0)
        bucket -= bucket.min()
        per_bucket = np.bincount(bucket, weights=np.where(nonfree, c.nbytes, 0.0))  # exact below 2^53
        from_top = np.cumsum(per_bucket[::-1])[::-1]  # bytes in this bucket and every better one
        over = np.flatnonzero(from_top > budget)
        if not over.size:
            sel = nonfree
        else:
            cut = int(over[-1])
            np.greater(bucket, cut, out=sel)
            sel &= nonfree
            edge = _plan_order(c, np.flatnonzero((bucket == cut) & nonfree))
            room = budget - int(c.nbytes[sel].sum())
            sel[edge[np.cumsum(c.nbytes[edge]) <= room]] = True
    passes = _fill(c, sel, budget, max_passes, pool)
    if np.any(sel[c.dependent] & ~sel[c.carrier]):  # cannot happen by construction (see the module note)
        raise PlanError("internal error: a block was selected without its fixed-cost carrier; nothing was stored")
    return sel, passes


def _bucket_cut_compiled(c: Candidates, budget: int, sel: np.ndarray) -> None:
    """Steps (1) and (2) of the module note in three compiled passes (planpass.py), into `sel`:
    buckets counted from the lowest non-free one (the free ones carry no bytes), int64 byte sums."""
    from . import planpass

    bits = c.score.view(np.int64)
    lo, hi = planpass.bucket_range(bits, c.free)
    if hi < lo:  # every candidate is free
        return
    per_bucket, per_count = np.zeros(hi - lo + 1, np.int64), np.zeros(hi - lo + 1, np.int64)
    planpass.bucket_bytes(bits, c.free, c.nbytes, lo, per_bucket, per_count)
    from_top = np.cumsum(per_bucket[::-1])[::-1]  # bytes in this bucket and every better one
    over = np.flatnonzero(from_top > budget)
    if not over.size:
        np.logical_not(c.free, out=sel)
        return
    cut = int(over[-1])
    edge = np.empty(int(per_count[cut]), np.int64)  # (rows of the cut bucket,) ascending
    room = budget - int(planpass.cut_rows(bits, c.free, c.nbytes, lo, cut, sel, edge))
    edge = _plan_order(c, edge)
    sel[edge[np.cumsum(c.nbytes[edge]) <= room]] = True


def _fill(c: Candidates, sel: np.ndarray, budget: int, max_passes: int, order: np.ndarray | None = None) -> int:
    """Fill passes (see the module note) until one adds nothing; updates `sel` in place. `order`:
    the non-free candidates in plan order when the caller has them already (else sorted here)."""
    if order is not None:  # a subsequence of the plan order stays in plan order
        left, pool = budget - int(c.nbytes[sel].sum()), order
    elif c.score.size >= COMPILED_MIN_ROWS:  # no (N,) temporaries: 0.4–0.6 s of fresh pages at 35M rows
        from . import planpass

        left, rows = planpass.fill_pool(sel, c.free, c.nbytes, budget)
        left, pool = int(left), _plan_order(c, rows)
    else:
        left = budget - int(c.nbytes[sel].sum())
        pool = _plan_order(c, np.flatnonzero(~sel & ~c.free & (c.nbytes <= left)))
    mark = np.zeros(c.score.size if c.dependent.size else 0, bool)  # (N,) scratch, only with carriers
    for n in range(max_passes):
        pool = pool[~sel[pool] & (c.nbytes[pool] <= left)]
        if c.dependent.size:  # drop dependents whose carrier is neither taken nor in the pool
            mark[pool] = True
            waiting = c.dependent[~sel[c.carrier] & ~mark[c.carrier]]
            mark[pool] = False
            mark[waiting] = True
            pool = pool[~mark[pool]]
            mark[waiting] = False
        take = pool[np.cumsum(c.nbytes[pool]) <= left]
        if not take.size:
            return n + 1
        sel[take] = True
        left -= int(c.nbytes[take].sum())
    raise PlanError(
        f"internal error: the budget fill did not settle in {max_passes} passes; nothing was stored. "
        "Please report this with the catalog's `mergedb sql 'SELECT count(*) FROM expert_blocks'`"
    )


@dataclass(frozen=True)
class Bounds:
    """Selected and full bytes and the omitted-update bounds, per expert position and overall.

    For additive methods value = |c_k|·‖Δ_kb‖, so ‖θ_B − θ_F‖ ≤ Σ_omitted value (triangle
    inequality) = bound_sum, and blocks are disjoint, so ≤ sqrt(Σ_b (Σ_k omitted value)²) =
    bound_blockwise, which is tighter. Per position, bound_blockwise = sqrt(Σ omitted value²).
    Sums run in the candidates' order (as SQL's parallel sums did: the last bits may vary)."""

    bound_sum: float
    bound_blockwise: float
    selected_bytes: int
    full_bytes: int
    n_selected: int
    n_free: int
    per_position: tuple[tuple[float, float, int, int], ...]  # (bound_sum, bound_blockwise, selected, full)
    omitted_per_block: np.ndarray  # (n_blocks,) Σ_k omitted value of each family block


def _sums_by(key: np.ndarray, weights: list[np.ndarray], n: int) -> list[np.ndarray]:
    """Σ of each weight array per key value 0..n-1 (np.bincount), converting `key` to the index
    type once instead of once per sum."""
    key = key.astype(np.intp, copy=False)
    return [np.bincount(key, weights=w, minlength=n) for w in weights]


def bounds(c: Candidates, sel: np.ndarray, n_positions: int, n_blocks: int) -> Bounds:
    if c.score.size >= COMPILED_MIN_ROWS:
        return _bounds_compiled(c, sel, n_positions, n_blocks)
    v = np.where(sel, 0.0, c.value)  # (N,) omitted value
    sel_bytes = np.where(sel, c.nbytes, 0.0)  # float64: exact below 2^53
    v_sum, v_sq, s_bytes, f_bytes = _sums_by(c.position, [v, np.square(v), sel_bytes, c.nbytes], n_positions)
    (omitted_per_block,) = _sums_by(c.gblock, [v], n_blocks)
    counts = (int(c.nbytes[sel].sum()), int(c.nbytes.sum()), int(np.count_nonzero(sel)), int(np.count_nonzero(c.free)))
    return _bounds(float(v.sum()), omitted_per_block, counts, (v_sum, v_sq, s_bytes, f_bytes))


def _bounds_compiled(c: Candidates, sel: np.ndarray, n_positions: int, n_blocks: int) -> Bounds:
    """bounds() in one compiled pass (planpass.bound_rows): the same sums in the same order."""
    from . import planpass

    v = freshmem.empty(c.score.size, np.float64)  # (N,) omitted value: v.sum() is numpy's pairwise sum, as above
    v_sum, v_sq, s_bytes, f_bytes = (np.zeros(n_positions, np.float64) for _ in range(4))  # (K,) each
    omitted_per_block = np.zeros(n_blocks, np.float64)
    rows = (c.position, c.gblock, c.value, c.nbytes, sel, c.free)
    counts = planpass.bound_rows(*rows, v, v_sum, v_sq, s_bytes, f_bytes, omitted_per_block)
    return _bounds(float(v.sum()), omitted_per_block, tuple(int(x) for x in counts), (v_sum, v_sq, s_bytes, f_bytes))


def _bounds(bound_sum: float, omitted_per_block: np.ndarray, counts: tuple, per: tuple) -> Bounds:
    """Bounds from the sums: counts (selected bytes, full bytes, selected, free), per position (Σv, Σv², selected
    bytes, full bytes)."""
    v_sum, v_sq, s_bytes, f_bytes = per
    return Bounds(
        bound_sum=bound_sum,
        bound_blockwise=float(np.sqrt(np.dot(omitted_per_block, omitted_per_block))),
        selected_bytes=counts[0],
        full_bytes=counts[1],
        n_selected=counts[2],
        n_free=counts[3],
        per_position=tuple(
            (float(a), float(b), int(s), int(f)) for a, b, s, f in zip(v_sum, np.sqrt(v_sq), s_bytes, f_bytes)
        ),
        omitted_per_block=omitted_per_block,
    )


def block_sums(c: Candidates, sel: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per family block: Σ_k value (the whole update's norm bound there) and whether some non-free
    candidate is omitted (the block can differ from the full merge)."""
    if c.score.size >= COMPILED_MIN_ROWS:
        from . import planpass

        per_block, differs = np.zeros(n_blocks, np.float64), np.zeros(n_blocks, bool)
        planpass.block_rows(c.gblock, c.value, sel, c.free, per_block, differs)
        return per_block, differs
    left = ~sel & ~c.free
    return np.bincount(c.gblock, weights=c.value, minlength=n_blocks), np.bincount(
        c.gblock[left], minlength=n_blocks
    ) > 0


_DIGEST_CHUNK = 1 << 22  # bits per step of bits_digest: a few MB of keys at a time, reused, not 35M-row arrays


def bits_digest(chars: np.ndarray, first_block: np.ndarray, chunk: int = _DIGEST_CHUNK) -> str:
    """mask_digest of the selected (position, tensor_idx, block_idx) in bit_strings' chars, without
    building the three key columns: each column is fed to the hash in chunks of positions,
    recomputed per column (a plan selecting 17M blocks would otherwise allocate ~0.7 GB of fresh
    keys, whose page faults cost more than the hashing)."""
    n_blocks = int(first_block[-1])
    m = chars.reshape(-1, n_blocks) if n_blocks else chars.reshape(0, 0)
    tensor_of = np.repeat(np.arange(first_block.size - 1, dtype=np.int64), np.diff(first_block))
    h = hashlib.sha256()
    if chars.size >= COMPILED_MIN_ROWS and n_blocks:  # one compiled scan per column into one reused buffer
        from . import planpass

        out = np.empty(min(chunk, chars.size), "<i8")
        for col in range(3):
            at = 0
            while at < chars.size:
                n, at = planpass.key_rows(chars, at, n_blocks, tensor_of, first_block, col, out)
                h.update(out[:n])
        return h.hexdigest()
    step = max(1, chunk // max(n_blocks, 1))
    for col in range(3):  # position, tensor_idx, block_idx: one column after the other
        for lo in range(0, m.shape[0], step):
            pos, g = np.nonzero(m[lo : lo + step] == ord("1"))  # row-major: sorted by (position, block)
            key = pos + lo if col == 0 else tensor_of[g] if col == 1 else g - first_block[tensor_of[g]]
            h.update(np.ascontiguousarray(key, dtype="<i8"))
    return h.hexdigest()


def bits_digest_later(chars: np.ndarray, first_block: np.ndarray) -> Callable[[], str]:
    """bits_digest, on a thread of its own for large plans: returns a call that waits for it. Its
    compiled scan and sha256's updates release the GIL, so on a 50% plan of 35M candidates the
    ~0.5 s of hashing runs beside the bounds and the catalog inserts instead of before them."""
    if chars.size < COMPILED_MIN_ROWS:
        digest = bits_digest(chars, first_block)
        return lambda: digest
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["digest"] = bits_digest(chars, first_block)
        except BaseException as e:  # handed to the caller by result()
            box["error"] = e

    worker = threading.Thread(target=run, name="mergedb-mask-digest", daemon=True)
    worker.start()

    def result() -> str:
        worker.join()
        if "error" in box:
            raise box["error"]
        return box["digest"]

    return result


def mask_digest(position: np.ndarray, tensor_idx: np.ndarray, block_idx: np.ndarray) -> str:
    """sha256 over the selected (position, tensor_idx, block_idx), sorted, as little-endian int64,
    one column after the other: manifest.mask_digest's definition, on arrays already sorted."""
    h = hashlib.sha256()
    for col in (position, tensor_idx, block_idx):
        h.update(np.ascontiguousarray(col, dtype="<i8").tobytes())
    return h.hexdigest()


def bit_strings(c: Candidates, sel: np.ndarray, n_positions: int, first_block: np.ndarray) -> tuple[np.ndarray, ...]:
    """The mask as one '0'/'1' string per (position, tensor): character b is block b (the BIT of
    schema/010). Returns `present` (K·T,) bool (the pair has candidates: only those are stored),
    `offsets` (K·T + 1,) int64 and the uint8 `chars`: pair g = position·T + tensor_idx is
    chars[offsets[g]:offsets[g + 1]] (the layout of an Arrow large_string array)."""
    n_tensors = first_block.size - 1
    n_blocks = int(first_block[-1])
    chars = np.full(n_positions * n_blocks, ord("0"), np.uint8)
    present = np.zeros(n_positions * n_tensors, bool)
    if c.score.size >= COMPILED_MIN_ROWS:
        from . import planpass

        planpass.bit_rows(c.position, c.tensor_idx, c.gblock, sel, n_blocks, n_tensors, chars, present)
    else:
        chars[c.slot(np.flatnonzero(sel))] = ord("1")
        present[c.position.astype(np.int64) * n_tensors + c.tensor_idx] = True
    offsets = (np.arange(n_positions, dtype=np.int64)[:, None] * n_blocks + first_block[None, :-1]).reshape(-1)
    return present, np.append(offsets, n_positions * n_blocks), chars
