"""A model of TIES-style merges under partial reads, from the catalog's block statistics alone.

TIES (and dare_ties, breadcrumbs_ties, della) merge each element i of a block as
    m_i(A) = λ · Σ_{k∈A, agree} w_k τ_ki / Σ_{k∈A, agree} w_k        (normalize; without it, no divisor)
over the experts A whose block is read, τ_k the trimmed (or dropped and rescaled) delta, "agree" =
sign(τ_ki) equals the elected sign(Σ_{k∈A} w_k τ_ki). That is not a sum of per-expert terms: leaving
expert k's block out changes the divisor and can flip the election for every element of the block,
so |c_k|·‖τ_kb‖ (the additive planner's value) says little about what reading it is worth. A small
expert sharing elements with a large one halves the large one's contribution, so leaving the small
one out moves the merge by about the *large* one's size.

The model. Inside block b, element i of expert k's τ is non-zero with probability p_kb (the fraction
of the block's elements the trim keeps, from the block histogram: queries/plan_consensus_stats.sql;
× the keep probability for random drops), independently across experts and elements, with a random
sign and a magnitude drawn from a lognormal matched to the kept elements' mean μ_kb = Σ|τ|/kept and
RMS a_kb = sqrt(Στ²/kept) (rescaled by 1/p for DARE/DELLA). Expectations over elements are taken by
Monte Carlo with R fixed draws per block, shared by every block (common random numbers: the same
seed, so plans repeat exactly; the support draws are stratified, a Latin hypercube per expert).
From it, per block b:

- `leave_one_out` (the "consensus" value of candidate (k, b)): sqrt(n_b · E[(m_i(all) − m_i(all∖k))²]),
  the change in the full merge's block when k's block alone is left out. Computed for every k at once
  from the block's running totals (Σ w τ over positive and negative τ, and their weights), with k's
  element forced non-zero and the result scaled by p_kb (k changes nothing where its τ is zero), so
  an expert that keeps few elements of a block is still valued without rare-event noise.
- `deviation` (the plan's estimate for these methods): sqrt(Σ_b n_b · E[(m_i(A_b) − m_i(all))²])
  for the read sets A_b the plan chose, blocks that read every expert counting 0.

Assumptions, where real families may differ: signs independent across experts (fine-tunes of one
base on different tasks are close to it; correlated deltas would need the sketches' ⟨Δ_j, Δ_k⟩),
elements independent, magnitudes lognormal. benchmarks/bench_rules.py and tests/test_rules.py
measure the estimate against executed merges.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa

from . import bounds, methods
from .candidates import histogram_bins, pair_trims
from .resources import positions, statement
from .tensorparams import TensorValues

DRAWS = 256  # Monte Carlo elements per block
_SEED = 20261130
_CHUNK = 1 << 18  # entries of a (blocks, draws, experts) working array


@dataclass(frozen=True)
class Model:
    """Per (expert position, family block), what the model draws from; arrays (K, B)."""

    p: np.ndarray  # probability an element's τ is non-zero
    mu: np.ndarray  # mean |τ| of a non-zero element (after any 1/p rescale)
    sigma: np.ndarray  # lognormal spread of |τ|: sigma² = log(RMS² / mean²)
    w: np.ndarray  # election weight w_k of the block's tensor
    lam: np.ndarray  # (B,) λ of the block's tensor
    numel: np.ndarray  # (B,) elements per block
    normalize: bool  # divide by the agreeing weights


def fetch(
    con: duckdb.DuckDBPyConnection,
    method: methods.Method,
    values: TensorValues,
    params: dict,
    ids: tuple[int, ...],
    trims: pa.Table,
    fam: bounds.FamilyBlocks,
    drop_nonfinite: bool,
) -> Model:
    """The model's inputs for a plan's experts (queries/plan_consensus_stats.sql), one scan."""
    t = con.sql(
        positions(2) + statement("plan_consensus_stats"), params=[drop_nonfinite, list(ids), list(range(len(ids)))]
    ).to_arrow_table()
    k, nb = len(ids), int(fam.first_block[-1])
    n_tensors = fam.first_block.size - 1
    pos = t.column("position").to_numpy().astype(np.int64)
    tix = t.column("tensor_idx").to_numpy()
    g = fam.first_block[tix] + t.column("block_idx").to_numpy()
    trim_lo, trim_hi = pair_trims(trims, list(ids), n_tensors)
    pair = pos * n_tensors + tix
    col = {c: t.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in ("nnz", "norm")}
    col["kept"], col["kept_abs"], col["kept_sq"] = kept_stats(t, trim_lo[pair], trim_hi[pair])
    keep = np.ones(pos.size)  # probability a kept element survives a random drop
    if method.sparsify in ("random", "della"):  # DARE, DELLA: every non-zero element, kept with p ≈ density
        keep = values.density[pos, tix]
        kept, kept_abs, kept_sq = col["nnz"], col["kept_abs"] / keep, col["kept_sq"] / keep**2
    else:
        kept, kept_abs, kept_sq = col["kept"], col["kept_abs"], col["kept_sq"]
    p, mu, sigma = np.zeros((k, nb)), np.zeros((k, nb)), np.zeros((k, nb))
    ok = kept > 0
    numel = fam.numel
    p[pos[ok], g[ok]] = np.minimum(kept[ok] * keep[ok] / numel[g[ok]], 1.0)
    mu[pos[ok], g[ok]] = kept_abs[ok] / kept[ok]
    ratio = kept_sq[ok] * kept[ok] / np.maximum(kept_abs[ok] ** 2, 1e-300)  # RMS² / mean² ≥ 1
    sigma[pos[ok], g[ok]] = np.sqrt(np.log(np.maximum(ratio, 1.0)))
    lam = values.lam if values.lam is not None else np.ones(values.weight.shape[1])
    return Model(
        p=p,
        mu=mu,
        sigma=sigma,
        w=values.weight[:, fam.tensor_idx],
        lam=np.asarray(lam, np.float64)[fam.tensor_idx],
        numel=numel,
        normalize=bool(params.get("normalize", True)),
    )


def kept_stats(t: pa.Table, t_lo: np.ndarray, t_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n,) float64 elements the trim [t_lo, t_hi) keeps in each row's block, and their Σ|Δ| and ΣΔ²,
    from the row's histogram bins (plan_consensus_stats' hist_* columns): Σ_bins x · frac, frac the
    part of the bin [lo, hi) inside the trim (edge arithmetic in float32, as the stored edges and
    trims are), a zero-width bin 1 if lo lies inside; 0 for a block identical to the base. `t_lo`,
    `t_hi` (n,) float32, ±inf: no trim (candidates.pair_trims)."""
    names = ("hist_lo", "hist_hi", "hist_count", "hist_sum", "hist_sumsq")
    counts, (lo, hi, count, total, sq) = histogram_bins([t.column(c).combine_chunks() for c in names])
    row = np.repeat(np.arange(t.num_rows), counts)
    t_lo, t_hi = np.repeat(t_lo, counts), np.repeat(t_hi, counts)
    inside = np.minimum(hi, t_hi) - np.maximum(lo, t_lo)  # float32
    width = (hi - lo).astype(np.float64)
    frac = np.maximum(inside, 0).astype(np.float64)
    frac = np.divide(frac, width, out=np.zeros_like(frac), where=width > 0)
    zero_width = width <= 0  # kept if inside the band
    frac[zero_width] = ((lo >= t_lo) & (lo < t_hi))[zero_width]
    out = tuple(np.bincount(row, weights=x * frac, minlength=t.num_rows) for x in (count, total, sq))
    identical = t.column("identical").to_numpy(zero_copy_only=False)
    for x in out:
        x[identical] = 0.0
    return out  # type: ignore[return-value]


