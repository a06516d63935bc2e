"""mergekit YAML configs, read with mergekit 0.1.5's semantics and written back from plans.

Users who merge today have mergekit configs; this module turns one into what the planner takes
(a method, one weight per expert, scalar parameters, and a per-tensor override table) without
changing its meaning, and refuses — one line naming the key and why — whatever mergedb cannot
honour exactly. Three steps, each a plain function over values:

- `parse_config(text_or_path)` checks the YAML's shape and values and returns a `MergeConfig`
  (models as written; `slices` whose sources each cover the full layer range become `models`);
- `bind_models(config, rows)` replaces every model reference with a registered checkpoint's name
  (matched by name, by resolved path, or by fingerprint);
- `MergeConfig.resolve(tensor_names)` evaluates every parameter for every (model, tensor) as
  mergekit does and returns a `Resolution`: `weights`/`params` for `planner.PlanRequest` and
  `tensor_params`, the rows (position, tensor, param, value) that differ from those scalars.

mergekit's rules, from its source (config.py `evaluate_setting`, parameter_resolver.py, plan.py):
a value is a scalar, a gradient (a list of numbers interpolated over t: i = int(t·(n−1)), result =
(1−f)·v[i] + f·v[i+1]) or a list of {filter, value} (the first entry whose filter is a substring
of the tensor name, or has no filter or "*", wins; none matching means "not set here"). A layer
tensor `model.layers.N.…` of an L-layer model has t = N/(L−1) (t = 1 when L = 1); every other
tensor — embeddings, the final norm, lm_head — is planned with t = 0. A per-model parameter is
looked up under the model, then the slice, then the top level, falling through where a scope
does not set it; merge-wide (shared) parameters are looked up only in the slice and the top level.
`to_mergekit_yaml` writes a plan back as a config (mkresolve.py holds mergekit's tables, the evaluation and the export).
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .mkresolve import (  # noqa: F401 - mergekit's tables and the value types are part of this module's interface
    BOOLEAN,
    DTYPES,
    MERGEDB_PARAMS,
    MERGEKIT_DEFAULTS,
    PER_MODEL,
    REQUIRED,
    RESCALE,
    SCHEMA,
    WHY_RESCALE,
    Cond,
    ModelEntry,
    Resolution,
    Setting,
    export_dict,
    resolve,
)
from .units import finite, shown

# libyaml's scanner when present: the same safe constructors and resolvers as yaml.safe_load (mergekit's)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
OTHER_METHODS = {  # mergekit 0.1.5 methods mergedb does not implement
    "passthrough": "passthrough builds frankenmerges (stacked layer slices), which mergedb does not plan",
    "nuslerp": "mergedb has no nuslerp", "multislerp": "mergedb has no multislerp", "karcher": "mergedb has no karcher",
    "sce": "mergedb has no sce", "nearswap": "mergedb has no nearswap", "ram": "mergedb has no ram",
    "ramplus_tl": "mergedb has no ramplus_tl", "arcee_fusion": "mergedb has no arcee_fusion",
}  # fmt: skip
TOP_KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype", "tokenizer_source"}
REFUSED_KEYS = {
    "modules": "per-module merges (modules:) are not supported; use models: for the whole model",
    "tokenizer": "tokenizer: builds a merged vocabulary; mergedb keeps the base's tokenizer (tokenizer_source: base)",
    "chat_template": "mergedb copies the base's chat template; remove chat_template",
}


@dataclass(frozen=True)
class MergeConfig:
    """A mergekit config mergedb can honour exactly; models are as written until `bind_models`."""

    merge_method: str
    models: tuple[ModelEntry, ...]
    base_model: str | None = None
    parameters: dict[str, Setting] = field(default_factory=dict)  # top level
    slice_parameters: dict[str, Setting] = field(default_factory=dict)  # a full-range slice's own
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    layer_range: tuple[int, int] | None = None  # slices form: checked against the model's layers in resolve
    base_inferred: bool = False  # linear without base_model: the experts' registered base, not an input

    @property
    def output_dtype(self) -> str | None:
        """`execute --dtype` for this config: out_dtype, else dtype (mergekit writes in it), else the base's."""
        name = self.out_dtype or self.dtype
        return DTYPES[name] if name else None

    def resolve(self, tensor_names: list[str] | tuple[str, ...]) -> Resolution:
        """Every parameter of every (expert, tensor), as mergekit evaluates it; see the module docstring."""
        return resolve(self, list(tensor_names))


