"""How results look in a terminal: tables (table, csv, json), plan summaries, progress bars.

Only the CLI imports this module (it prints, through rich); the library returns values.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .plans import PlanSummary
from .units import format_size
from .usersql import distinct_names, table_rows


def out() -> Console:
    return Console()  # built per call so COLUMNS and redirections are honoured


@contextmanager
def progress(quiet: bool, label: str) -> Iterator[tuple[Any, Any]]:
    """(advance, set_total) callbacks driving a rich bytes/throughput bar (no-ops when quiet)."""
    if quiet:
        yield None, None
        return
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)
        yield (lambda n: bar.advance(task, n)), (lambda total: bar.update(task, total=total))


def print_table(table: pa.Table, fmt: str = "table", title: str | None = None) -> None:
    """Print rows by column position (duplicate names keep their values; json keys get _2, _3)."""
    names, rows = table.column_names, table_rows(table)
    if fmt == "json":
        keys = distinct_names(names)
        out().print_json(json.dumps([dict(zip(keys, r)) for r in rows], default=str))
    elif fmt == "csv":
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([names, *rows])
        sys.stdout.write(buf.getvalue())
    else:
        t = Table(title=title)
        for c in names:
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*[cell(v) for v in r])
        out().print(t)


def cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(cell(x) for x in v[:8]) + f", … {len(v)} items]"
    return "" if v is None else str(v)


def pct(a: float, b: float) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def print_plan(p: PlanSummary) -> None:
    o = out()
    o.print(
        f"[bold]plan {p.plan_id}[/]{' (' + p.name + ')' if p.name else ''}  {p.method} {p.params}  "
        f"hash {p.plan_hash[:16]}"
    )
    o.print(
        f"expert bytes: {format_size(p.selected_bytes)} selected of {format_size(p.full_bytes)} full read "
        f"({pct(p.selected_bytes, p.full_bytes)}), budget {p.budget_spec} = {format_size(p.budget_bytes)}"
    )
    o.print(
        f"blocks: {p.n_selected} selected of {p.n_candidates}; {p.free_blocks} free (identical to base, "
        f"never read, zero error); base read {format_size(p.base_bytes)} (not budgeted)"
    )
    if p.bound_sum is not None:
        estimate = (
            f"sketch estimate {p.est_error:.6g}"
            if p.est_error is not None
            else "sketch estimate skipped (too many omitted blocks; --estimate computes it)"
        )
        why = p.bound_note or "the plan predates it"
        written = f"≤ {p.bound_rounded:.6g}" if p.bound_rounded is not None else f"not computed ({why})"
        o.print(f"error bound ‖θ_B − θ_F‖ of the written output (in the base's dtype) {written}")
        o.print(
            f"error bound of the float32 merge before rounding ≤ {p.bound_blockwise:.6g} (block-wise), "
            f"≤ {p.bound_sum:.6g} (sum); {estimate}"
        )
    else:
        o.print("error bound: not applicable (the method is not a fixed-coefficient sum of deltas)")
    t = Table()
    for c in ("expert", "weight", "coef", "selected", "full", "coverage", "bound"):
        t.add_column(c)
    for e in p.experts:
        t.add_row(
            e.name,
            cell(e.weight),
            cell(e.coef),
            format_size(e.selected_bytes),
            format_size(e.full_bytes),
            f"{100 * e.coverage:.1f}%",
            cell(e.bound_blockwise),
        )
    o.print(t)
    o.print(f"planned in {p.planning_seconds:.3f}s")