def _draws(k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R, K) support uniforms (a Latin hypercube per expert), signs ±1, standard normals."""
    rng = np.random.default_rng(_SEED)
    strata = np.argsort(rng.random((k, DRAWS)), axis=1).T  # (R, K) a permutation of 0..R-1 per expert
    u = (strata + rng.random((DRAWS, k))) / DRAWS
    sign = np.where(rng.random((DRAWS, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    return u, sign, rng.standard_normal((DRAWS, k)).astype(np.float32)


def _chunks(m: Model) -> list[slice]:
    k, nb = m.p.shape
    step = max(1, _CHUNK // (DRAWS * max(k, 1)))
    return [slice(a, min(a + step, nb)) for a in range(0, nb, step)]


def _per_block(a: np.ndarray, blocks: slice, dtype: type = np.float32) -> np.ndarray:
    """(b, 1, K) C-ordered from a (K, B) array: the (b, R, K) arrays computed from it are C-ordered
    too (a transposed view would make every one of them strided, ~4× slower to add and sum)."""
    return np.ascontiguousarray(a[:, blocks].T, dtype)[:, None, :]


def _values(m: Model, blocks: slice, draws: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(b, R, K) float32 τ drawn for `blocks`, and the same with every element non-zero (the draw's
    magnitude and sign: what k's element is where it is forced non-zero)."""
    u, sign, z = draws
    sig, mu = _per_block(m.sigma, blocks), _per_block(m.mu, blocks)
    forced = (sign[None] * mu) * np.exp(sig * z[None] - sig * sig / 2)
    return np.where(u[None] < _per_block(m.p, blocks, np.float64), forced, np.float32(0)), forced


