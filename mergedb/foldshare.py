"""Shared folds: plans of a sweep whose folds are identical fold each block once.

A fused merge of one block is two steps (merger.py): `kernels.fold_group` reads the selected expert
blocks and folds them into running sums, and `kernels.finish` turns the sums into the output (λ,
TIES' normalize, the base scale, the output dtype's rounding). Plans whose fold reads the same
things get the same sums bit for bit, so a sweep folds each block once per group of such plans
and every plan of the group finishes its own output from those sums: every output is still
exactly the plan's alone. A grid of 4 densities × 2 λ of TIES is 4 groups of 2 plans, and the 4
groups fold together in one pass (below).

The grouping key (`FoldKey`) is what `fold_group` and the unit list read, and nothing else:

- the method's trim or drop (`Method.sparsify`) and whether it sums for sign consensus;
- the base and the experts in plan order (name, path, fingerprint);
- the mask (`manifest.mask_digest`: the selected (position, tensor, block));
- the trims (thresholds, DELLA's rank tables) and, per selected (expert, tensor), the factor folded
  in (the weight for consensus methods, the coefficient c_k otherwise: for additive methods λ and
  normalize are inside c_k, so their λ grids do not share), the keep probability and ε of DARE and
  DELLA, and their seed; per tensor the base scale (which blocks are computed); hashed into `inputs`;
- the output dtype asked for (which blocks are computed).

Left out, because only `kernels.finish` reads them: λ of consensus methods, `normalize` of consensus
methods. model_stock (its scale needs the whole tensor's dots) and the per-step path have no key:
each such plan folds alone.

Plans that share a mask but differ in a trim or a weight (two TIES densities) are two groups, but
TIES-style groups (magnitude or band trims, sign consensus) over one mask, base, expert order, base
scales and output dtype form one set (`mask_sets`) and fold each block in one pass: every expert
block decoded once and added into each group's sums with that group's trims and weights
(kernels.fold_many, bit-identical to a fold per group). DARE and DELLA groups do not (their keep
probabilities enter the draws).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import kernels, methods
from .manifest import ExecutionPlan, mask_digest
from .merger import Bands, Fold, FoldBlock
from .tensorfile import normalize_dtype


@dataclass(frozen=True)
class FoldKey:
    """What a plan's fold reads: plans with equal keys fold every block to the same sums."""

    sparsify: str  # Method.sparsify: none | magnitude | band | random | della
    consensus: bool  # sign-consensus sums (5 per element) or weighted sums (1)
    base: tuple[str, str]  # (path, fingerprint)
    experts: tuple[tuple[str, str, str], ...]  # (name, path, fingerprint) in plan order
    mask: str  # mask_digest of the selected (position, tensor, block)
    inputs: str  # sha256 of trims, folded factors, DARE/DELLA p, ε and seed, base scales
    dtype: str | None  # output dtype asked for (None: each tensor's own)


def fold_key(xp: ExecutionPlan, dtype: str | None = None) -> FoldKey | None:
    """The plan's FoldKey, or None when its blocks are not folded by `fold_group` (model_stock, or
    a method the fused kernels lack): such a plan shares no fold."""
    m = methods.get_method(xp.method)
    if m.sparsify not in kernels.MODE or xp.method == "model_stock":
        return None
    random = m.draws
    values, defaults = xp.tensor_values(), [xp.default_values(p) for p in range(len(xp.experts))]
    pairs = sorted(set(zip(xp.mask.column("position").to_pylist(), xp.mask.column("tensor_idx").to_pylist())))
    folded = []
    for pos, ti in pairs:
        v = values.get((pos, ti)) or defaults[pos]
        folded.append([pos, ti, v.weight if m.consensus else v.coef, *((v.density, v.epsilon) if random else ())])
    scales = [(values.get((0, ti)) or defaults[0]).base_scale for ti in range(len(xp.tensors))]
    trims = sorted(xp.trims.to_pylist(), key=lambda r: (r["position"], r["tensor_idx"]))
    doc = {"trims": trims, "folded": folded, "scales": scales, "seed": xp.seed if random else None}
    inputs = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()
    return FoldKey(
        m.sparsify,
        m.consensus,
        (xp.base.path, xp.base.fingerprint),
        tuple((e.name, e.path, e.fingerprint) for e in xp.experts),
        mask_digest(xp.mask),
        inputs,
        normalize_dtype(dtype),
    )


