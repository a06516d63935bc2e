"""mergekit configs through the catalog: plan one, and write a stored plan back as one.

configs.py reads a config and mkresolve.py evaluates it over a family's tensors, both without a
catalog. The two steps here need one. `plan_from_config` (what `Catalog.plan_from_config` and
`mergedb plan --config` run) binds the config's models to registered checkpoints, evaluates it
over the base's tensors (queries/family_tensor_names.sql) and plans the result as any request.
`plan_to_mergekit` (`mergedb show-plan N --format mergekit`) turns a stored plan's effective
per-tensor values (plan_tensor_params) back into overrides of its plan-level values and writes the
config; parsed back and evaluated, it gives every mergeable tensor the values the plan merges with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from . import methods
from .configs import SCHEMA, MergeConfig, bind_models, parse_config, plan_resolution, to_mergekit_yaml
from .errors import ConfigError, MergeDBError
from .lora import is_adapter
from .mkresolve import most_common
from .planner import PlanRequest
from .resources import query

if TYPE_CHECKING:
    from .catalog import Catalog
    from .manifest import ExecutionPlan
    from .plans import PlanSummary

# param name in requests and configs -> column of plan_tensor_params / ExecutionPlan.tensor_params
_STORED = {"weight": "weight", "density": "density", "epsilon": "epsilon", "gamma": "gamma", "lambda": "lam", "t": "t"}


def tensor_names(cat: Catalog, base: str) -> list[str]:
    """The names of registered base `base`'s float tensors, in file order: what a config is evaluated
    over (integer buffers pass through from the base; mergekit plans none of them)."""
    with cat.duckdb_connection() as con:
        names = [r[0] for r in con.execute(query("family_tensor_names"), [base]).fetchall()]
    if not names:
        raise ConfigError(f"base_model {base!r} is not a registered base; run: mergedb register PATH --base")
    return names


def config_request(cfg: MergeConfig, names: list[str], budget: str = "all", name: str | None = None,
                   **options: Any) -> PlanRequest:  # fmt: skip
    """The planner request that means `cfg` (already bound to the catalog) over the tensors `names`.

    `options`: the other `PlanRequest` fields a config does not set (seed, allow_nonfinite,
    strategy, estimate)."""
    res = cfg.resolve(names)
    rows = res.tensor_params if res.tensor_params.num_rows else None
    return PlanRequest(res.base, res.experts, res.method, budget, res.weights, dict(res.params), name=name,
                       tensor_params=rows, **options)  # fmt: skip


def plan_from_config(
    cat: Catalog,
    config: str | PathLike[str] | MergeConfig,
    budget: str = "all",
    name: str | None = None,
    *,
    explain: bool = False,
    cwd: str | PathLike[str] | None = None,
    **options: Any,
) -> PlanSummary:
    """Plan a mergekit config (YAML text, a path to one, or a parsed `MergeConfig`) and store the plan.

    Models are matched to registered checkpoints by name, path (relative to `cwd`) or fingerprint;
    `options` are `PlanRequest` fields a config does not set (seed, allow_nonfinite, strategy,
    estimate). The plan does not record the config's output dtype: pass `cfg.output_dtype` to
    `execute(dtype=...)` when it is not None."""
    cfg = config if isinstance(config, MergeConfig) else parse_config(config)
    if cwd is not None and not isinstance(cwd, (str, PathLike)):  # a bare TypeError from pathlib
        raise MergeDBError(f"plan_from_config() cwd is a folder (str or Path) or None, got {type(cwd).__name__}")
    bound = bind_models(cfg, cat.checkpoints(), cwd)
    req = config_request(bound, tensor_names(cat, bound.base_model), budget, name, **options)
    return cat.plan(req, explain=explain)


def config_requests(
    cat: Catalog,
    paths: Sequence[str | PathLike[str]],
    budget: str = "all",
    prefix: str | None = None,
    *,
    cwd: str | PathLike[str] | None = None,
    **options: Any,
) -> list[tuple[PlanRequest, str | None]]:
    """One request per mergekit config file, named after the file (`STEM`, or `PREFIX-STEM`), with
    the output dtype the config asks for (None: the base's): what `mergedb sweep --configs` plans.

    Every config is read, bound and evaluated before anything is planned; an error names its file.
    `options` as for `plan_from_config`."""
    if not paths:
        raise ConfigError("--configs needs at least one config file, e.g. mergedb sweep --configs a.yml b.yml")
    stems: dict[str, str] = {}
    ckpts = cat.checkpoints()
    out = []
    for path in paths:
        stem = Path(path).stem
        name = f"{prefix}-{stem}" if prefix else stem
        if name in stems:
            raise ConfigError(f"{stems[name]} and {path} would both make the plan {name!r}; rename one of the files")
        stems[name] = str(path)
        try:
            cfg = parse_config(Path(path))
            bound = bind_models(cfg, ckpts, cwd)
            req = config_request(bound, tensor_names(cat, bound.base_model), budget, name, **options)
        except MergeDBError as e:
            msg = str(e)
            raise type(e)(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
        out.append((req, cfg.output_dtype))
    return out


def overrides(plan: PlanSummary, xp: ExecutionPlan) -> tuple[dict[str, Any], pa.Table]:
    """A plan's params and the (position, tensor, param, value) rows where its stored per-tensor values
    differ from them (see configs.SCHEMA). A per-tensor parameter without a plan-level value (SLERP's
    t given only per tensor) gets the most common stored value as its scalar."""
    params = dict(plan.params)
    tp = xp.tensor_params
    if tp is None:
        return params, SCHEMA.empty_table()
    names = [t.name for t in xp.tensors]
    cols = {c: tp.column(c).to_pylist() for c in ("position", "tensor_idx", *set(_STORED.values()))}
    weights = [float(e.weight) for e in plan.experts]
    rows: list[tuple[int, str, str, float]] = []
    for param, col in _STORED.items():
        if param == "weight" and plan.method in ("slerp", "model_stock"):
            continue  # their coefficients ignore weights
        if param != "weight" and param not in params:
            continue
        stored = [(k, names[i], v) for k, i, v in zip(cols["position"], cols["tensor_idx"], cols[col]) if v is not None]
        if param != "weight" and params[param] is None:
            params[param] = most_common([v for _, _, v in stored])  # most common, smallest on ties
        rows += [(k, t, param, v) for k, t, v in stored if v != (weights[k] if param == "weight" else params[param])]
    rows.sort()
    return params, pa.Table.from_pylist(
        [{"position": k, "tensor": t, "param": p, "value": v} for k, t, p, v in rows], schema=SCHEMA
    )


def plan_to_mergekit(cat: Catalog, plan: int | str) -> str:
    """A stored plan as an equivalent mergekit YAML config (registered paths, per-tensor values as
    filter lists, `dtype: float32` and `out_dtype` the base's: a plan does not store an output dtype)."""
    summary, xp = cat.get_plan(plan), cat.execution_plan(plan, merge=False)
    params, rows = overrides(summary, xp)
    res = replace(plan_resolution(summary, rows), params=params)
    ckpts = cat.checkpoints()
    base_dtype = next((r.dtype for r in ckpts if r.name == summary.base), None)
    adapters = {e.name for e in xp.experts if is_adapter(e.path)}  # mergekit: BASE+ADAPTER, the base with it applied
    for src in (xp.base, *xp.experts):  # mergekit reads PATH@REVISION and MODEL+LORA in any name it is given
        if "@" in str(src.path) or "+" in str(src.path):
            raise ConfigError(
                f"{src.name!r} is registered at {src.path}, whose '@' or '+' mergekit reads as a revision or a "
                "LoRA to apply, naming another model: register it from a path without them to export this plan"
            )
    paths = {r.name: f"{xp.base.path}+{r.path}" if r.name in adapters else r.path for r in ckpts}
    text = to_mergekit_yaml(res, paths, [t.name for t in xp.tensors], base_dtype)
    notes = []  # what mergekit cannot express: it reads every block, and draws DARE's drops from its own seed
    if summary.selected_bytes < summary.full_bytes:
        notes.append(
            f"# this plan reads {summary.selected_bytes} of {summary.full_bytes} expert bytes (budget "
            f"{summary.budget_spec}); mergekit reads them all: this config is the plan's full-read merge"
        )
    if methods.get_method(summary.method).sparsify in ("random", "della"):
        notes.append(f"# the plan's seed {summary.seed} is mergedb's random stream; mergekit draws its own drops")
    return "\n".join(notes) + "\n" + text if notes else text
