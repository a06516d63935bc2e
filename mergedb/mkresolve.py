"""mergekit 0.1.5's parameter tables and rules: a config evaluated per (expert, tensor), a plan written back.

The tables (`MERGEKIT_DEFAULTS`, read from mergekit's source) and value types live here, below
configs.py, which parses and binds configs and re-exports them. `resolve` computes every
parameter as mergekit 0.1.5 does for each tensor (configs.py's docstring states the rules) and
turns it into mergedb's terms:

- linear: mergekit computes Σ w_i θ_i over its inputs (divided by Σ w_i under normalize; the base
  is an input with its own weight when base_model is given). mergedb adds coefficients c_k to the
  base's deltas, θ₀ + Σ c_k Δ_k, so c_k = w_k / Σ w_i (normalize) — always folded into the weights,
  plans get normalize: false — or c_k = w_k when all weights, the base's included, sum to 1
  (otherwise mergekit would scale the base and the config is refused).
- task_arithmetic, dare_linear, breadcrumbs, della_linear: normalize divides by Σ w_k (|Σ| < 1e-8
  counts as 1), folded into the weights; the consensus methods keep normalize as a parameter.
- density ≥ 1 keeps everything (gamma, epsilon then play no part: both 0); density ≤ 0 drops the
  delta: weight 0 after normalisation.

Per parameter the most common value becomes the scalar (`Resolution.weights` per expert,
`Resolution.params`); `tensor_params` holds only the (position, tensor, param) that differ.
Merge-wide values (lambda, t) are written for every expert position.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from .errors import ConfigError
from .methods import METHODS

if TYPE_CHECKING:
    from .configs import MergeConfig

REQUIRED = "required"  # mergekit has no default: a config without the parameter fails there

# mergekit 0.1.5's parameters and their defaults, per method (merge_methods/registry.py,
# generalized_task_arithmetic.py, linear.py, slerp.py, model_stock.py). The README's
# "Coming from mergekit" table is this dict.
_GTA = {"weight": REQUIRED, "density": 1.0, "lambda": 1.0, "int8_mask": False}
MERGEKIT_DEFAULTS: dict[str, dict[str, Any]] = {
    "linear": {"weight": REQUIRED, "normalize": True},
    "task_arithmetic": {**_GTA, "normalize": False, "rescale": False},
    "ties": {**_GTA, "normalize": True, "rescale": False},
    "dare_ties": {**_GTA, "normalize": False, "rescale": True},
    "dare_linear": {**_GTA, "normalize": False, "rescale": True},
    "breadcrumbs": {**_GTA, "gamma": 0.01, "normalize": False, "rescale": False},
    "breadcrumbs_ties": {**_GTA, "gamma": 0.01, "normalize": False, "rescale": False},
    "della": {**_GTA, "epsilon": 0.15, "normalize": True, "rescale": True},
    "della_linear": {**_GTA, "epsilon": 0.15, "normalize": False, "rescale": True},
    "model_stock": {"filter_wise": False},
    "slerp": {"t": REQUIRED},
}
PER_MODEL = frozenset({"weight", "density", "gamma", "epsilon"})  # mergekit's INPUT / NON_BASE scope
BOOLEAN = frozenset({"normalize", "rescale", "int8_mask", "filter_wise"})
# the values mergedb can honour for mergekit's switches (a method missing here ignores the switch)
RESCALE = {"ties": False, "breadcrumbs": False, "breadcrumbs_ties": False}
RESCALE.update(dict.fromkeys(["dare_ties", "dare_linear", "della", "della_linear"], True))
WHY_RESCALE = {
    False: "mergedb's magnitude and band trims never rescale what they keep",
    True: "mergedb's random drops always rescale the kept values by 1/keep-probability",
}
MERGEDB_PARAMS = {name: tuple(m.defaults) for name, m in METHODS.items()} | {"slerp": ("t",)}  # what plans take
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # mergekit name -> `execute --dtype`
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Cond:
    """One entry of a filter list: `value` applies to tensors whose name contains `filter`."""

    filter: str | None  # None or "*": every tensor
    value: float | tuple[float, ...]


Setting = Any  # bool | float | tuple[float, ...] (gradient) | tuple[Cond, ...] (filter list)


@dataclass(frozen=True)
class ModelEntry:
    """One entry of `models:` (or one source of a full-range slice)."""

    model: str
    parameters: dict[str, Setting] = field(default_factory=dict)


@dataclass(frozen=True)
class Resolution:
    """A config evaluated over a model's tensors: what `planner.PlanRequest` takes."""

    method: str  # a mergedb method name
    base: str | None  # None: linear without base_model, before `bind_models`
    experts: tuple[str, ...]  # position k = config order, base excluded
    weights: tuple[float, ...]  # one per expert: the coefficient it gets on most tensors
    params: dict[str, Any]  # the method's scalar parameters, in mergedb's names
    tensor_params: pa.Table  # position int32, tensor string, param string, value float64: the exceptions
    output_dtype: str | None = None

    def value(self, position: int, tensor: str, param: str) -> float:
        """The value `param` takes for expert `position` on `tensor` (its override, else the scalar)."""
        found = self._overrides.get((position, tensor, param))
        if found is not None:
            return found
        return self.weights[position] if param == "weight" else float(self.params[param])

    @cached_property
    def _overrides(self) -> dict[tuple[int, str, str], float]:
        return {(r["position"], r["tensor"], r["param"]): r["value"] for r in self.tensor_params.to_pylist()}