def fold_groups(xps: Sequence[ExecutionPlan], dtypes: Sequence[str | None]) -> list[list[int]]:
    """Indices of `xps` grouped by FoldKey, in order of first appearance; a plan without a key alone."""
    groups: dict[object, list[int]] = {}
    for i, (xp, dt) in enumerate(zip(xps, dtypes)):
        key = fold_key(xp, dt)
        groups.setdefault(i if key is None else key, []).append(i)
    return list(groups.values())


MAX_SET = 4  # fold groups per pass: G sets of sums per chunk must stay in cache (measured 0.6× the CPU
# of 4 folds at G = 4; at G = 16 the one-pass sweep of 32 merges used more CPU than 16 folds)


def mask_sets(xps: Sequence[ExecutionPlan], dtypes: Sequence[str | None], groups: list[list[int]]) -> list[list[int]]:
    """Fold groups (indices into `groups`) whose folds differ only in their trims and weights, grouped:
    TIES-style magnitude or band trims with sign consensus over one mask, base, expert order, base
    scales and output dtype. Such groups fold each block together (kernels.fold_many): each
    expert block decoded once for all their trims, at most MAX_SET groups a set. Any other group is
    a set of its own."""
    sets: dict[object, list[int]] = {}
    for g, js in enumerate(groups):
        key = fold_key(xps[js[0]], dtypes[js[0]])
        if key is None or not key.consensus or key.sparsify not in ("magnitude", "band"):
            sets[("alone", g)] = [g]
            continue
        xp = xps[js[0]]
        values, defaults = xp.tensor_values(), [xp.default_values(p) for p in range(len(xp.experts))]
        scales = tuple((values.get((0, ti)) or defaults[0]).base_scale for ti in range(len(xp.tensors)))
        sets.setdefault((key.sparsify, key.base, key.experts, key.mask, key.dtype, scales), []).append(g)
    return [gs[i : i + MAX_SET] for gs in sets.values() for i in range(0, len(gs), MAX_SET)]


def bands(xp: ExecutionPlan) -> Bands:
    """A TIES-style plan's (weight, lo, hi) of every (tensor, expert position), each a (T, K) array:
    what `fold_group` mode 1 receives (weights float32, keep lo ≤ |Δ| < hi, float64)."""
    shape = (len(xp.tensors), len(xp.experts))
    w, lo, hi = np.zeros(shape, np.float32), np.zeros(shape), np.full(shape, np.inf)
    values, defaults = xp.tensor_values(), [xp.default_values(p) for p in range(len(xp.experts))]
    for ti in range(shape[0]):
        for pos in range(shape[1]):
            w[ti, pos] = (values.get((pos, ti)) or defaults[pos]).weight
    for r in xp.trims.to_pylist():  # as Merger._make_trim: no row keeps everything
        lo[r["tensor_idx"], r["position"]] = r["t_lo"] or 0.0
        hi[r["tensor_idx"], r["position"]] = np.inf if r["t_hi"] is None else r["t_hi"]
    return w, lo, hi


class _Entry:
    def __init__(self, left: int, sums: np.ndarray) -> None:
        self.ready = threading.Event()
        self.sums = sums  # the folded sums, read by every plan of the group
        self.ok = False  # set before `ready`: False means the fold failed, fold it yourself
        self.left = left  # plans of the group that have not finished from it yet


