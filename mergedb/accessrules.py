"""Access-set rules: how the planner's candidates are valued and constrained before the greedy cut.

Both rules transform the scored candidates (greedy.Candidates) between candidates.fetch and
greedy.select; the greedy itself is unchanged, so every plan still reads at most its budget.

**Value model** (`PlanRequest.value_model`, `mergedb plan --value`; None: `norm-sqrt` for ranked
plans, `norm` for the random ablation, which ignores values):
- `norm-sqrt` (the default since issue 16's measurements, README "Default planner settings"): the
  value |c_k|·‖Δ_kb‖ (the trimmed norm for trimming methods, candidates.py), scored value / √bytes.
  ‖Δ‖ of a block of n bytes at equal change per byte grows as √n, so value / bytes ranks a small
  block above a large one of the same density by √(ratio) (a 64 KiB vocabulary block 8× a 4 MiB
  one); value / √bytes ranks them equal, and for one expert it is the greedy order that minimises
  the squared norm left out (disjoint blocks: ‖θ_B − θ_F‖² = Σ_omitted ‖c·Δ_b‖²). Scored where the
  candidates are (candidates.Scoring.sqrt_size, both the numpy and the compiled path); adapters: the
  carrier's bytes include the tensor's fixed cost (candidates.charge_fixed) and the other blocks of
  the tensor stay below it, as with `norm`.
- `norm`: the same value scored value / bytes (the default before; the greedy order of the
  triangle-inequality sum Σ‖c·Δ_b‖ that the additive bound adds up).
- `consensus`, for methods with TIES sign election (ties, dare_ties, breadcrumbs_ties, della): the
  value of (k, b) is the model's leave-one-out change of the full merge's block b when expert k's
  block alone is left out (consensus.leave_one_out); score = value / bytes.

**Coverage** (`PlanRequest.min_coverage` F, `mergedb plan --min-coverage F`). Expert k's useful bytes
U_k are the bytes of its candidates that are not free and have a value > 0. The rule, exactly:
1. for each expert k, walk its own candidates in the plan's order (score desc, then position,
   tensor, block: greedy.py's order) and force the shortest prefix whose bytes reach ⌈F·U_k⌉
   (none when F·U_k = 0); with adapters' fixed costs a forced candidate brings its carrier;
2. if the forced bytes of all experts exceed the budget, refuse (PlanError, nothing stored);
3. otherwise the greedy takes the forced candidates first (their scores are lifted above every
   other score, keeping their order among themselves) and fills the rest of the budget by score.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from . import greedy
from .errors import PlanError
from .units import format_size

if TYPE_CHECKING:
    from . import methods

VALUE_MODELS = ("norm-sqrt", "norm", "consensus")
DEFAULT_VALUE = "norm-sqrt"  # ranked plans; the random ablation records "norm" (it ignores values)


def value_model(asked: str | None, strategy: str) -> str:
    """The value model a request plans with: the one asked for, else the default for its strategy."""
    if asked is not None:
        return asked
    return DEFAULT_VALUE if strategy == "ranked" else "norm"


def check(value_model: str, min_coverage: float | None, method: methods.Method, strategy: str) -> None:
    """Refuse rules that do not apply to the request, naming the fix."""
    if value_model not in VALUE_MODELS:
        raise PlanError(f"unknown value model {value_model!r}; use one of: {', '.join(VALUE_MODELS)}")
    if value_model == "consensus" and not method.consensus:
        raise PlanError(
            f"--value consensus models TIES-style sign election; method {method.name} has none (use it with ties, "
            "dare_ties, breadcrumbs_ties or della, or keep the default --value norm-sqrt)"
        )
    if value_model != "norm" and strategy != "ranked":
        raise PlanError(f"--value {value_model} sets the ranked planner's value; --strategy {strategy} ignores it")
    if min_coverage is not None:
        if isinstance(min_coverage, bool) or not isinstance(min_coverage, (int, float)):
            raise PlanError(f"min_coverage must be a number from 0 to 1, got {min_coverage!r}; e.g. --min-coverage 0.1")
        if not 0 <= min_coverage <= 1:
            raise PlanError(f"min_coverage must be from 0 to 1, got {min_coverage}; e.g. --min-coverage 0.1")
    if min_coverage and method.unit == "tensor":
        raise PlanError(
            f"--min-coverage covers each expert's blocks, but {method.name} plans whole tensors (every expert's "
            "blocks of a tensor, or none); leave --min-coverage out"
        )


def with_consensus_value(c: greedy.Candidates, values: np.ndarray) -> greedy.Candidates:
    """Candidates valued by the consensus model's leave-one-out effect `values` (K, B)."""
    value = np.where(c.free, 0.0, values[c.position, c.gblock])
    if c.dependent.size:
        raise PlanError("--value consensus is not available for LoRA adapter experts yet; use --value norm")
    return replace(c, value=value, score=value / np.maximum(c.nbytes, 1))


def forced(c: greedy.Candidates, n_positions: int, fraction: float) -> np.ndarray:
    """(N,) bool: the candidates the coverage rule forces (see the module note, step 1)."""
    useful = ~c.free & (c.value > 0)
    rows = np.flatnonzero(useful)
    out = np.zeros(c.score.size, bool)
    if not rows.size:  # every expert equals the base (or has no value): nothing to cover
        return out
    rows = rows[np.lexsort((c.slot(rows), -c.score[rows], c.position[rows]))]  # per expert, in plan order
    pos = c.position[rows]
    per = np.bincount(pos, weights=c.nbytes[rows].astype(np.float64), minlength=n_positions)
    need = np.ceil(fraction * per)  # (K,) bytes each expert must get
    starts = np.searchsorted(pos, np.arange(n_positions))
    cum = np.cumsum(c.nbytes[rows].astype(np.float64))
    before = np.where(starts > 0, cum[np.maximum(starts - 1, 0)], 0.0)[pos]  # bytes of earlier experts
    within = cum - before  # bytes of this expert's prefix up to and including the row
    prior = within - c.nbytes[rows]  # bytes before the row
    out[rows[prior < need[pos]]] = True
    if c.dependent.size:  # a forced block of an adapter brings its carrier
        out[c.carrier[out[c.dependent]]] = True
    return out


def with_coverage(c: greedy.Candidates, n_positions: int, fraction: float, budget: int) -> greedy.Candidates:
    """Candidates whose forced ones (step 1) score above every other; refuses (step 2) if they do
    not fit the budget."""
    force = forced(c, n_positions, fraction)
    need = int(c.nbytes[force].sum())
    if need > budget:
        raise PlanError(
            f"--min-coverage {fraction:g} needs {format_size(need)} ({need} bytes) of the experts' blocks but the "
            f"budget is {format_size(budget)} ({budget} bytes); raise --budget to at least {format_size(need)} or "
            "lower --min-coverage"
        )
    if not force.any():
        return c
    top = float(c.score.max())
    score = c.score.copy()
    # lifted above top, order kept: each forced score maps to 2·top + 1 + score, exact enough that the
    # forced block stays a prefix of the plan's order (every other score ≤ top < lifted ones)
    score[force] = 2.0 * top + 1.0 + c.score[force]
    if c.dependent.size:  # keep each adapter block strictly below its carrier (candidates.charge_fixed)
        score[c.dependent] = np.minimum(score[c.dependent], np.nextafter(score[c.carrier], 0))
    return replace(c, score=score)