SCHEMA = pa.schema([("position", pa.int32()), ("tensor", pa.string()), ("param", pa.string()), ("value", pa.float64())])


def layer_t(names: list[str]) -> tuple[dict[str, float], int]:
    """t of every tensor as mergekit plans it, and the number of layers L (0: no Llama-layout layers).

    `model.layers.N.…`: N / (L − 1) (1 when L = 1); anything else (embeddings, final norm, lm_head): 0.
    """
    idx = {n: int(m.group(1)) for n in names if (m := LAYER.match(n))}
    n_layers = max(idx.values()) + 1 if idx else 0
    return {n: ((idx[n] / (n_layers - 1) if n_layers > 1 else 1.0) if n in idx else 0.0) for n in names}, n_layers


def evaluate(setting: Setting, tensor: str, t: float) -> Any:
    """mergekit's `evaluate_setting`: a scalar, a gradient at t, or the first matching filter (None: none)."""
    if isinstance(setting, (bool, float)):
        return setting
    if setting and isinstance(setting[0], Cond):
        for c in setting:
            if c.filter is None or c.filter in tensor:
                return evaluate(c.value, tensor, t)
        return None
    scaled = t * (len(setting) - 1)  # the same float operations as mergekit, in the same order
    i0 = int(scaled)
    i1 = min(len(setting) - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * setting[i0] + frac * setting[i1]


def _lookup(name: str, scopes: tuple[dict, ...], tensor: str, t: float, method: str, who: str) -> Any:
    for scope in scopes:
        if name in scope:
            v = evaluate(scope[name], tensor, t)
            if v is not None:
                return v
    default = MERGEKIT_DEFAULTS[method][name]
    if default == REQUIRED:
        raise ConfigError(
            f"{who}: no {name} for tensor {tensor!r} (mergekit requires {name} for {method}); "
            f"set {name} under its parameters or at the top level, or add a filter entry without filter as the fallback"
        )
    return default


def _gradients(settings: list[Setting]) -> bool:
    def grad(s: Setting) -> bool:
        if isinstance(s, tuple) and s and isinstance(s[0], Cond):
            return any(grad(c.value) for c in s)
        return isinstance(s, tuple) and len(s) > 1

    return any(grad(s) for s in settings)


def mergekit_params(cfg: MergeConfig, names: list[str]) -> dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    """Per tensor, what mergekit's planner hands the method: (shared parameters, {model: its parameters}).

    Exactly mergekit's `resolve_parameters`: the base gets no NON_BASE parameter (linear's weight
    is an INPUT parameter: the base has one when base_model is given). Refusals name the key.
    """
    if not names:
        raise ConfigError("no tensors to resolve the config over")
    ts, n_layers = layer_t(names)
    if cfg.layer_range is not None and n_layers and cfg.layer_range != (0, n_layers):
        raise ConfigError(
            f"slices[0]: layer_range {list(cfg.layer_range)} is not the model's full range [0, {n_layers}] "
            "(a frankenmerge); mergedb merges whole models"
        )
    scopes = [cfg.parameters, cfg.slice_parameters] + [e.parameters for e in cfg.models]
    if n_layers == 0 and _gradients([s for d in scopes for s in d.values()]):
        raise ConfigError("gradients interpolate over model.layers.N; this model has no tensors named so")
    m, base = cfg.merge_method, cfg.base_model
    spec = MERGEKIT_DEFAULTS[m]
    inputs = list(cfg.models)
    listed = cfg.layer_range is None and not cfg.base_inferred  # models: form; a slice's sources: as written
    if m == "linear" and base is not None and listed and base not in [e.model for e in inputs]:
        inputs.append(ModelEntry(base))  # mergekit adds base_model as an input to a models: list only
    shared_scopes = (cfg.slice_parameters, cfg.parameters)  # mergekit's sources(None): never a model's own
    out = {}
    for tensor in names:
        t = ts[tensor]
        shared = {p: _lookup(p, shared_scopes, tensor, t, m, "parameters") for p in spec if p not in PER_MODEL}
        per = {}
        for e in inputs:
            own = (e.parameters, *shared_scopes)
            keys = [p for p in spec if p in PER_MODEL and (e.model != base or m == "linear")]
            per[e.model] = {p: _lookup(p, own, tensor, t, m, f"model {e.model!r}") for p in keys}
        out[tensor] = (shared, per)
    return out


def resolve(cfg: MergeConfig, names: list[str]) -> Resolution:
    """See the module docstring."""
    raw = mergekit_params(cfg, names)
    m, base = cfg.merge_method, cfg.base_model
    experts = [e for e in cfg.models if e.model != base]
    consensus = m in METHODS and METHODS[m].consensus
    normalize = bool(raw[names[0]][0].get("normalize", False))  # a scalar: checked in parse_config
    vals: dict[str, dict[tuple[int, str], float]] = defaultdict(dict)
    for tensor in names:
        shared, per = raw[tensor]
        if m == "slerp":
            vals["t"][(0, tensor)] = float(shared["t"])
            continue
        if m == "model_stock":
            continue
        w = [float(per[e.model]["weight"]) for e in experts]
        if m == "linear":
            w0 = float(per[base]["weight"]) if base in per else 0.0
            total = w0 + sum(w)
            if normalize:
                if total == 0:
                    raise ConfigError(f"linear: the weights sum to 0 on tensor {tensor!r} (mergekit divides by it)")
                w = [x / total for x in w]
            elif not math.isclose(total, 1.0, rel_tol=0, abs_tol=1e-9):
                raise ConfigError(
                    f"linear with normalize: false: the weights (base included) sum to {total:g} on tensor {tensor!r}; "
                    "mergekit would scale the base by it, mergedb adds deltas to an unscaled base; make them sum to 1"
                )
        else:
            _gta(m, tensor, [per[e.model] for e in experts], [e.model for e in experts], w, shared, consensus, vals)
        for k, x in enumerate(w):
            vals["weight"][(k, tensor)] = x
    return _tabulate(cfg, experts, vals, consensus, normalize)


def _gta(m: str, tensor: str, per: list[dict], who: list[str], w: list[float], shared: dict, consensus: bool,
         vals: dict) -> None:  # fmt: skip
    if consensus and any(x < 0 for x in w):
        raise ConfigError(
            f"{m}: a negative weight on tensor {tensor!r}; mergekit elects signs of weight·delta, mergedb of "
            "delta, so they agree only for weights ≥ 0"
        )
    if not consensus and shared["normalize"]:
        div = sum(w)
        div = 1.0 if abs(div) < 1e-8 else div
        w[:] = [x / div for x in w]
    sparse = METHODS[m].sparsify != "none"
    for k, p in enumerate(per):
        vals["lambda"][(k, tensor)] = float(shared["lambda"])
        if not sparse:
            continue
        d, g, eps = float(p["density"]), p.get("gamma"), p.get("epsilon")
        if d <= 0:  # mergekit zeroes the delta: no contribution (after normalisation)
            w[k], d = 0.0, 1.0
        if d >= 1:  # mergekit returns the delta untouched
            d, g, eps = 1.0, (None if g is None else 0.0), (None if eps is None else 0.0)
        elif g is not None and not 0 <= g <= 1 - d:
            raise ConfigError(f"{m}: gamma {g:g} + density {d:g} > 1 (or gamma < 0) for {who[k]!r} on {tensor!r}")
        elif eps is not None and not (eps >= 0 and d + eps < 1 and d - eps > 0):
            raise ConfigError(
                f"{m}: density ± epsilon must lie inside (0, 1) (mergekit raises), got density {d:g}, "
                f"epsilon {eps:g} for {who[k]!r} on {tensor!r}"
            )
        vals["density"][(k, tensor)] = d
        if g is not None:
            vals["gamma"][(k, tensor)] = float(g)
        if eps is not None:
            vals["epsilon"][(k, tensor)] = float(eps)


def most_common(values: list[Any]) -> Any:
    """The most common value; the smallest of those on a tie (so the choice is deterministic)."""
    counts = Counter(values)
    top = max(counts.values())
    return min(v for v, c in counts.items() if c == top)


def _tabulate(cfg: MergeConfig, experts: list[ModelEntry], vals: dict, consensus: bool, normalize: bool) -> Resolution:
    m = cfg.merge_method
    n = len(experts)
    weights = [1.0] * n
    rows: list[tuple[int, str, str, float]] = []
    if "weight" in vals:
        for k in range(n):
            mine = {key: v for key, v in vals["weight"].items() if key[0] == k}
            weights[k] = most_common(list(mine.values()))
            rows += [(k, tn, "weight", v) for (_, tn), v in mine.items() if v != weights[k]]
    params: dict[str, Any] = {}
    trims = [p for p in ("density", "gamma", "epsilon") if p in MERGEDB_PARAMS[m]]
    if trims:  # one joint mode, so the scalars are a combination some tensor has (validate checks them together)
        params.update(zip(trims, most_common([tuple(vals[p][key] for p in trims) for key in vals[trims[0]]])))
    for p in MERGEDB_PARAMS[m]:
        if p == "normalize":
            params[p] = bool(normalize) if consensus else False
            continue
        scalar = params[p] if p in params else most_common(list(vals[p].values()))
        params[p] = scalar
        rows += [(k, tn, p, v) for (k, tn), v in vals[p].items() if v != scalar]
    rows.sort()
    table = pa.Table.from_pylist(
        [{"position": k, "tensor": tn, "param": p, "value": v} for k, tn, p, v in rows], schema=SCHEMA
    )
    return Resolution(
        m, cfg.base_model, tuple(e.model for e in experts), tuple(weights), params, table, cfg.output_dtype
    )


# -- export ----------------------------------------------------------------------------------------


def _setting(scalar: float, over: dict[str, float], names: list[str], inside: dict[str, list[str]]) -> Any:
    """A scalar, or a filter list: full tensor names, longest first (a name inside another never catches
    it), then the most common value as the fallback; a tensor whose name contains an entry's gets its own.
    `inside[o]`: the other names that contain name o."""
    if not over:
        return scalar
    eff = {**{n: scalar for n in names}, **over}
    fallback = most_common(list(eff.values())) if names else scalar  # without the names, only the scalar is safe
    ov = {n: v for n, v in eff.items() if v != fallback}
    if not ov:
        return fallback
    guards = {n: eff.get(n, scalar) for o in ov for n in inside.get(o, ()) if n not in ov}
    entries = sorted({**ov, **guards}.items(), key=lambda kv: (-len(kv[0]), kv[0]))
    return [{"filter": n, "value": v} for n, v in entries] + [{"value": fallback}]


_CATALOG_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}  # CheckpointRow.dtype -> execute --dtype


