"""Plans whose unit is a whole tensor (methods.Method.unit "tensor": model_stock).

model_stock's scale t = K·cos/(1 + (K−1)·cos) of a tensor needs every pairwise dot ⟨Δ_j, Δ_k⟩ of the
experts' task vectors over the whole tensor. Planned block by block, the dots over blocks not read by
both experts came from the catalog's sketches, and near cos = 0 (where t is steep) their noise moved
t by 0.1–0.5: the budgeted merge could land farther from the full merge than the base itself
(benchmarks/ANALYSIS.md, 2026-12-02). Planned by tensors, either every expert's every non-free block
of a tensor is read, or none of the tensor is:
- a read tensor's dots are all exact (a pair not both read meets only at blocks where one delta is
  0, whose sketch is 0), so the executor computes the full merge's t and writes the full merge's
  tensor, bit for bit;
- an omitted tensor keeps the base's bytes.
So θ_B − θ_F is minus the omitted tensors' full updates u_t = t_t·Σ_k Δ_kt/K, exactly:
‖θ_B − θ_F‖² = Σ_omitted ‖u_t‖² ≤ ‖θ_F − θ_0‖², whatever the sketches say.

Selection (`select`): one group per tensor that has non-free candidates; its bytes are the sum of
those candidates' bytes (every expert's blocks, an adapter's fixed bytes once, as charged to its
carrier), its value the estimated ‖u_t‖ (`updates`), scored value / √bytes (the default value model
norm-sqrt: for disjoint units the greedy order that keeps Σ_omitted ‖u_t‖² small) or value / bytes
(norm); the random ablation scores a tensor by its first candidate's random score (lowest expert
position and block). greedy.select cuts the groups at the budget, so the bytes read stay within it,
and a budget that holds every group reads every non-free block: the full merge.

`updates`: ‖u_t‖ = √(E t_t²)·‖Σ_k Δ_k‖/K, with ‖Δ_k‖² exact (Σ_b ‖Δ_kb‖²) and ⟨Δ_j, Δ_k⟩ ≈
Σ_b ⟨SΔ_jb, SΔ_kb⟩ from the sketches (queries/plan_stock_sketches.sql). The sketched mean cosine ĉ
of a tensor has noise of variance σ² = Σ_b Σ_{j<k} a_jb·a_kb / (D·pairs²), a_kb = ‖Δ_kb‖²/‖Δ_k‖²
(D the sketch dimension), and near c = 0 that noise (~0.006 for 8 experts of 8 blocks at D = 64) can
exceed c itself, where t = K·c/(1 + (K−1)·c) is steep (slope K). Taken as it is, t̂ ranked such
tensors by their noise. So c is estimated across the model's tensors (empirical Bayes, normal
prior): μ and τ² the mean and the spread of the ĉ beyond the noise, c̄ = μ + w·(ĉ − μ) with
w = τ²/(τ² + σ²), Var(c | data) = w·σ², and E t² ≈ t(c̄)² + t'(c̄)²·w·σ². Where the tensors' cosines
differ by much more than the noise (w ≈ 1) this is t̂² plus the noise's share. t is capped at 1
(exact dots give t ≤ 1) and taken as 1 where c̄ is at or past −1/(K−1), which exact dots never reach.
The plan's estimate (est_kind `omitted tensors, sketched`) is √(Σ_omitted ‖u_t‖²): an expectation
that includes the sketch noise, so where the omitted tensors' updates are below what the sketches
resolve it is high: 1.7–2.9× on tests/test_stock_whole.py's family at 10–75%, 4.9–7.9× on
test_rules.py's (independent experts), 12–18× where the omitted updates are 0.4–2.5% of
‖θ_F − θ_0‖; never below 1.1× on the families measured (benchmarks/ANALYSIS.md, 2026-12-02).
"""

from __future__ import annotations

import math

import duckdb
import numpy as np