def _merge(s: np.ndarray, n_pos: np.ndarray, d_pos: np.ndarray, n_neg: np.ndarray, d_neg: np.ndarray, norm: bool):
    """The merged element from running totals: Σ wτ, and Σ wτ, Σ w over positive and negative τ."""
    up = s >= 0
    num = np.where(up, n_pos, n_neg)
    if not norm:
        return num
    den = np.where(up, d_pos, d_neg)
    return num / np.where(den == 0, 1.0, den)  # mergekit's: only a zero divisor is 1


def _parts(x: np.ndarray, w: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, ...]:
    """(b, R, K) w·τ, and w·τ and w where `pos` / where `neg`, zero elsewhere (float32). Masks are
    multiplied in (np.where with a scalar costs ~9× a product) unless w·τ holds ±inf (a |Δ| near
    the float32 limit: inf · 0 would be NaN, not 0)."""
    wx = w * x
    if np.isfinite(wx).all():
        return wx, wx * pos, w * pos, wx * neg, w * neg
    zero = np.float32(0)
    return wx, np.where(pos, wx, zero), w * pos, np.where(neg, wx, zero), w * neg


def _sum(a: np.ndarray) -> np.ndarray:
    """Σ over the last (experts) axis as a matrix-vector product: numpy reduces a short last axis
    row by row, ~10× slower; the order of the additions is BLAS's, fixed for a machine."""
    return a @ np.ones(a.shape[-1], a.dtype)


def _totals(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, ...]:
    """The running totals _merge takes: Σ w τ, and Σ w τ, Σ w over positive and over negative τ."""
    return tuple(_sum(a) for a in _parts(x, w, x > 0, x < 0))


def leave_one_out(m: Model) -> np.ndarray:
    """(K, B) sqrt(n_b · E[(m(all) − m(all∖k))²]): the consensus value of each (expert, block)."""
    k, nb = m.p.shape
    out = np.zeros((k, nb))
    draws = _draws(k)
    for blocks in _chunks(m):
        w = _per_block(m.w, blocks)
        x, xf = _values(m, blocks, draws)  # (b, R, K)
        wx, pos_wx, pos_w, neg_wx, neg_w = parts = _parts(x, w, x > 0, x < 0)
        tot = [_sum(a)[..., None] for a in parts]  # (b, R, 1) each
        posf = xf > 0
        wxf, posf_wxf, posf_w, negf_wxf, negf_w = _parts(xf, w, posf, ~posf)
        # totals without k (k's drawn τ removed), then with k's element forced non-zero
        s, n_pos, d_pos, n_neg, d_neg = tot[0] - wx, tot[1] - pos_wx, tot[2] - pos_w, tot[3] - neg_wx, tot[4] - neg_w
        without = _merge(s, n_pos, d_pos, n_neg, d_neg, m.normalize)
        with_k = _merge(s + wxf, n_pos + posf_wxf, d_pos + posf_w, n_neg + negf_wxf, d_neg + negf_w, m.normalize)
        msq = np.square(with_k - without).mean(axis=1, dtype=np.float64).T  # (K, b)
        out[:, blocks] = msq * m.p[:, blocks] * (m.numel[blocks] * m.lam[blocks] ** 2)[None, :]
    return np.sqrt(out)


def deviation(m: Model, read: np.ndarray) -> float:
    """sqrt(Σ_b n_b · E[(m(A_b) − m(all))²]) for the read sets `read` (K, B) bool."""
    k, _ = m.p.shape
    partial = ~read.all(axis=0) & (m.p > 0).any(axis=0)  # (B,) blocks that can differ from the full merge
    total = 0.0
    draws = _draws(k)
    for blocks in _chunks(m):
        if not partial[blocks].any():
            continue
        w = _per_block(m.w, blocks)
        x = _values(m, blocks, draws)[0]
        full = _merge(*_totals(x, w), m.normalize)
        r = _per_block(read, blocks, bool)  # the experts read in each block
        got = _merge(*_totals(x * r if np.isfinite(x).all() else np.where(r, x, np.float32(0)), w), m.normalize)
        msq = np.square(got - full).mean(axis=1, dtype=np.float64)  # (b,)
        total += float(np.sum(msq * m.numel[blocks] * m.lam[blocks] ** 2))
    return float(np.sqrt(total))
