"""Grids of plan requests for sweeps: `--grid NAME=V1,V2` parsed, expanded into one named request
per point (`PREFIX-k1=v1-k2=v2`, so a person can find each plan), and planned in one transaction.
sweep.py executes what this plans."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import faults, planner, plans
from .errors import MergeDBError, PlanError
from .methods import METHODS
from .units import parse_budget, parse_size, reads_everything

if TYPE_CHECKING:
    from .catalog import Catalog
    from .manifest import ExecutionPlan
    from .plans import PlanSummary

GRID_SPECIAL = ("budget", "seed")  # grid keys that are request fields, not method parameters

_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
# parameters that are true or false (TIES' normalize), not numbers
_BOOLEAN = frozenset(k for m in METHODS.values() for k, v in m.defaults.items() if isinstance(v, bool))
_NUMERIC = frozenset(k for m in METHODS.values() for k, v in m.defaults.items() if not isinstance(v, bool))


def parse_grid(specs: Sequence[str]) -> dict[str, list[Any]]:
    """`["density=0.1,0.2", "lambda=1"]` -> {"density": [0.1, 0.2], "lambda": [1.0]} (the CLI's --grid).

    Numbers become floats (seed: ints), true/false booleans; `budget` values stay text (25%, 1GiB)."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key or not items:
            raise PlanError(f"--grid {spec!r}: write NAME=V1,V2,..., e.g. --grid density=0.1,0.2,0.3")
        if key in grid:
            raise PlanError(f"--grid {key} is given twice; put all its values in one --grid {key}=V1,V2")
        grid[key] = [_grid_value(key, v, spec) for v in items]
    return grid


def _grid_value(key: str, v: str, spec: str) -> Any:
    if key == "budget":  # refused as a budget here, not later as a plan name that holds it (review, 2026-12-03)
        try:
            parse_budget(v, 1)
        except MergeDBError as e:
            raise PlanError(f"--grid {spec!r}: {e}") from None
        return v
    if key == "seed":
        if not (v.isascii() and v.isdigit()):
            raise PlanError(f"--grid {spec!r}: seeds are whole numbers, e.g. --grid seed=0,1,2")
        return int(v)
    if key in _BOOLEAN and v.lower() not in ("true", "false"):
        raise PlanError(f"--grid {spec!r}: {key} is true or false, got {v!r}; e.g. --grid {key}=true,false")
    if v.lower() in ("true", "false") and key not in _NUMERIC:  # a key no method has: methods.validate says so
        return v.lower() == "true"
    if not _NUMBER.match(v):
        raise PlanError(f"--grid {spec!r}: {v!r} is not a number; e.g. --grid {key}=0.1,0.2")
    return float(v)


def grid_requests(
    template: planner.PlanRequest, grid: dict[str, Sequence[Any]], prefix: str
) -> list[planner.PlanRequest]:
    """One request per point of the grid (the product of its value lists, in the order given), each
    `template` with those parameters and named `PREFIX-k1=v1-k2=v2` so a person can find it.
    A value listed twice for a key is refused (its two plans would be one)."""
    if not grid:
        return [replace(template, name=prefix)]
    keys = list(grid)
    shown = {k: _labels(k, grid[k]) for k in keys}
    out = []
    for point in itertools.product(*(range(len(grid[k])) for k in keys)):
        params = dict(template.params)
        fields: dict[str, Any] = {}
        for k, j in zip(keys, point):
            if k in GRID_SPECIAL:
                fields[k] = grid[k][j]
            else:
                params[k] = grid[k][j]
        name = prefix + "".join(f"-{k}={shown[k][j]}" for k, j in zip(keys, point))
        out.append(replace(template, params=params, name=name, **fields))
    return out


def _labels(key: str, values: Sequence[Any]) -> list[str]:
    """How each value of `key` appears in plan names: numbers in %g's short form (the names sweeps
    have always had), or, where that shows two values alike (0.1 and 0.1000001), with the fewest
    digits that tell every value of the key apart (repr's shortest exact form, at worst)."""
    seen: dict[Any, Any] = {}
    for v in values:
        same = _budget_key(v) if key == "budget" else repr(v)  # repr: 1 and 1.0 alike; 0.0 and -0.0 not
        if same in seen:
            once = ",".join(dict.fromkeys(_label(u, 6) for u in values))
            if key == "budget" and seen[same] != v:
                raise PlanError(
                    f"--grid budget lists {seen[same]} and {v}, the same budget; give each budget once: "
                    f"--grid budget={','.join(dict.fromkeys(str(u) for u in values if u != v))}"
                )
            raise PlanError(f"--grid {key} lists {_label(v, 6)} twice; give each value once: --grid {key}={once}")
        seen[same] = v
    for digits in range(6, 17):
        labels = [_label(v, digits) for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return [_label(v, None) for v in values]  # distinct reprs (checked above): distinct labels


def _budget_key(spec: str) -> tuple[str, Any]:
    """What a budget spec asks for, so that two specs of one budget are one grid value: all and 100%
    are the full read, 25% and 25.0 % one share, 1GiB and 1024MiB one size, 0 and 0% nothing. A spec
    that does not parse stays itself (the planner says what is wrong with it)."""
    text = str(spec).strip()
    try:
        if reads_everything(text):
            return ("all", None)
        parse_budget(text, 0)  # refuses what is not a budget
        if text.endswith("%"):
            share = float(text[:-1])
            return ("share", share) if share else ("bytes", 0)
        return ("bytes", parse_size(text, what="budget"))
    except MergeDBError:
        return ("text", text)


def _label(v: Any, digits: int | None) -> str:
    """`v` in a plan name: floats to `digits` significant digits (None: repr, exact)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v) if digits is None else f"{v:.{digits}g}"
    return str(v)


def earlier_prefixes(cat: Catalog, method: str) -> list[str]:
    """The `METHOD-sweepN` prefixes of stored plans' names, by N: where an earlier run of a sweep
    without --name put its plans (rerun.check tells whether they are this sweep's)."""
    names = [r["name"] for r in cat.sql("SELECT name FROM plans WHERE name IS NOT NULL").to_pylist()]
    pattern = re.compile(rf"{re.escape(method)}-sweep([1-9][0-9]*)(-.*)?", re.DOTALL)
    found = {int(m.group(1)) for m in map(pattern.fullmatch, names) if m}
    return [f"{method}-sweep{n}" for n in sorted(found)]


def default_prefix(cat: Catalog, method: str) -> str:
    """`METHOD-sweepN` with the first N no stored plan name starts with."""
    names = {r["name"] for r in cat.sql("SELECT name FROM plans WHERE name IS NOT NULL").to_pylist()}
    for n in itertools.count(1):
        prefix = f"{method}-sweep{n}"
        if not any(x == prefix or x.startswith(prefix + "-") for x in names):
            return prefix
    raise AssertionError("unreachable")


def plan_all(cat: Catalog, items: Sequence[planner.PlanRequest | int | str]) -> list[PlanSummary]:
    """Plan every request and resolve every stored plan (id, name or hash prefix), in one
    transaction: all new plans are stored, or none."""
    return plan_and_load(cat, items, load=False)[0]


def plan_and_load(
    cat: Catalog,
    items: Sequence[planner.PlanRequest | int | str],
    load: bool = True,
    check: Callable[[list[PlanSummary], list[ExecutionPlan]], None] | None = None,
) -> tuple[list[PlanSummary], list[ExecutionPlan]]:
    """`plan_all`, and with `load` each plan's ExecutionPlan, read in the same short connection.
    `check` sees them before the plans are committed: what it raises stores none of them."""
    if not items:
        raise PlanError("a sweep needs at least one plan request")
    with cat.duckdb_connection(write=True) as con:
        con.execute("BEGIN")
        try:
            summaries = [
                planner.make_plan(con, it)[0]
                if isinstance(it, planner.PlanRequest)
                else plans.load_plan(con, plans.resolve_plan(con, it))
                for it in items
            ]
            ids = [s.plan_id for s in summaries]
            xps = [plans.execution_plan(con, i) for i in ids] if load else []
            if check is not None:
                check(summaries, xps)
            con.execute("COMMIT")
        except BaseException:
            faults.rollback(con)
            raise
        return summaries, xps