from . import bounds, candidates, greedy, resources

KIND = "omitted tensors, sketched"  # plans.est_kind of a tensor-unit plan's estimate
CHUNK_BYTES = 64 * 2**20  # updates(): blocks × K × sketch dimension float64 at a time


def updates(con: duckdb.DuckDBPyConnection, ids: tuple[int, ...], fam: bounds.FamilyBlocks, drop: bool) -> np.ndarray:
    """(T,) float64 estimated ‖u_t‖ of each tensor's full model_stock update (module note); `drop`:
    leave NaN/Inf blocks out (--allow-nonfinite). One tensor at a time, its blocks' sketches in
    chunks of at most CHUNK_BYTES: memory does not grow with the model's blocks × K."""
    k = len(ids)
    t = con.sql(
        resources.positions(2) + resources.statement("plan_stock_sketches"),
        params=[drop, [int(i) for i in ids], list(range(k))],
    ).to_arrow_table()
    tix = t.column("tensor_idx").to_numpy().astype(np.int64)
    bix = t.column("block_idx").to_numpy().astype(np.int64)
    order = np.lexsort((t.column("position").to_numpy(), bix, tix))  # by tensor, block, expert
    tix, bix = tix[order], bix[order]
    pos = t.column("position").to_numpy().astype(np.int64)[order]
    nsq = t.column("delta_norm").to_numpy()[order] ** 2  # (N,) ‖Δ_kb‖² of each changed (expert, block)
    dim = len(t.column("sketch")[0]) if t.num_rows else 1
    sk = t.column("sketch").combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, dim)[order]
    n_tensors = fam.first_block.size - 1
    pairs = max(k * (k - 1) // 2, 1)
    c, total, var = np.zeros(n_tensors), np.zeros(n_tensors), np.zeros(n_tensors)  # (T,) each
    cut = np.searchsorted(tix, np.arange(n_tensors + 1))  # rows of tensor i: cut[i]:cut[i + 1]
    per_chunk = max(1, CHUNK_BYTES // (k * dim * 8))  # blocks per (blocks, K, D) float64 chunk
    for ti in np.flatnonzero(np.diff(cut)):
        r0, r1 = int(cut[ti]), int(cut[ti + 1])
        n2 = np.bincount(pos[r0:r1], weights=nsq[r0:r1], minlength=k)  # (K,) exact ‖Δ_k‖²
        gram = np.zeros((k, k))  # sketched ⟨Δ_j, Δ_k⟩ over the tensor, summed chunk by chunk of its blocks
        local = bix[r0:r1] - bix[r0]  # block numbers from the tensor's first changed block
        chunk = local // per_chunk
        edges = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), r1 - r0]
        for lo, hi in zip(edges[:-1], edges[1:]):
            at = local[lo:hi] - local[lo]  # the chunk's blocks from its first
            dense = np.zeros((int(at[-1]) + 1, k, dim))  # (blocks, K, D) float64; 0 where unchanged
            dense[at, pos[r0 + lo : r0 + hi]] = sk[r0 + lo : r0 + hi]
            gram += np.einsum("bjd,bkd->jk", dense, dense)
        gram[np.eye(k, dtype=bool)] = n2  # the diagonal is known exactly
        den = np.sqrt(n2[:, None] * n2[None, :])
        cos = np.where(den > 0, gram / np.where(den > 0, den, 1.0), 0.0)
        c[ti] = (cos.sum() - np.trace(cos)) / 2 / pairs  # mean pairwise cosine
        total[ti] = max(gram.sum(), 0.0)  # ‖Σ_k Δ_k‖²
        a = nsq[r0:r1] / np.where(n2 > 0, n2, 1.0)[pos[r0:r1]]  # ‖Δ_kb‖² / ‖Δ_k‖² per row
        s1 = np.bincount(local, weights=a)  # per block: Σ_k a_kb
        s2 = np.bincount(local, weights=a * a)
        var[ti] = float(np.sum((s1**2 - s2) / 2)) / dim / pairs**2
    # shrink each ĉ toward the tensors' mean μ by its share of the spread (module note: empirical Bayes)
    live = total > 0  # tensors some expert changes
    mu = float(c[live].mean()) if live.any() else 0.0
    tau2 = max(float(((c[live] - mu) ** 2).mean() - var[live].mean()), 0.0) if live.any() else 0.0
    w = np.where(var > 0, tau2 / np.where(var > 0, tau2 + var, 1.0), 1.0)  # (T,) weight of the tensor's own ĉ
    post = mu + w * (c - mu)
    d = 1 + (k - 1) * post
    scale = np.where(d > 0, np.minimum(k * post / np.where(d > 0, d, 1.0), 1.0), 1.0)  # t at the posterior mean
    slope = np.where(d > 0, k / np.where(d > 0, d, 1.0) ** 2, 0.0)  # dt/dc there
    t2 = scale**2 + slope**2 * w * var  # E t² ≈ t(c̄)² + t'(c̄)²·Var(c | data)
    return np.nan_to_num(np.sqrt(t2 * total) / k)


