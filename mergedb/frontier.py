"""The budget frontier: for one merge, expert bytes read against the plan's deviation bound and
estimate at a ladder of budgets, so a budget can be chosen before a byte of weights is read.

`make_plans` (behind `Catalog.frontier`) makes the plans from the catalog alone, in one transaction
rolled back unless they are to be kept; `records` turns them into rows and `plot`, with the
optional `plot` extra (matplotlib), into a PNG. `candidates` (behind `Catalog.plan_candidates`)
shows what any plan of a request would choose from, also rolled back.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from . import faults, planner
from .errors import MergeDBError, PlanError

if TYPE_CHECKING:
    from .catalog import Catalog
    from .plans import PlanSummary

BUDGETS = ("5%", "10%", "25%", "50%", "75%", "100%")  # the default ladder of `mergedb frontier`


def make_plans(
    cat: Catalog, request: planner.PlanRequest, budgets: Sequence[str], *, keep: bool = False
) -> list[PlanSummary]:
    """Plan `request` at each budget from the catalog alone (no weights read): bytes against bounds.

    All plans are made in one transaction, rolled back unless `keep`, so by default nothing is
    stored, and the summaries have no plan_id (None: the ids they had are given to the next plans
    stored). Kept plans of a named request are named `NAME@BUDGET`."""
    planner.check_request(request)
    if not isinstance(keep, bool):  # keep="no" would be true
        raise PlanError(f"frontier() keep is True or False, got {keep!r}")
    budgets = [budgets] if isinstance(budgets, str) else budgets  # one budget, not its letters
    if not isinstance(budgets, (list, tuple)):  # a generator was used up by the check below: no plans
        raise PlanError(f"frontier() budgets are a list or tuple of budgets (or one), got {type(budgets).__name__}")
    twice = [b for b, n in Counter(map(str, budgets)).items() if n > 1]
    if twice:  # kept and named, the second plan's name would collide with the first's
        raise PlanError(f"budget {twice[0]!r} is listed twice; give each budget once")
    reqs = [replace(request, budget=b, name=f"{request.name}@{b}" if keep and request.name else None) for b in budgets]
    with cat.duckdb_connection(write=True) as con:
        con.execute("BEGIN")
        try:
            out = [planner.make_plan(con, r)[0] for r in reqs]
            con.execute("COMMIT" if keep else "ROLLBACK")
        except BaseException:
            faults.rollback(con)
            raise
    return out if keep else [replace(p, plan_id=None) for p in out]


def candidates(cat: Catalog, request: planner.PlanRequest) -> pa.Table:
    """Every (expert, block) candidate of `request` as the planner scores it (position, tensor_idx,
    block_idx, nbytes, free, value, score), without planning; plans store only the selection."""
    planner.check_request(request)
    with cat.duckdb_connection() as con:  # reads only: a read-only catalog serves it too
        con.execute("BEGIN")
        try:
            return planner.candidate_table(con, request)
        finally:
            faults.rollback(con)


def records(summaries: list[PlanSummary]) -> list[dict[str, Any]]:
    """One record per plan: budget, bytes read, and the deviation numbers ‖θ_B − θ_F‖ it predicts.

    `bound` is the bound on the output as written (rounded to the base's dtype); None where the
    planner did not compute it (a method it does not bound; blocks that could overflow the output
    dtype; a base registered before its norms were stored): the float32 block-wise bound
    (`bound_blockwise`) is no bound on the written output then, so it is not shown as one."""
    return [
        {
            "budget": p.budget_spec,
            "plan_id": p.plan_id,
            "selected_bytes": p.selected_bytes,
            "full_bytes": p.full_bytes,
            "share": p.selected_bytes / p.full_bytes if p.full_bytes else 1.0,
            "est_error": p.est_error,
            "bound": p.bound_rounded,
            "bound_blockwise": p.bound_blockwise,
            "bound_sum": p.bound_sum,
        }
        for p in summaries
    ]


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """Refuse a picture path `plot` could not write (not .png, its folder missing or not writable, a
    folder itself, no matplotlib), before any plan is made: `frontier --keep` stores its plans first."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise MergeDBError(f"--out {path}: the frontier picture is a PNG; give a file name ending in .png")
    if path.is_dir() or not path.parent.is_dir():
        raise MergeDBError(
            f"--out {path}: {'is a folder' if path.is_dir() else 'its folder does not exist'}; "
            "give a .png file in an existing folder"
        )
    try:  # a file made and removed beside it: what `plot` will need (a folder's mode says less, as root)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "the file is read-only")
    except OSError as e:
        raise MergeDBError(
            f"--out {path}: cannot write there ({e.strerror or e}); give a .png file in a folder you can write"
        ) from None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MergeDBError(
            "writing a frontier picture needs matplotlib; install it with: pip install 'mergedb[plot]' "
            "(or leave out --out to print the table only)"
        ) from None
    return path


def plot(rows: list[dict[str, Any]], path: str | os.PathLike[str], title: str) -> Path:
    """Draw bytes read (x) against bound and estimate (y, log scale) into the PNG `path`."""
    path = check_plot_path(path)  # matplotlib is there
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [100 * r["share"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.6, 3.6), dpi=100)
    for key, label, style in (("bound", "bound", "o-"), ("est_error", "sketch estimate", "s--")):
        pts = [(xi, r[key]) for xi, r in zip(x, rows) if r[key] is not None and r[key] > 0]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    if ax.lines:
        ax.set_yscale("log")
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no bound or estimate for this method yet", ha="center", transform=ax.transAxes)
    ax.set_xlabel("expert bytes read (% of all expert bytes)")
    ax.set_ylabel("‖θ_B − θ_F‖")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise MergeDBError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
