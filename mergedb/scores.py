"""Scores: measurements of stored plans (an eval loss, a distance to a target), kept in the catalog
(schema/008_scores.sql) so that a search can stop, resume from what it measured, and be queried in
SQL through the `plan_scores` view (README, "Sweeps and searches")."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import plans
from .errors import MergeDBError
from .resources import query

if TYPE_CHECKING:
    from .catalog import Catalog

MAX_METRIC = 200  # characters in a metric name


def record(cat: Catalog, plan: int | str, metric: str, value: float) -> int:
    """Store `value` of `metric` for a stored plan (by id, name or hash prefix); the new score_id.

    The metric is free text (`loss`, `mmlu`, `distance`); the value a finite number."""
    if not isinstance(metric, str) or not metric.strip() or metric != metric.strip() or len(metric) > MAX_METRIC:
        raise MergeDBError(
            f"metric {metric!r} must be a name of 1 to {MAX_METRIC} characters without leading or trailing "
            "spaces, e.g. loss"
        )
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in metric):
        raise MergeDBError(f"metric {metric!r} has control characters; use a plain name, e.g. loss")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise MergeDBError(f"score value {value!r} for metric {metric!r} is not a number, e.g. 0.42") from None
    if not math.isfinite(v):
        raise MergeDBError(
            f"score value {value!r} for metric {metric!r} is not finite; record a finite stand-in (a large "
            "loss) so SQL comparisons stay meaningful"
        )
    with cat.duckdb_connection(write=True) as con:
        pid = plans.resolve_plan(con, plan)
        rows = con.execute(query("record_score"), {"plan_id": pid, "metric": metric, "value": v}).fetchall()
    return int(rows[0][0])