class SharedFolds:
    """Block sums folded once per set of fold groups and finished from by every plan of the set.

    `sets` lists fold groups (indices) that fold together (`mask_sets`; most sets are one group);
    `sizes[g]` is group g's plan count; `bands[g]` its (weight, lo, hi) where its set has several
    groups. The first plan of a set to reach a block folds it into a buffer of the set's (the
    group's (rows, n) sums, or (G, rows, n) for G groups through `fold(buf, bands)`), finishes its
    own output from its group's sums and leaves the buffer to the set's other plans, which finish
    from the same memory (`kernels.finish` only reads it: no copy); the last one to finish returns
    the buffer to a free list (fresh buffers of this size cost a page fault per 4 KiB). The
    buffers held are capped at `cap` bytes: a block beyond it is folded by each plan that reaches
    it with its own trims (correct, only slower; `refolds` counts them)."""

    def __init__(
        self, sizes: Sequence[int], cap: int, sets: Sequence[Sequence[int]] | None = None, bands: dict | None = None
    ) -> None:
        self.cap, self.bands = cap, bands or {}
        self.sets = [list(s) for s in sets] if sets is not None else [[g] for g in range(len(sizes))]
        self.where = {g: (d, q) for d, gs in enumerate(self.sets) for q, g in enumerate(gs)}
        self.sizes = [sum(sizes[g] for g in gs) for gs in self.sets]  # plans per set
        self.entries: dict[tuple[int, int, int], _Entry] = {}
        self.seen: Counter[tuple[int, int, int]] = Counter()
        self.free: list[np.ndarray] = []  # flat float32 buffers no entry uses
        self.lock = threading.Lock()
        self.held = self.peak = 0  # bytes of buffers in use by entries, and their most
        self.folds = self.shared = self.refolds = 0

    def plans(self, group: int) -> int:
        """Plans that share the folds of fold group `group` (its set's)."""
        return self.sizes[self.where[group][0]]

    def block(self, group: int) -> FoldBlock:
        """Group `group`'s fold_block (see merger.FoldBlock)."""
        d, q = self.where[group]
        return lambda ti, b, acc, fold, finish: self.fold((d, ti, b), acc, fold, finish, q)

    def fold(
        self,
        key: tuple[int, int, int],
        acc: np.ndarray,
        fold: Fold,
        finish: Callable[[np.ndarray], None],
        q: int = 0,
    ) -> bool:
        gs = self.sets[key[0]]
        many = len(gs) > 1
        n = acc.nbytes * len(gs)
        with self.lock:
            self.seen[key] += 1
            left = self.sizes[key[0]] - self.seen[key]
            e = self.entries.get(key)
            mine = e is None and left > 0 and self.held + n <= self.cap
            if mine:
                e = self.entries[key] = _Entry(left + 1, self._buffer(((len(gs),) if many else ()) + acc.shape))
                self.held += n
                self.peak = max(self.peak, self.held)
            if e is None:
                self.folds += 1
                self.refolds += self.seen[key] > 1
        if e is None:  # alone, the last to come after the sums went, or they do not fit
            fold(acc)
            finish(acc)
            return True
        if mine:
            try:
                if many:
                    ti = key[1]
                    fold(e.sums, tuple(np.stack([self.bands[g][i][ti] for g in gs]) for i in range(3)))
                else:
                    fold(e.sums)
                e.ok = True
                with self.lock:
                    self.folds += 1
            finally:
                e.ready.set()
                if not e.ok:
                    self._drop(key, e)
            self._finished(key, e, finish, q if many else None)
            return True
        e.ready.wait()
        if not e.ok:  # the folding plan failed: fold here
            fold(acc)
            finish(acc)
            return True
        with self.lock:
            self.shared += 1
        self._finished(key, e, finish, q if many else None)
        return False

    def _buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 buffer of `shape`, from the free list when one is large enough (under the lock)."""
        size = int(np.prod(shape))
        for i, buf in enumerate(self.free):
            if buf.size >= size:
                return self.free.pop(i)[:size].reshape(shape)
        return np.empty(shape, np.float32)

    def _finished(
        self, key: tuple[int, int, int], e: _Entry, finish: Callable[[np.ndarray], None], q: int | None
    ) -> None:
        try:
            finish(e.sums if q is None else e.sums[q])
        finally:
            with self.lock:
                e.left -= 1
                last = e.left <= 0
            if last:
                self._drop(key, e)

    def _drop(self, key: tuple[int, int, int], e: _Entry) -> None:
        with self.lock:
            if self.entries.get(key) is e:
                del self.entries[key]
                self.held -= e.sums.nbytes
                base = e.sums.base if e.sums.base is not None else e.sums
                if len(self.free) < len(self.sets) * 4:  # a few per set: what is in flight at once
                    self.free.append(base.reshape(-1))