def export_dict(res: Resolution, paths: dict[str, str], names: list[str], base_dtype: str | None) -> dict[str, Any]:
    """The mergekit config of `res` as plain data (see configs.to_mergekit_yaml)."""
    if res.base is None:
        raise ConfigError("this linear config names no base_model; bind it to the catalog (bind_models) first")
    every = sorted(set(names) | set(res.tensor_params.column("tensor").to_pylist()))
    inside: dict[str, list[str]] = {}
    for o in every:  # full tensor names rarely contain one another; when they do, filters must not mix them up
        hit = [n for n in every if n != o and o in n]
        if hit:
            inside[o] = hit
    m, n = res.method, len(res.experts)
    over: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
    for r in res.tensor_params.to_pylist():
        over[(r["position"], r["param"])][r["tensor"]] = r["value"]
    weights = [float(w) for w in res.weights]
    if m == "linear" and res.params.get("normalize"):  # a plan's own normalize: fold, as resolve does
        tensors = sorted({t for (k, p), d in over.items() if p == "weight" for t in d})
        per = {t: [over[(k, "weight")].get(t, weights[k]) for k in range(n)] for t in tensors}
        total = sum(weights)
        weights = [w / total for w in weights]
        for k in range(n):
            over[(k, "weight")] = {t: per[t][k] / sum(per[t]) for t in tensors}
    models: list[dict[str, Any]] = []
    if m == "linear":
        wt = sorted({t for (k, p), d in over.items() if p == "weight" for t in d})
        b_over = {t: 1.0 - sum(over[(k, "weight")].get(t, weights[k]) for k in range(n)) for t in wt}
        models.append(
            {"model": paths[res.base], "parameters": {"weight": _setting(1.0 - sum(weights), b_over, names, inside)}}
        )
    for k, name in enumerate(res.experts):
        p: dict[str, Any] = {}
        if m not in ("slerp", "model_stock"):
            p["weight"] = _setting(weights[k], over.get((k, "weight"), {}), names, inside)
        for q in ("density", "gamma", "epsilon"):
            if q in res.params:
                p[q] = _setting(float(res.params[q]), over.get((k, q), {}), names, inside)
        models.append({"model": paths[name], **({"parameters": p} if p else {})})
    top: dict[str, Any] = {}
    for q in ("lambda", "t"):
        if q in res.params:
            per_pos = [over.get((k, q), {}) for k in range(n)]
            if any(d != per_pos[0] for d in per_pos):
                raise ConfigError(f"{q} differs between experts on some tensor; mergekit's {q} is one value per tensor")
            top[q] = _setting(float(res.params[q]), per_pos[0], names, inside)
    if "normalize" in MERGEKIT_DEFAULTS[m]:
        top["normalize"] = bool(res.params.get("normalize", False)) and m != "linear"
    if m in RESCALE:
        top["rescale"] = RESCALE[m]
    out: dict[str, Any] = {"merge_method": m, "base_model": paths[res.base], "models": models}
    if top:
        out["parameters"] = top
    out_dtype = res.output_dtype or _CATALOG_DTYPES.get(base_dtype or "")
    if out_dtype:  # mergedb computes in float32 and writes out_dtype (by default the base's dtype)
        out["dtype"] = "float32"
        out["out_dtype"] = {v: k for k, v in DTYPES.items()}[out_dtype]
    return out  # no tokenizer_source: with one, mergekit rebuilds the embeddings with a row per token
