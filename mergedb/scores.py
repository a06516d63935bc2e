"""Measurements of stored plans, kept in the catalog: scores (an eval loss, a distance to a target;
schema/008_scores.sql) so that a search can stop, resume from what it measured, and be queried in
SQL through the `plan_scores` view (README, "Sweeps and searches"); and runs (one row per
execution: ok with its bytes and seconds, or failed with its error)."""

from __future__ import annotations

import math
import numbers
import os
from typing import TYPE_CHECKING

import duckdb

from . import plans
from .errors import CatalogError, MergeDBError, PlanError
from .resources import query
from .units import utf8

if TYPE_CHECKING:
    from .catalog import Catalog
    from .executor import ExecuteResult

MAX_METRIC = 200  # characters in a metric name


def record(cat: Catalog, plan: int | str | plans.PlanSummary, metric: str, value: float) -> int:
    """Store `value` of `metric` for a stored plan (by id, name or hash prefix); the new score_id.

    The metric is free text (`loss`, `mmlu`, `distance`); the value a finite number."""
    if not isinstance(metric, str) or not metric.strip() or metric != metric.strip() or len(metric) > MAX_METRIC:
        raise MergeDBError(
            f"metric {metric!r} must be a name of 1 to {MAX_METRIC} characters without leading or trailing "
            "spaces, e.g. loss"
        )
    if not utf8(metric):
        raise MergeDBError(f"metric {metric!r} is not valid UTF-8 (bytes in another encoding); use a plain name")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in metric):
        raise MergeDBError(f"metric {metric!r} has control characters; use a plain name, e.g. loss")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        v = math.inf
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


def record_run(
    cat: Catalog,
    plan_id: int,
    out: str | os.PathLike[str],
    result: ExecuteResult | None,
    error: str | None,
    plan_hash: str | None = None,
) -> int:
    """Store one execution of a plan (ok with its measurements, or failed with its error); the new run_id.
    A plan id that is not stored is refused (its run was an orphan row `mergedb check` then reported
    as damage), and so is one whose plan is not `plan_hash` (default: the result's manifest's), the
    executed plan's id taken by another after a `forget`; and arguments of the wrong type."""
    if isinstance(plan_id, bool) or not isinstance(plan_id, numbers.Integral):
        raise MergeDBError(f"record_run() takes a stored plan's id (an int), got {plan_id!r}")
    if not isinstance(out, (str, os.PathLike)):
        raise MergeDBError(f"record_run() out is the output folder (str or Path), got {type(out).__name__}")
    if error is not None and not isinstance(error, str):
        raise MergeDBError(f"record_run() error is a message (str) or None, got {type(error).__name__}")
    if result is not None:
        from .executor import ExecuteResult  # loaded already by whoever has a result

        if not isinstance(result, ExecuteResult):
            raise MergeDBError(f"record_run() result is an ExecuteResult or None, got {type(result).__name__}")
    if plan_hash is not None and not isinstance(plan_hash, str):
        raise MergeDBError(f"record_run() plan_hash is a plan's hash (str) or None, got {type(plan_hash).__name__}")
    if plan_hash is None and result is not None:
        plan_hash = result.manifest.get("plan_hash")  # the plan the output was merged from
    plan_id = int(plan_id)
    r = result
    row = {
        "plan_id": plan_id,
        "out": _text(out),
        "status": "ok" if r is not None else "failed",
        "error": _text(error) if error is not None else None,
        "manifest_hash": r.manifest["content_hash"] if r else None,
        "seconds": r.seconds if r else None,
        "expert_bytes": r.expert_bytes if r else None,
        "physical_bytes": r.physical_bytes if r else None,
        "base_bytes": r.base_bytes if r else None,
        "bytes_written": r.bytes_written if r else None,
        "peak_rss_bytes": r.peak_rss if r else None,
    }
    try:
        with cat.duckdb_connection(write=True) as con:
            stored = con.execute("SELECT plan_hash FROM plans WHERE plan_id = ?", [plan_id]).fetchall()
            if not stored:
                raise PlanError(f"no plan {plan_id} in catalog {cat.path}; record_run() takes a stored plan's id")
            if plan_hash is not None and stored[0][0] != plan_hash:  # ids are reused after `forget --with-plans`
                raise PlanError(
                    f"plan {plan_id} of catalog {cat.path} is another plan now ({stored[0][0][:16]}, not the "
                    f"{plan_hash[:16]} executed): the plan was forgotten meanwhile and its id taken by a new one"
                )
            rid = int(con.execute("SELECT coalesce(max(run_id), 0) + 1 FROM runs").fetchall()[0][0])
            row = {"run_id": rid, **row}
            con.execute(f"INSERT INTO runs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
    except duckdb.Error as e:  # disk full, read-only file system, …
        raise CatalogError(f"cannot write to catalog {cat.path}: {e}") from None
    return rid


def _text(s: str | os.PathLike[str]) -> str:
    """Text for the catalog: names that are not valid UTF-8 are stored with \\x escapes."""
    return os.fsencode(s).decode("utf-8", "backslashreplace")