# -- parsing ---------------------------------------------------------------------------------------


def _load(text_or_path: str | PathLike[str]) -> tuple[Any, str]:
    if not isinstance(text_or_path, (str, PathLike)):  # bytes read as the text "b'...'", a mapping as its repr
        raise ConfigError(f"a config is YAML text or a path to a YAML file, got {shown(text_or_path)}")
    one_line = isinstance(text_or_path, str) and "\n" not in text_or_path
    if isinstance(text_or_path, PathLike) or (
        one_line and (":" not in text_or_path or text_or_path.strip().lower().endswith((".yml", ".yaml")))
    ):  # a one-line str is a path unless it reads as YAML ('merge_method: ties'); 'v1:ties.yml' is a path
        path = Path(text_or_path)
        try:
            text, where = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
        except ValueError as e:  # a NUL byte in the path
            raise ConfigError(f"cannot read config {str(path)!r}: {e}; give the file's path") from None
    else:
        text, where = str(text_or_path), "config"
    try:
        return yaml.load(text, Loader=_LOADER), where
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4,300 digits; nesting past the stack
        raise ConfigError(f"{where}: a value YAML cannot read ({str(e).split(':')[0] or type(e).__name__})") from None


def _number(key: str, v: Any) -> float:
    if isinstance(v, str):  # mergekit validates "1e-3" (YAML 1.1 reads it as a string) as a float
        try:
            v = float(v)
        except ValueError:
            pass
    f = finite(v)  # None for NaN, ±inf and an int past float's range too
    if f is None:
        raise ConfigError(f"parameter {key}: {shown(v)} is not a finite number")
    return f


def _scalar_or_gradient(key: str, v: Any) -> float | tuple[float, ...]:
    if isinstance(v, list):
        if not v:
            raise ConfigError(f"parameter {key}: an empty gradient list; give at least one value")
        return tuple(_number(key, e) for e in v)
    return _number(key, v)


def _setting(key: str, v: Any, method: str) -> Setting:
    if key not in MERGEKIT_DEFAULTS[method]:
        known = ", ".join(MERGEKIT_DEFAULTS[method])
        raise ConfigError(f"parameter {key!r} is not a parameter of {method} (its parameters: {known})")
    if key in BOOLEAN:
        if not isinstance(v, bool):
            raise ConfigError(
                f"parameter {key}: {v!r} must be true or false (mergedb takes one {key} per merge, "
                "not a gradient or filter list)"
            )
        return v
    if isinstance(v, dict):
        v = [v]
    if isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
        conds = []
        for e in v:
            extra = set(e) - {"filter", "value"}
            if extra or "value" not in e:
                raise ConfigError(
                    f"parameter {key}: a filter entry has keys {sorted(e)}; write {{filter: NAME, value: V}}"
                )
            f = e.get("filter")
            if f is not None and not isinstance(f, str):
                raise ConfigError(f"parameter {key}: filter {f!r} must be a string (a substring of tensor names)")
            conds.append(Cond(None if f in (None, "*") else f, _scalar_or_gradient(key, e["value"])))
        return tuple(conds)
    if isinstance(v, list) and any(isinstance(e, dict) for e in v):
        raise ConfigError(f"parameter {key}: a list mixing numbers and {{filter, value}} entries")
    return _scalar_or_gradient(key, v)


def _params(where: str, raw: Any, method: str) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: parameters must be a mapping of name: value, got {type(raw).__name__}")
    return {str(key): _setting(str(key), v, method) for key, v in raw.items()}