def select(
    c: greedy.Candidates,
    budget: int,
    first_block: np.ndarray,
    value: np.ndarray | None,
    sqrt_size: bool,
    max_passes: int,
) -> tuple[np.ndarray, int]:
    """greedy.select over whole tensors (module note): the candidates' selection (N,) bool and the
    fill passes. `value`: (T,) each tensor's value (ranked plans); None: the candidates' scores are
    the random ablation's."""
    g = group(c, first_block, value, sqrt_size)
    chosen, passes = greedy.select(g, budget, max_passes)
    whole = np.zeros(first_block.size - 1, bool)
    whole[g.tensor_idx[chosen]] = True
    return whole[c.tensor_idx] & ~c.free, passes


def group(
    c: greedy.Candidates, first_block: np.ndarray, value: np.ndarray | None, sqrt_size: bool
) -> greedy.Candidates:
    """One candidate per tensor with non-free candidates, at position 0 and the tensor's first block."""
    n_tensors = first_block.size - 1
    rows = np.flatnonzero(~c.free)
    nbytes = np.zeros(n_tensors, np.int64)
    np.add.at(nbytes, c.tensor_idx[rows], c.nbytes[rows])  # int64: exact at any size
    tix = np.flatnonzero(np.bincount(c.tensor_idx[rows], minlength=n_tensors)).astype(np.int32)
    if value is not None:
        v = value[tix]
        score = candidates.per_cost(v, nbytes[tix], sqrt_size)
    else:  # random: the score of each tensor's first candidate in (position, block) order
        v = np.zeros(tix.size)
        first = rows[np.lexsort((c.slot(rows), c.tensor_idx[rows]))]
        head = np.r_[True, c.tensor_idx[first[1:]] != c.tensor_idx[first[:-1]]]
        score = c.score[first[head]]
    cols = {
        "position": np.zeros(tix.size, np.int32),
        "tensor_idx": tix,
        "block_idx": np.zeros(tix.size, np.int32),
        "free": np.zeros(tix.size, bool),
    }
    empty = np.zeros(0, np.int64)
    return greedy.Candidates.build(
        cols,
        nbytes=nbytes[tix],
        value=v,
        score=score,
        gblock=first_block[tix].astype(np.int64),
        n_family_blocks=c.n_family_blocks,
        dependent=empty,
        carrier=empty,
    )


def omitted_norm(c: greedy.Candidates, sel: np.ndarray, value: np.ndarray) -> float:
    """√(Σ ‖u_t‖²) over the tensors with a non-free candidate left out (module note)."""
    left = np.zeros(value.size, bool)
    left[c.tensor_idx[~sel & ~c.free]] = True
    return float(math.sqrt(float(np.sum(value[left] ** 2))))
