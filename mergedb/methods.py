"""Merge methods: their parameters (validated at plan time) and how the planner scores them.

One table of settings, not a class per variant: ties / dare_ties / breadcrumbs_ties differ only in
how they sparsify and whether signs are elected. Parameter names follow mergekit where the
concept is the same (`weight`, `density`, `lambda`, `gamma`, `epsilon`, `normalize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import PlanError

MAX_SCALE = 1e6  # |λ|, |weight| and |coefficient| limit: keeps c_k·Δ finite in float32 for |Δ| < 3e32
RNG = "threefry2x32-20"  # the random stream DARE/DELLA draw from (kernels.py); plans and their manifests name it
RANDOM = frozenset({"random", "della"})  # the sparsify modes that draw from it


@dataclass(frozen=True)
class Method:
    """How a method sparsifies, combines, and is scored by the planner."""

    name: str
    sparsify: str  # none | magnitude | random | band | della
    consensus: bool  # TIES sign election with the disjoint mean
    score: str  # planner value of a block: "norm" = |c|·‖Δ‖ ; "trimmed" = |c|·‖Δ surviving the trim‖
    linear: bool  # merged update = Σ c_k Δ_k with fixed c_k: the omitted-norm bound and estimate hold
    defaults: dict[str, Any]
    # what the planner selects: "block" (each (expert, block) on its own) or "tensor" (every expert's
    # every non-free block of a tensor, or none of it: a scale that needs the whole tensor's dots, as
    # model_stock's t does, is then exact wherever it is applied; tensorunit.py)
    unit: str = "block"

    @property
    def draws(self) -> bool:
        """Whether the merge draws random masks (from the stream RNG names)."""
        return self.sparsify in RANDOM


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("linear", "none", False, "norm", True, {"normalize": True}),
        Method("task_arithmetic", "none", False, "norm", True, {"lambda": 1.0}),
        Method("ties", "magnitude", True, "trimmed", False, {"density": 0.2, "lambda": 1.0, "normalize": True}),
        Method("dare_linear", "random", False, "norm", False, {"density": 0.5, "lambda": 1.0}),
        Method("dare_ties", "random", True, "norm", False, {"density": 0.5, "lambda": 1.0, "normalize": True}),
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
            "norm",
            False,
            {"density": 0.7, "epsilon": 0.15, "lambda": 1.0, "normalize": True},
        ),
        Method("della_linear", "della", False, "norm", False, {"density": 0.7, "epsilon": 0.15, "lambda": 1.0}),
        Method("model_stock", "none", False, "norm", False, {}, unit="tensor"),
        # θ₀ scaled by s0 + s1 plus s1·Δ, with s0, s1 fixed per tensor by the catalog (see slerp_coefficients)
        Method("slerp", "none", False, "norm", True, {"t": None}),
    ]
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise PlanError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[name]


# a sign-electing method's negative weight: mergedb elects the sign of Σ w·Δ but sorts each expert by
# the sign of its Δ, so such an expert's delta would be dropped where it disagrees (mergekit sorts by w·Δ)
NEGATIVE_CONSENSUS = (
    "{method} elects each element's sign by the experts' agreement and takes weights ≥ 0 (a negative weight "
    "would drop that expert's delta where it disagrees); to subtract an expert use task_arithmetic with a "
    "negative weight"
)


def cancel(total: Any, magnitude: Any) -> Any:
    """Whether weights summing to `total`, of absolute sum `magnitude`, cancel for linear's
    normalize: relative to their size (1e-13 and 1e-13 are fine; 1 and -1 are not). Works elementwise."""
    return np.abs(total) <= 1e-12 * magnitude


def validate(method: str, params: dict[str, Any], weights: list[float], n_experts: int) -> dict[str, Any]:
    """Fill defaults and check every parameter; returns the full, canonical parameter dict."""
    m = get_method(method)
    unknown = sorted(set(params) - set(m.defaults), key=repr)  # keys of mixed types sort too
    if unknown:
        allowed = ", ".join(m.defaults) or "none"
        raise PlanError(f"method {method} has no parameter {unknown[0]!r} (its parameters: {allowed})")
    p = {**m.defaults, **{k: v for k, v in params.items() if v is not None}}
    for k, v in p.items():
        if v is None and m.defaults.get(k, 0) is None:  # required, but may come per tensor (slerp's t)
            continue
        if k == "normalize":
            if not isinstance(v, bool):
                raise PlanError(f"normalize must be true or false, got {v!r}")
            continue
        if isinstance(v, (bool, str, bytes)):  # float() takes True and "0.3": a number was meant, or not
            raise PlanError(f"{k} must be a number, got {v!r}; e.g. --{k} 0.5")
        try:
            v = float(v)
        except OverflowError:  # an int past float's range, e.g. 10**400
            raise PlanError(f"{k} must be between -{MAX_SCALE:g} and {MAX_SCALE:g}, got {v!r:.40}") from None
        except (TypeError, ValueError):
            raise PlanError(f"{k} must be a number, got {v!r}") from None
        if not math.isfinite(v):
            raise PlanError(f"{k} must be finite, got {v}")
        if abs(v) > MAX_SCALE:
            raise PlanError(f"{k} must be between -{MAX_SCALE:g} and {MAX_SCALE:g}, got {v:g}; e.g. --{k} 0.5")
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
    if method == "slerp" and n_experts != 1:
        raise PlanError(f"slerp interpolates between the base and exactly one expert, got {n_experts} experts")
    if method == "slerp" and any(w != 1.0 for w in weights):
        raise PlanError("slerp takes no weights: t sets the mix of base and expert (--t 0.5, or t: 0.5 in a config)")
    if len(weights) != n_experts:
        raise PlanError(f"{len(weights)} weights for {n_experts} experts; give one weight per expert, in order")
    # numpy scalars as Python numbers: a float16 compared with the limits warned of overflow on stderr
    weights = [w.item() if isinstance(w, (np.floating, np.integer)) else w for w in weights]
    for i, w in enumerate(weights):
        number = isinstance(w, (int, float, np.floating, np.integer)) and not isinstance(w, (bool, np.bool_))
        if not (number and abs(w) <= MAX_SCALE and math.isfinite(w)):  # abs first: 10**400 is no float
            raise PlanError(
                f"weight {i + 1} of {n_experts} is {w!r:.40}: weights must be finite numbers between "
                f"-{MAX_SCALE:g} and {MAX_SCALE:g} (the experts' weights, in order: --weights 1,0.5, or weight: in a "
                "config's models)"
            )
    tiny = [i for i, w in enumerate(weights) if w != 0 and abs(w) < np.finfo(np.float32).tiny]
    if tiny:  # the merge sums weights in float32: below its normal range they lose their ratios, then vanish
        raise PlanError(
            f"weight {tiny[0] + 1} of {n_experts} is {weights[tiny[0]]!r}, below float32's normal range "
            f"({np.finfo(np.float32).tiny:.3g}), where the merge's float32 sums lose it; give 0 or scale the weights up"
        )
    if m.consensus and any(w < 0 for w in weights):
        i = next(i for i, w in enumerate(weights) if w < 0)
        raise PlanError(f"weight {i + 1} of {n_experts} is {weights[i]:g}: {NEGATIVE_CONSENSUS.format(method=method)}")
    if method == "model_stock" and any(w != 1.0 for w in weights):
        raise PlanError("model_stock takes no weights: its ratio t comes from the angles between the experts' deltas")
    if method == "linear" and p["normalize"] and cancel(sum(weights), sum(abs(w) for w in weights)):
        raise PlanError(f"linear with normalize needs weights that do not sum to zero; these sum to {sum(weights):g}")
    big = [c for c in coefficients(method, p, list(weights)) if abs(c) > MAX_SCALE]
    if big:
        raise PlanError(
            f"a coefficient on an expert's delta would be {big[0]:g} (limit {MAX_SCALE:g}): the weights nearly "
            "cancel under --normalize, or λ·weight is too large; use weights whose sum is not near zero"
        )
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
    if method == "slerp":  # lerp's coefficient; the plan's per-tensor s1 comes from slerp_coefficients
        return [params["t"] if params["t"] is not None else 0.5] * len(weights)
    return [params.get("lambda", 1.0) * w for w in weights]


SLERP_DOT_THRESHOLD = 0.9995  # mergekit's: above it (|cos| of the angle) SLERP is a plain lerp
SLERP_EPS = 1e-8  # mergekit's: a norm at or below it is taken as 1


def slerp_coefficients(
    base_sq: np.ndarray, delta_sq: np.ndarray, base_dot: np.ndarray, t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """SLERP of θ₀ and θ₁ = θ₀ + Δ per tensor, as mergekit 0.1.5 defines it, from ‖θ₀‖², ‖Δ‖² and
    ⟨θ₀, Δ⟩ (float64 arrays, one entry per tensor): (base scale s0 + s1, coefficient s1 on Δ).

    mergekit: a = θ₀/‖θ₀‖, b = θ₁/‖θ₁‖ (a norm ≤ 1e-8 counts as 1), cos = clamp(⟨a, b⟩, −1, 1);
    |cos| > 0.9995: lerp, s0 = 1 − t, s1 = t; else θ = arccos(cos), s0 = sin((1−t)θ)/sin θ,
    s1 = sin(tθ)/sin θ; result s0·θ₀ + s1·θ₁ = (s0 + s1)·θ₀ + s1·Δ. For lerp the scale is exactly 1
    (θ₀ + tΔ), so tensors that stay on the lerp branch keep the base's bytes where Δ is not read."""
    na = np.sqrt(base_sq)
    nb = np.sqrt(np.maximum(base_sq + 2 * base_dot + delta_sq, 0.0))
    na = np.where(na > SLERP_EPS, na, 1.0)
    nb = np.where(nb > SLERP_EPS, nb, 1.0)
    cos = np.clip((base_sq + base_dot) / (na * nb), -1.0, 1.0)
    lerp = np.abs(cos) > SLERP_DOT_THRESHOLD
    theta = np.arccos(np.where(lerp, 0.0, cos))
    sin = np.where(lerp, 1.0, np.sin(theta))
    s0 = np.where(lerp, 1.0 - t, np.sin((1.0 - t) * theta) / sin)
    s1 = np.where(lerp, t, np.sin(t * theta) / sin)
    return np.where(lerp, 1.0, s0 + s1), s1