def _model_ref(where: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{where}: model must be a path or registered name (a string), got {v!r}")
    return v  # a path that does not exist and holds `+` or `@` is refused when it is bound (bind_models)


def _entries(where: str, raw: Any, method: str, allowed: tuple[str, ...]) -> list[tuple[ModelEntry, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where} must be a non-empty list of {{model: PATH, parameters: {{...}}}}")
    out = []
    for i, e in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(e, dict) or "model" not in e:
            raise ConfigError(f"{w} must be a mapping with a model key")
        extra = sorted(set(e) - set(allowed))
        if extra:
            raise ConfigError(f"{w}: unknown key {extra[0]!r} (an entry takes {', '.join(allowed)})")
        ref = _model_ref(w, e["model"])
        out.append((ModelEntry(ref, _params(f"{w}.parameters", e.get("parameters"), method)), e))
    return out


def _slices(
    raw: Any, method: str, base_model: str | None
) -> tuple[list[ModelEntry], dict, tuple[int, int], str | None]:
    if not isinstance(raw, list) or len(raw) != 1:
        n = len(raw) if isinstance(raw, list) else raw
        raise ConfigError(
            f"slices: {n} output slices stack layer ranges (a frankenmerge); mergedb accepts one slice "
            "whose sources each cover the full layer range"
        )
    s = raw[0]
    if not isinstance(s, dict) or "sources" not in s:
        raise ConfigError("slices[0] must be a mapping with sources")
    extra = sorted(set(s) - {"sources", "base_model", "parameters"})
    if extra:
        why = "residual_weight mixes the residual stream" if extra[0] == "residual_weight" else "not a slice key"
        raise ConfigError(f"slices[0].{extra[0]}: not supported ({why})")
    sb = None if s.get("base_model") is None else _model_ref("slices[0].base_model", s["base_model"])
    if sb is not None and base_model is not None and sb != base_model:
        raise ConfigError(f"slices[0].base_model {sb!r} differs from base_model {base_model!r}; give one base")
    entries = _entries("slices[0].sources", s["sources"], method, ("model", "layer_range", "parameters"))
    ranges = set()
    for i, (_, e) in enumerate(entries):
        lr = e.get("layer_range")
        if not (isinstance(lr, list) and len(lr) == 2 and all(type(x) is int for x in lr)):
            raise ConfigError(f"slices[0].sources[{i}].layer_range must be [start, end], got {lr!r}")
        ranges.add(tuple(lr))
    if len(ranges) != 1 or next(iter(ranges))[0] != 0:
        raise ConfigError(
            f"slices[0]: layer ranges {sorted(ranges)} do not each cover the full model (a frankenmerge); "
            "mergedb accepts sources that all cover [0, number of layers]"
        )
    sp = _params("slices[0].parameters", s.get("parameters"), method)
    return [m for m, _ in entries], sp, next(iter(ranges)), sb


def _dtype(key: str, v: Any) -> str | None:
    if v is None:
        return None
    name = v[len("torch.") :] if isinstance(v, str) and v.startswith("torch.") else v
    if not isinstance(name, str) or name not in DTYPES:
        raise ConfigError(f"{key}: {v!r} is not supported; use bfloat16, float16 or float32")
    return str(name)


def parse_config(text_or_path: str | PathLike[str]) -> MergeConfig:
    """Read a mergekit YAML config (text, or a path to one) and check everything mergedb must honour."""
    raw, where = _load(text_or_path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a mergekit config is a mapping (merge_method:, models:, ...)")
    for key in raw:
        if key in REFUSED_KEYS:
            raise ConfigError(f"{key}: {REFUSED_KEYS[key]}")
        if key not in TOP_KEYS:
            raise ConfigError(f"unknown key {key!r}; a config takes {', '.join(sorted(TOP_KEYS))}")
    method = raw.get("merge_method")
    if not isinstance(method, str):
        raise ConfigError(f"merge_method: {method!r} is not a method name; e.g. merge_method: ties")
    if method in OTHER_METHODS:
        raise ConfigError(f"merge_method: {method}: {OTHER_METHODS[method]}")
    if method not in MERGEKIT_DEFAULTS:
        raise ConfigError(
            f"merge_method: {method!r} is not a mergekit method mergedb runs; one of {', '.join(MERGEKIT_DEFAULTS)}"
        )
    ts = raw.get("tokenizer_source")
    if ts not in (None, "base"):
        raise ConfigError(f"tokenizer_source: {ts!r}: mergedb keeps the base's tokenizer; use base or leave it out")
    base = None if raw.get("base_model") is None else _model_ref("base_model", raw["base_model"])
    if ("models" in raw) == ("slices" in raw):
        raise ConfigError("give exactly one of models: or slices:")
    top = _params("parameters", raw.get("parameters"), method)
    sp: dict = {}
    lr = None
    if "slices" in raw:
        models, sp, lr, sb = _slices(raw["slices"], method, base)
        base = base or sb
        if base is not None and method != "linear" and base not in [m.model for m in models]:
            raise ConfigError(f"slices[0]: base_model {base!r} is not one of the sources (mergekit refuses this)")
    else:
        models = [m for m, _ in _entries("models", raw["models"], method, ("model", "parameters"))]
    names = [m.model for m in models]
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise ConfigError(f"models: {dup[0]!r} appears twice (mergekit refuses duplicate inputs)")
    for m in models:
        shared = sorted(set(m.parameters) - PER_MODEL)
        if shared:
            raise ConfigError(
                f"model {m.model!r}: {shared[0]} is a merge-wide parameter (mergekit ignores it under a model); "
                "move it to the top-level parameters"
            )
    for s in (top, sp):
        if "rescale" in s and method in RESCALE and s["rescale"] != RESCALE[method]:
            why = WHY_RESCALE[RESCALE[method]]
            raise ConfigError(f"rescale: {str(s['rescale']).lower()} is not supported for {method}: {why}")
    if top.get("filter_wise") is True or sp.get("filter_wise") is True:
        raise ConfigError("filter_wise: true computes model_stock per row; mergedb's model_stock is per tensor")
    dtype, out_dtype = _dtype("dtype", raw.get("dtype")), _dtype("out_dtype", raw.get("out_dtype"))
    cfg = MergeConfig(method, tuple(models), base, top, sp, dtype, out_dtype, ts, lr)
    _check_contract(cfg)
    return cfg


def _check_contract(cfg: MergeConfig) -> None:
    m, base = cfg.merge_method, cfg.base_model
    experts = [e for e in cfg.models if e.model != base]
    if m != "linear" and base is None:
        raise ConfigError(f"{m} needs base_model (mergekit refuses {m} without one)")
    if m == "slerp" and len(experts) != 1:
        raise ConfigError(f"slerp merges base_model with exactly one other model; this config has {len(experts)}")
    if m == "model_stock" and len(experts) < 2:
        raise ConfigError("model_stock needs at least two models besides base_model")
    if not experts:
        raise ConfigError("models: lists no model besides base_model; nothing to merge")


# -- models: registered checkpoints ----------------------------------------------------------------


def bind_models(config: MergeConfig, rows: list[Any], cwd: str | PathLike[str] | None = None) -> MergeConfig:
    """The config with every model replaced by the name of the registered checkpoint it means.

    `rows` are `Catalog.checkpoints()` (anything with name, role, base, path, fingerprint). A
    reference that exists on disk (relative to `cwd`, as mergekit reads it) is matched by resolved
    path or, failing that, by the fingerprint of the checkpoint there; any other reference must be
    a registered name. Linear without base_model gets the experts' base.
    """
    from .checkpoint import is_checkpoint, open_checkpoint
    from .lora import is_adapter

    here = Path(cwd) if cwd is not None else Path.cwd()
    by_name = {r.name: r for r in rows}

    def find(ref: str, base_hint: str | None) -> Any:
        p = Path(ref).expanduser()
        p = p if p.is_absolute() else here / p
        if "+" in ref and not p.exists():  # mergekit's MODEL+LORA: the adapter, registered against MODEL
            left, right = ref.split("+", 1)
            b, a = find(left, None), find(right, base_hint or left)
            if b.role != "base":  # mergekit would apply the adapter to that expert: no catalog row is that sum
                raise ConfigError(
                    f"model {ref!r} applies {right!r} to {left!r}, which is registered as an expert, not a base; "
                    "mergedb applies adapters to the base they were registered against: write BASE+ADAPTER, "
                    f"or merge the adapter into {left!r} first and register the result"
                )
            if a.role != "expert" or a.base != b.name or not is_adapter(a.path):
                raise ConfigError(
                    f"model {ref!r} applies {right!r} to {left!r}, but {a.name!r} is not a LoRA adapter registered "
                    f"against base {b.name!r}; register it with: mergedb register {shlex.quote(right)} --base-model "
                    f"{shlex.quote(b.name)}"
                )
            return a
        if not p.exists():
            if ref in by_name:
                return by_name[ref]
        else:  # a path that exists means that checkpoint, never a namesake
            rp = p.resolve()
            for r in rows:
                if Path(r.path).resolve() == rp:
                    return r
            if is_checkpoint(p):  # a copy of a registered one (cp -a): the same sizes, times and headers
                fp = open_checkpoint(p).fingerprint
                same = [r for r in rows if r.fingerprint == fp]
                if len(same) > 1:  # a family unpacked from an archive: distinct experts, equal sizes and times
                    raise ConfigError(
                        f"model {ref!r} is not registered by this path, and its files' sizes, times and headers "
                        f"match {len(same)} registered checkpoints ({', '.join(r.name for r in same[:4])}), so it "
                        "cannot tell which it is a copy of; write the registered path or the name instead"
                    )
                if same:
                    return same[0]
            if ref in by_name:
                raise ConfigError(
                    f"model {ref!r} is a folder here that is not registered, and the name of the checkpoint "
                    f"registered from {by_name[ref].path}; write that path, or register the folder under another --name"
                )
        how = f"mergedb register {shlex.quote(ref)} --base" if base_hint is None else (
            f"mergedb register {shlex.quote(ref)} --base-model {shlex.quote(base_hint)}"
        )  # fmt: skip
        if p.exists():
            raise ConfigError(f"model {ref!r} is not registered in the catalog; run: {how}")
        if "@" in ref:
            raise ConfigError(f"model {ref!r} names a hub revision; download it and name the local folder")
        if ref.startswith((".", "/", "~")) or "\\" in ref or ref.count("/") > 1:
            raise ConfigError(
                f"model {ref!r}: there is no {p} (a relative path is read from {here}, as mergekit reads it) "
                "and no checkpoint registered under that name; correct the path, or run the config from its folder"
            )
        raise ConfigError(
            f"model {ref!r} is neither a folder here nor a registered name (mergedb reads local files: download "
            f"it to a folder first); then run: {how}"
        )

    base_row = find(config.base_model, None) if config.base_model is not None else None
    if base_row is not None and base_row.role != "base":
        raise ConfigError(
            f"base_model {config.base_model!r} is registered as an expert of {base_row.base!r}, not as a base"
        )
    hint = base_row.name if base_row is not None else next((r.name for r in rows if r.role == "base"), "BASE")
    found = [find(e.model, None if e.model == config.base_model else hint) for e in config.models]
    if base_row is None:  # linear: a listed base is the base (an input); otherwise the experts' shared base
        listed = [r for r in found if r.role == "base"]
        bases = {r.name for r in listed} or {r.base for r in found}
        if len(bases) != 1:
            raise ConfigError(
                f"models belong to different bases ({', '.join(sorted(map(str, bases)))}); merge one family"
            )
        base_name, inferred = next(iter(bases)), not listed
    else:
        base_name, inferred = base_row.name, False
    for e, r in zip(config.models, found):
        if r.name != base_name and (r.role != "expert" or r.base != base_name):
            raise ConfigError(f"model {e.model!r} is registered as {r.name!r} with base {r.base!r}, not {base_name!r}")
    names = [r.name for r in found]
    dup = [n for n, c in Counter(names).items() if c > 1]
    if dup:
        raise ConfigError(
            f"models: two entries are the registered checkpoint {dup[0]!r} (mergekit refuses duplicate inputs)"
        )
    models = tuple(replace(e, model=n) for e, n in zip(config.models, names))
    bound = replace(config, models=models, base_model=base_name, base_inferred=inferred)
    _check_contract(bound)  # a listed model may have turned out to be the base
    return bound


# -- export ----------------------------------------------------------------------------------------


def plan_resolution(plan: Any, tensor_params: Any = None) -> Resolution:
    """A stored plan (`plans.PlanSummary`) as a `Resolution`, for `to_mergekit_yaml`.

    `tensor_params`: the plan's per-tensor rows (position, tensor, param, value), if it has any.
    """
    table = tensor_params if tensor_params is not None else SCHEMA.empty_table()
    weights = tuple(float(e.weight) for e in plan.experts)
    return Resolution(plan.method, plan.base, tuple(e.name for e in plan.experts), weights, dict(plan.params), table)


def to_mergekit_yaml(
    res: Resolution, paths: dict[str, str], tensor_names: list[str] | None = None, base_dtype: str | None = None
) -> str:
    """A mergekit config equivalent to `res` (a stored plan's method, weights, params, overrides).

    `paths` maps checkpoint names to their registered paths. Overrides become filter lists (full
    tensor names, longest first, so one name inside another never catches it; `tensor_names`
    adds an explicit entry for any other tensor whose name contains an overridden one). The output
    dtype is the plan's, else `base_dtype` (the base's `CheckpointRow.dtype`: BF16, F16, F32).
    """
    d = export_dict(res, paths, tensor_names or [], base_dtype)
    return "# written by mergedb: an equivalent mergekit config\n" + yaml.dump(d, Dumper=_DUMPER, sort_keys=False)
