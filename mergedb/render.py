"""How results look in a terminal: tables (table, csv, json), plan summaries, progress bars.

Only the CLI imports this module (it prints, through rich); the library returns values. Tables are
made to be read in 80 columns and in a pipe: short headers with a legend below, numbers with three
significant digits, long paths shortened from the middle, and — when a row still cannot fit — one
record per block of `name  value` lines instead of columns folded letter by letter. Nothing heavy
is imported at module level, so `mergedb --help` stays fast; rich itself (~20 ms) is imported when a
command first prints, so a quiet one (`execute -q`) never pays it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .formats import write_csv, write_json

if TYPE_CHECKING:
    import pyarrow as pa
    from rich.console import Console

    from .plans import PlanSummary

FORMATS = ("table", "csv", "json")
DASH = "–"  # a value that does not apply
TABLE_ROWS = 1000  # rows a table prints (csv and json print all): rich takes ~0.2-0.7 ms a row


def out(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr)  # built per call so COLUMNS and redirections are honoured


def escape(text: str) -> str:
    """`text` as rich markup that prints as it is (rich's escape, imported on first use)."""
    from rich.markup import escape

    return escape(text)


def line(text: str, lead: str = "") -> None:
    """One line of a command's report: `lead` is rich markup (`[red]problem:[/] `), `text` is
    printed as it is (a path may hold `[`), never wrapped (a pipe or a file gets whole paths)."""
    out().print(lead + escape(text), highlight=False, soft_wrap=True)


def check_format(fmt: str, *extra: str) -> str:
    """`fmt` when it is one of FORMATS (`extra`: other formats the command takes, handled before)."""
    from .errors import MergeDBError

    if fmt not in FORMATS:
        raise MergeDBError(f"unknown --format {fmt!r}; use {', '.join(FORMATS[:-1] + extra)} or {FORMATS[-1]}")
    return fmt


@contextmanager
def status(quiet: bool) -> Iterator[Any]:
    """A callback showing the step a command is at (a spinner and its text on stderr), as progress's."""
    console = None if quiet else out(stderr=True)
    with console.status("starting") if console and console.is_terminal else nullcontext() as spinner:
        yield spinner and (lambda step: spinner.update(escape(step)))


@contextmanager
def progress(quiet: bool, label: str) -> Iterator[tuple[Any, Any]]:
    """(advance, set_total) callbacks driving a rich bar in bytes with rate (MB/s) and ETA."""
    if quiet or not (console := out(stderr=True)).is_terminal:  # nor into a pipe or a file (rich left an empty line)
        yield None, None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None)
        yield (lambda n: bar.advance(task, n)), (lambda total: bar.update(task, total=total))


# -- cells -------------------------------------------------------------------------------------


def num(v: float | None, digits: int = 3) -> str:
    """A number with `digits` significant digits ('–' for None)."""
    if v is None:
        return DASH
    if v == 0:
        return "0"
    return f"{v:.{digits}g}"


def size(n: float | None) -> str:
    """Bytes with three significant digits: 183 MiB, 22.6 MiB, 4.0 KiB."""
    if n is None:
        return DASH
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 999.5 or unit == "TiB":
            if unit == "B":
                return f"{n:.0f} B"
            return f"{n:.3g} {unit}" if abs(n) >= 10 else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def pct(a: float, b: float) -> str:
    if not b:
        return DASH
    p = 100 * a / b
    return f"{p:.0f}%" if p >= 10 or p == 0 else f"{p:.2g}%"


def middle(text: str, width: int) -> str:
    """`text` shortened from the middle to `width` characters (its start and its end stay)."""
    if len(text) <= width or width < 5:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def cell(v: Any) -> str:
    """Any SQL value as a table cell: floats with three significant digits, long lists elided."""
    if isinstance(v, float):
        return num(v)
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(cell(x) for x in v[:8]) + f", … {len(v)} items]"
    return "" if v is None else str(v)


# -- tables ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Col:
    """One column: its short header, the legend line that explains it, how a value is shown."""

    key: str
    header: str
    show: Callable[[Any], str] = cell
    legend: str | None = None
    right: bool = False
    shrink: bool = False  # may be shortened from the middle (paths) to fit the terminal


def print_records(
    cols: Sequence[Col],
    records: Sequence[dict[str, Any]],
    fmt: str = "table",
    *,
    title: str | None = None,
    notes: Sequence[str] = (),
) -> None:
    """Print records (dicts of raw values): csv and json carry the raw values, a table shows them."""
    if fmt == "json":
        write_json([{c.key: r.get(c.key) for c in cols} for r in records])
        return
    if fmt == "csv":
        write_csv([[c.key for c in cols], *[[r.get(c.key) for c in cols] for r in records]])
        return
    rows = [[c.show(r.get(c.key)) for c in cols] for r in records]
    legend = [f"{c.header}: {c.legend}" for c in cols if c.legend]
    _print_grid([c.header for c in cols], rows, title, [c.right for c in cols], [c.shrink for c in cols])
    o = out()
    for line in [*legend, *notes]:
        o.print(escape(line), highlight=False, soft_wrap=False)


