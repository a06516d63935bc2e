"""Merge methods: their parameters (validated at plan time) and how the planner scores them.

One table of settings, not a class per variant: ties / dare_ties / breadcrumbs_ties differ only in
how they sparsify and whether signs are elected. Parameter names follow mergekit where the
concept is the same (`weight`, `density`, `lambda`, `gamma`, `epsilon`, `normalize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import PlanError


@dataclass(frozen=True)
class Method:
    """How a method sparsifies, combines, and is scored by the planner."""

    name: str
    sparsify: str  # none | magnitude | random | band | della
    consensus: bool  # TIES sign election with the disjoint mean
    score: str  # additive: |c|·‖Δ‖ ; trimmed: |c|·‖Δ surviving the trim‖ (from histograms)
    bound: bool  # the omitted-update error bound holds exactly (deterministic, fixed coefficients)
    defaults: dict[str, Any]


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("linear", "none", False, "additive", True, {"normalize": True}),
        Method("task_arithmetic", "none", False, "additive", True, {"lambda": 1.0}),
        Method("ties", "magnitude", True, "trimmed", False, {"density": 0.2, "lambda": 1.0, "normalize": True}),
        Method("dare_linear", "random", False, "additive", False, {"density": 0.5, "lambda": 1.0}),
        Method("dare_ties", "random", True, "additive", False, {"density": 0.5, "lambda": 1.0, "normalize": True}),
        Method("breadcrumbs", "band", False, "trimmed", False, {"density": 0.9, "gamma": 0.01, "lambda": 1.0}),
        Method(
            "breadcrumbs_ties",
            "band",
            True,
            "trimmed",
            False,
            {"density": 0.9, "gamma": 0.01, "lambda": 1.0, "normalize": True},
        ),
        Method(
            "della",
            "della",
            True,
            "additive",
            False,
            {"density": 0.7, "epsilon": 0.15, "lambda": 1.0, "normalize": True},
        ),
        Method("della_linear", "della", False, "additive", False, {"density": 0.7, "epsilon": 0.15, "lambda": 1.0}),
        Method("model_stock", "none", False, "additive", False, {}),
    ]
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise PlanError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


def validate(method: str, params: dict[str, Any], weights: list[float], n_experts: int) -> dict[str, Any]:
    """Fill defaults and check every parameter; returns the full, canonical parameter dict."""
    m = get_method(method)
    unknown = sorted(set(params) - set(m.defaults))
    if unknown:
        allowed = ", ".join(m.defaults) or "none"
        raise PlanError(f"method {method} has no parameter {unknown[0]!r} (its parameters: {allowed})")
    p = {**m.defaults, **{k: v for k, v in params.items() if v is not None}}
    for k, v in p.items():
        if k == "normalize":
            if not isinstance(v, bool):
                raise PlanError(f"normalize must be true or false, got {v!r}")
            continue
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise PlanError(f"{k} must be a number, got {v!r}") from None
        if not math.isfinite(v):
            raise PlanError(f"{k} must be finite, got {v}")
        p[k] = v
    if "density" in p and not 0 < p["density"] <= 1:
        raise PlanError(f"density must be in (0, 1], got {p['density']}; e.g. --density 0.2")
    if "gamma" in p and not (0 <= p["gamma"] < 1 and p["gamma"] + p["density"] <= 1):
        raise PlanError(f"gamma must be in [0, 1) with gamma + density ≤ 1, got gamma={p['gamma']}")
    if "epsilon" in p and not (
        0 <= p["epsilon"] and 0 < p["density"] - p["epsilon"] and p["density"] + p["epsilon"] <= 1
    ):
        raise PlanError(f"epsilon must keep density ± epsilon inside (0, 1], got epsilon={p['epsilon']}")
    if n_experts < 1:
        raise PlanError("a plan needs at least one expert")
    if method == "model_stock" and n_experts < 2:
        raise PlanError("model_stock needs at least two experts")
    if len(weights) != n_experts:
        raise PlanError(f"{len(weights)} weights for {n_experts} experts; give one weight per expert, in order")
    if not all(math.isfinite(w) for w in weights):
        raise PlanError(f"weights must be finite numbers, got {weights}")
    if method == "linear" and p["normalize"] and abs(sum(weights)) < 1e-12:
        raise PlanError("linear with normalize needs weights that do not sum to zero")
    return p


def coefficients(method: str, params: dict[str, Any], weights: list[float]) -> list[float]:
    """The fixed coefficient c_k on expert k's delta in the merged model (before any trimming).

    linear: w_k / Σw (or w_k); task_arithmetic and sparsifying methods: λ·w_k (TIES-style methods
    divide by agreeing weights per element, so |c_k| is the planner's scale, not an exact factor);
    model_stock: 1/K (its data-dependent t ≤ 1 is applied by the executor).
    """
    if method == "linear":
        total = sum(weights) if params["normalize"] else 1.0
        return [w / total for w in weights]
    if method == "model_stock":
        return [1.0 / len(weights)] * len(weights)
    return [params.get("lambda", 1.0) * w for w in weights]


# -- operators: pure tensor math on float32 numpy arrays -----------------------------------------
#
# Every operator sees an expert's delta block by block (rows [r0, r1) of a tensor, flattened
# element offset `offset`) and folds it into per-tensor running sums, so memory does not grow
# with the number of experts. Omitted blocks contribute nothing; coefficients never change.
# Order of operations is fixed (experts in plan order, float32), so results repeat bit for bit.

import numba  # noqa: E402
import numpy as np  # noqa: E402


@numba.njit(nogil=True, cache=True)
def _uniform(key, offset, n):  # pragma: no cover - compiled
    # counter-based: u_i depends only on (key, offset + i), so blocks equal whole tensors
    out = np.empty(n, np.float64)
    for i in range(n):
        z = (key + np.uint64(offset + i)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        out[i] = np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)
    return out


@numba.njit(nogil=True, cache=True)
def _drop_random(d, key, offset, p):  # pragma: no cover - compiled
    # DARE in place: keep d[i] / p where u_i < p (u_i as in _uniform), else 0
    p32 = np.float32(p)
    for i in range(d.shape[0]):
        z = (key + np.uint64(offset + i)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        u = np.float64(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)
        d[i] = d[i] / p32 if u < p else np.float32(0.0)


@numba.njit(nogil=True, cache=True)
def _keep_band(d, lo, hi):  # pragma: no cover - compiled
    # magnitude / band trim in place: keep lo ≤ |d| < hi
    lo32, hi32 = np.float32(lo), np.float32(hi)
    for i in range(d.shape[0]):
        a = abs(d[i])
        if not (a >= lo32 and a < hi32):
            d[i] = np.float32(0.0)


@numba.njit(nogil=True, cache=True)
def _add_scaled(total, d, c):  # pragma: no cover - compiled
    c32 = np.float32(c)
    for i in range(d.shape[0]):
        total[i] += c32 * d[i]


@numba.njit(nogil=True, cache=True)
def _add_consensus(total, pos, neg, pos_w, neg_w, d, w):  # pragma: no cover - compiled
    w32 = np.float32(w)
    for i in range(d.shape[0]):
        x = d[i]
        wd = w32 * x
        total[i] += wd
        if x > 0:
            pos[i] += wd
            pos_w[i] += w32
        elif x < 0:
            neg[i] += wd
            neg_w[i] += w32


def uniform(key: int, offset: int, n: int) -> np.ndarray:
    """Uniform [0, 1) draws for elements offset … offset+n−1 of the stream `key` (float64)."""
    return _uniform(np.uint64(key), offset, n)


def rng_key(seed: int, expert: str, tensor: str) -> int:
    """The DARE/DELLA stream key of (seed, expert name, tensor name): independent of the block layout."""
    import hashlib

    d = hashlib.sha256(f"mergedb-drop\0{seed}\0{expert}\0{tensor}".encode()).digest()
    return int.from_bytes(d[:8], "little")


@dataclass(frozen=True)
class Trim:
    """What `sparsify` needs for one (expert, tensor)."""

    t_lo: float = 0.0  # magnitude / band: keep |Δ| ≥ t_lo
    t_hi: float | None = None  # band: and |Δ| < t_hi
    key: int = 0  # random / della: stream key
    rank: Any = None  # della: callable |Δ| -> rank fraction in [0, 1] (0 = smallest)


def sparsify(m: Method, params: dict[str, Any], delta: np.ndarray, offset: int, trim: Trim) -> np.ndarray:
    """Δ' for one block of one expert: (n,) float32, sparsified in place where possible."""
    if m.sparsify == "none":
        return delta
    if m.sparsify in ("magnitude", "band"):  # in place
        _keep_band(delta, trim.t_lo, np.inf if trim.t_hi is None else trim.t_hi)
        return delta
    if m.sparsify == "random":  # in place
        _drop_random(delta, np.uint64(trim.key), offset, float(params["density"]))
        return delta
    a = np.abs(delta)
    u = uniform(trim.key, offset, delta.size).reshape(delta.shape)
    # della: keep probability rises linearly with magnitude rank from density−ε to density+ε
    p = (params["density"] - params["epsilon"] + 2 * params["epsilon"] * trim.rank(a)).astype(np.float32)
    return np.where(u < p, delta / p, np.float32(0)).astype(np.float32)


class Accumulator:
    """Running sums of one tensor's merge: plain weighted sums, or TIES-style sign consensus."""

    def __init__(self, m: Method, params: dict[str, Any], n: int) -> None:
        self.m, self.params = m, params
        self.total = np.zeros(n, np.float32)  # Σ c_k Δ'_k (additive) / Σ w_k Δ'_k (consensus)
        if m.consensus:
            self.pos = np.zeros(n, np.float32)
            self.neg = np.zeros(n, np.float32)
            self.pos_w = np.zeros(n, np.float32)
            self.neg_w = np.zeros(n, np.float32)

    def add(self, coef: float, weight: float, lo: int, d: np.ndarray) -> None:
        """Fold Δ'_k for flat elements [lo, lo + d.size) into the sums."""
        hi = lo + d.size
        if not self.m.consensus:
            _add_scaled(self.total[lo:hi], d, coef)
            return
        _add_consensus(
            self.total[lo:hi], self.pos[lo:hi], self.neg[lo:hi], self.pos_w[lo:hi], self.neg_w[lo:hi], d, weight
        )

    def merged_delta(self) -> np.ndarray:
        """The merged update added to the base (float32)."""
        if not self.m.consensus:
            return self.total
        up = self.total >= 0  # elected sign, +1 on zero (mergekit)
        num = np.where(up, self.pos, self.neg)
        if self.params.get("normalize", True):
            den = np.where(up, self.pos_w, self.neg_w)
            den = np.where(np.abs(den) < 1e-8, np.float32(1), den)
            num = num / den
        return np.float32(self.params.get("lambda", 1.0)) * num