def print_table(table: pa.Table, fmt: str = "table", title: str | None = None, narrow: str = "") -> None:
    """Print an Arrow result by column position (duplicate names keep their values; json keys get
    _2, _3). Too wide for the terminal as columns: one `name  value` block per row. A table shows
    the first TABLE_ROWS rows and says how many it left out (`narrow`: the caller's other way to see
    them); csv and json print them all."""
    from .usersql import distinct_names, table_rows

    names = table.column_names
    if fmt == "json":
        keys = distinct_names(names)
        write_json([dict(zip(keys, r)) for r in table_rows(table)])
    elif fmt == "csv":
        write_csv([names, *table_rows(table)])
    else:  # rich lays out every cell (~0.2-0.7 ms a row here): a million rows took minutes
        rows = table_rows(table.slice(0, TABLE_ROWS))
        _print_grid(names, [[cell(v) for v in r] for r in rows], title, [False] * len(names), [False] * len(names))
        if table.num_rows > TABLE_ROWS:
            line(
                f"… {table.num_rows - TABLE_ROWS:,} more rows: a table shows the first {TABLE_ROWS:,} of "
                f"{table.num_rows:,}; --format csv or json prints every row{narrow}"
            )


def _print_grid(
    headers: Sequence[str], rows: list[list[str]], title: str | None, right: Sequence[bool], shrink: Sequence[bool]
) -> None:
    from rich import box
    from rich.cells import cell_len
    from rich.table import Table

    o = out()
    whole = [list(r) for r in rows]  # the one-record-per-block view has room for every value whole
    widths = [max([cell_len(h), *(cell_len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    # SIMPLE_HEAD without edges: a column separator and a space each side between columns, none outside
    excess = sum(widths) + 3 * (len(widths) - 1) - o.width
    for i, s in enumerate(shrink):
        if excess > 0 and s and widths[i] > 16:
            cut = min(excess, widths[i] - 16)
            widths[i] -= cut
            excess -= cut
            for r in rows:
                r[i] = middle(r[i], widths[i])
    if excess > 0:
        _print_vertical(headers, whole, title)
        return
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    for h, r in zip(headers, right):
        t.add_column(escape(h), no_wrap=True, justify="right" if r else "left", overflow="fold")
    for row in rows:
        t.add_row(*(escape(v) for v in row))
    o.print(t)


def _print_vertical(headers: Sequence[str], rows: list[list[str]], title: str | None) -> None:
    """One block per record (like psql's \\x): used when the columns cannot fit side by side."""
    o = out()
    if title:
        o.print(escape(title), highlight=False)
    w = max((len(h) for h in headers), default=0)
    for n, row in enumerate(rows, 1):
        o.print(f"-[ row {n} ]" + "-" * max(0, min(o.width, 40) - 11 - len(str(n))), highlight=False)
        for h, v in zip(headers, row):
            o.print(escape(f"{h.ljust(w)}  {v}"), highlight=False, soft_wrap=True)  # a value whole, not folded
    if not rows:
        o.print("(no rows)", highlight=False)


# -- the tables of each command ----------------------------------------------------------------

CHECKPOINT_COLS = (
    Col("name", "name"),
    Col("role", "role"),
    Col("base", "base"),
    Col("dtype", "dtype"),
    Col("n_tensors", "tensors", str, right=True),
    Col("bytes", "size", size, right=True),
    Col("path", "path", shrink=True),
)

PLAN_COLS = (
    Col("plan_id", "id", str, right=True),
    Col("name", "name"),
    Col("method", "method"),
    Col("experts", "K", str, "number of experts", right=True),
    Col("budget_spec", "budget"),
    Col("selected_bytes", "read", size, "expert bytes the plan reads", right=True),
    Col("coverage", "of all", lambda v: DASH if v is None else f"{100 * v:.3g}%", "share of all expert bytes", True),
    Col("bound", "bound", num, "bound on ‖θB−θF‖ of the written output (–: not computed; show-plan says why)", True),
    Col("plan_hash", "hash", lambda v: v[:12]),
)

EXPERT_COLS = (
    Col("expert", "expert"),
    Col("weight", "weight", num, right=True),
    Col("coef", "coef", num, right=True),
    Col("selected_bytes", "read", size, right=True),
    Col("full_bytes", "full", size, right=True),
    Col("coverage", "cover", lambda v: f"{100 * v:.3g}%", right=True),
    Col("bound_blockwise", "bound", num, "per expert: block-wise bound of its omitted delta", right=True),
)


def plan_record(p: PlanSummary) -> dict[str, Any]:
    return {
        "plan_id": p.plan_id,
        "name": p.name,
        "method": p.method,
        "experts": len(p.experts),
        "budget_spec": p.budget_spec,
        "selected_bytes": p.selected_bytes,
        "full_bytes": p.full_bytes,
        "coverage": p.selected_bytes / p.full_bytes if p.full_bytes else None,
        "bound": p.bound_rounded,  # of the written output; None when not computed (show-plan says why)
        "bound_blockwise": p.bound_blockwise,
        "bound_sum": p.bound_sum,
        "est_error": p.est_error,
        "plan_hash": p.plan_hash,
    }


def print_plan(p: PlanSummary, fmt: str = "table") -> None:
    experts = [
        {
            "expert": e.name,
            "weight": e.weight,
            "coef": e.coef,
            "selected_bytes": e.selected_bytes,
            "full_bytes": e.full_bytes,
            "coverage": e.coverage,
            "bound_blockwise": e.bound_blockwise,
        }
        for e in p.experts
    ]
    if fmt == "json":
        doc = {**plan_record(p), "params": p.params, "budget_bytes": p.budget_bytes, "base": p.base}
        doc |= {"bound_rounded": p.bound_rounded, "base_bytes": p.base_bytes, "experts": experts}
        keys = ("seed", "strategy", "value_model", "min_coverage", "n_candidates", "n_selected", "free_blocks")
        doc |= {k: getattr(p, k) for k in (*keys, "bound_note", "est_kind", "planning_seconds")}  # all the table says
        write_json(doc)
        return
    if fmt == "csv":
        print_records(EXPERT_COLS, experts, "csv")
        return
    o = out()
    o.print(
        f"[bold]plan {p.plan_id}[/]{escape(' (' + p.name + ')') if p.name else ''}  "
        f"{escape(p.method)} {escape(str(p.params))}  hash {p.plan_hash[:16]}",
        highlight=False,
        soft_wrap=True,  # one line, as the other lines: a pipe's 80 columns split the hash off it
    )
    line(
        f"expert bytes: {size(p.selected_bytes)} selected of {size(p.full_bytes)} in all "
        f"({pct(p.selected_bytes, p.full_bytes)}), budget {p.budget_spec} = {size(p.budget_bytes)}"
    )
    line(
        f"blocks: {p.n_selected} selected of {p.n_candidates}; {p.free_blocks} free (identical to base, "
        f"never read, zero error); base read {size(p.base_bytes)} (not budgeted)"
    )
    if p.bound_sum is not None:
        estimate = (
            f"sketch estimate {num(p.est_error)}"
            if p.est_error is not None
            else "sketch estimate not computed (--no-estimate, or skipped for a large plan; --estimate computes it)"
        )
        why = p.bound_note or "the plan predates it"
        written = f"≤ {num(p.bound_rounded)}" if p.bound_rounded is not None else f"not computed ({why})"
        line(f"error bound ‖θ_B − θ_F‖ of the written output (in the base's dtype) {written}")
        line(
            f"error bound of the float32 merge before rounding ≤ {num(p.bound_blockwise)} (block-wise), "
            f"≤ {num(p.bound_sum)} (sum); {estimate}"
        )
    else:
        line("error bound: not applicable (the method is not a fixed-coefficient sum of deltas)")
        if p.est_error is not None:  # deviation.py: an estimate for every method
            line(f"estimate of ‖θ_B − θ_F‖ ≈ {num(p.est_error)} ({p.est_kind})")
    if p.strategy != "ranked":
        line(f"strategy: {p.strategy} (an ablation baseline: blocks in a seeded random order, not by value)")
    elif p.value_model != "norm-sqrt" or p.min_coverage is not None:  # not accessrules.DEFAULT_VALUE alone
        cover = f", min coverage {p.min_coverage:g} of each expert's useful bytes" if p.min_coverage else ""
        line(f"access rules: value {p.value_model}{cover}")
    print_records(EXPERT_COLS, experts)
    line(f"planned in {p.planning_seconds:.3f}s")


def print_config_dtype(p: PlanSummary, out_dtype: str | None, base_dtype: str, catalog: str | None) -> None:
    """After `plan --config`: the output dtype the config asks for and the `execute` command that writes it
    (a plan stores no dtype; `out_dtype` is `MergeConfig.output_dtype`, `base_dtype` the base's, e.g. BF16)."""
    import shlex

    base = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(base_dtype, base_dtype.lower())
    cmd = f"mergedb execute {shlex.quote(p.name or str(p.plan_id))} --out DIR"
    cmd += f" -c {shlex.quote(catalog)}" if catalog else ""
    if out_dtype is None or out_dtype == base:
        said = "as the config asks" if out_dtype else "the config names none"
        text = f"output dtype: {base}, the base's ({said}); next: {cmd}"
    else:
        text = f"output dtype: the config asks for {out_dtype} (the base is {base}); next: {cmd} --dtype {out_dtype}"
    out().print(escape(text), highlight=False, soft_wrap=True)  # the command on one line, to copy


def _secs(v: float) -> str:
    return f"{v:.2f}s" if v < 10 else f"{v:.3g}s"


def print_demo(res: Any, fmt: str, workdir: str) -> None:
    """The demo's table (a demo.DemoResult): one row per budget, a legend, and why a row surprises."""
    from dataclasses import asdict

    runs = f"median of {res.repeats} whole executions, each" if res.repeats != 1 else "one whole execution,"
    cols = (
        Col("budget", "budget"),
        Col("expert_bytes", "read", size, "expert bytes the plan reads", right=True),
        Col("physical_bytes", "disk", size, "bytes fetched from storage in the run (base included)", right=True),
        Col("seconds", "time", _secs, f"{runs} from a cold cache", True),
        Col("speedup", "speed-up", lambda v: f"{v:.2f}×", "the full read's time / this time", right=True),
        Col("rel_to_update", "dev", num, "‖θB−θF‖ / ‖θF−θ0‖: distance to the full merge, per unit of update", True),
        Col("bound_rel", "bound", num, "the plan's bound on dev, known before reading a byte", right=True),
    )
    records = [asdict(r) for r in res.rows]
    if fmt == "json":
        doc = {k: v for k, v in asdict(res).items() if k != "rows"}
        write_json({**doc, "rows": records})
        return
    title = f"{res.method}, {res.experts} expert{'s' * (res.experts != 1)} ({res.size} family in {workdir})"
    footer = f"demo took {res.seconds:.0f}s; the outputs are in {workdir}/merged-*"
    print_records(cols, records, fmt, title=title, notes=[*res.notes, footer] if fmt == "table" else ())


FRONTIER_COLS = (
    Col("budget", "budget"),
    Col("selected_bytes", "read", size, "expert bytes the plan reads", right=True),
    Col(
        "share",
        "of all",
        lambda v: f"{100 * v:.3g}%",
        "share of all expert bytes (blocks equal to the base are never read)",
        True,
    ),
    Col("est_error", "estimate", num, "estimate of ‖θB−θF‖ of the float32 merge, before rounding (– : none)", True),
    Col("bound", "bound", num, "bound on ‖θB−θF‖ of the output as written (–: not computed; show-plan says why)", True),
)


def print_frontier(rows: list[dict[str, Any]], fmt: str, title: str, kept: bool) -> None:
    note = "plans stored (mergedb plans lists them)" if kept else "nothing stored (--keep stores these plans)"
    cols = (Col("plan_id", "id", str, right=True), *FRONTIER_COLS) if kept else FRONTIER_COLS  # ids of stored plans
    print_records(cols, rows, fmt, title=title, notes=[note] if fmt == "table" else ())


SWEEP_COLS = (
    Col("plan_id", "id", str, right=True),
    Col("name", "plan"),
    Col("selected_bytes", "read", size, "expert bytes the plan reads (alone)", right=True),
    Col("bound", "bound", num, "bound on ‖θB−θF‖ of the written output (–: not computed; show-plan says why)", True),
)


def print_sweep(res: Any, fmt: str) -> None:
    """A sweep.SweepResult: one row per plan written, then what the sweep read against separate runs."""
    records = [{**plan_record(p), "out": str(r.out)} for p, r in res.runs]
    where = f"outputs: {res.runs[0][1].out.parent}/<plan>/" if res.runs else "no outputs"
    notes = [
        where,
        f"{len(res.runs)} plan{'s' * (len(res.runs) != 1)} in {_secs(res.seconds)}: "
        f"expert bytes read {size(res.expert_bytes_read)} "
        f"(separate runs: {size(res.expert_bytes_served)}), disk {size(res.physical_read_bytes)}, "
        f"peak RSS {size(res.peak_rss)}; {res.fold_groups} fold group(s) (plans that differ only in λ or "
        f"normalize), each block folded in {res.fold_passes} pass(es)",
    ]
    if fmt != "table":  # the table's note names the outputs' folder; a program gets each one
        print_records((*SWEEP_COLS, Col("out", "output")), records, fmt)
        return
    print_records(SWEEP_COLS, records, fmt, notes=notes)
