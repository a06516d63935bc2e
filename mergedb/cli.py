"""The `mergedb` command: a thin adapter over the library. Parses, calls one function, prints."""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from typer.core import TyperGroup

from . import synth
from .catalog import Catalog, default_path
from .errors import MergeDBError
from .units import format_size


class _Group(TyperGroup):
    """Shows a MergeDBError as one clear line and exits 1; anything else is a bug with a traceback."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except MergeDBError as e:
            Console(stderr=True).print(f"[bold red]Error:[/] {e}", highlight=False, soft_wrap=True)
            ctx.exit(1)


app = typer.Typer(
    cls=_Group,
    help="mergedb: plan and run weight-space merges of fine-tuned checkpoints from a block catalog.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _out() -> Console:
    return Console()  # built per call so COLUMNS and redirections are honoured


CatalogOpt = typer.Option(
    None, "--catalog", "-c", envvar="MERGEDB_CATALOG", help="Catalog file [default: ./mergedb.duckdb]."
)
WaitOpt = typer.Option(0.0, "--wait", help="Seconds to wait for a catalog locked by another process.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bar.")


def _catalog(path: Path | None, wait: float = 0.0) -> Catalog:
    return Catalog(path or default_path(), wait=wait)


@contextmanager
def _progress(quiet: bool, label: str) -> Iterator[tuple[Any, Any]]:
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


def _print_table(table: pa.Table, fmt: str = "table", title: str | None = None) -> None:
    rows = table.to_pylist()
    if fmt == "json":
        _out().print_json(json.dumps(rows, default=str))
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(table.column_names)
        w.writerows([[r[c] for c in table.column_names] for r in rows])
        sys.stdout.write(buf.getvalue())
    else:
        t = Table(title=title)
        for c in table.column_names:
            t.add_column(c, overflow="fold")
        for r in rows:
            t.add_row(*[_cell(r[c]) for c in table.column_names])
        _out().print(t)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list) and len(v) > 8:
        return "[" + ", ".join(_cell(x) for x in v[:8]) + f", … {len(v)} items]"
    return "" if v is None else str(v)


@app.command()
def register(
    paths: list[Path] = typer.Argument(..., help="Model folders, .safetensors files, or folders of them."),
    base: bool = typer.Option(False, "--base", help="Register PATHS as base models."),
    base_model: str | None = typer.Option(None, "--base-model", help="Name of the base the experts share."),
    name: str | None = typer.Option(None, "--name", help="Name for a single checkpoint [default: folder name]."),
    block_size: str = typer.Option("4MiB", "--block-size", help="Target block size of a new base's layout."),
    refresh: bool = typer.Option(False, "--refresh", help="Re-scan experts whose files changed."),
    threads: int = typer.Option(2, "--threads", help="Worker threads."),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Scan checkpoints into the catalog (each file read once).

    Example: mergedb register ./experts --base-model base
    """
    with _progress(quiet, "register") as (advance, set_total):
        r = _catalog(catalog, wait).register(
            paths,
            base=base,
            base_model=base_model,
            name=name,
            block_size=block_size,
            refresh=refresh,
            threads=threads,
            progress=advance,
            on_total=set_total,
        )
    if not quiet:
        rate = r.bytes_read / r.seconds / 1e6 if r.seconds else 0.0
        _out().print(
            f"registered {len(r.registered)} ({', '.join(r.registered) or '-'}), unchanged {len(r.unchanged)}; "
            f"read {format_size(r.bytes_read)} in {r.seconds:.2f}s ({rate:.0f} MB/s)"
        )


@app.command("synth")
def synth_cmd(
    out_dir: Path = typer.Argument(..., help="Folder to write base/ and expert_NN/ into."),
    experts: int = typer.Option(4, "--experts", "-k", help="Number of experts."),
    size: str = typer.Option("tiny", "--size", help="tiny | small | bench."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32."),
    seed: int = typer.Option(0, "--seed"),
    shard_size: str = typer.Option("5GB", "--shard-size", help="Split models larger than this into shards."),
) -> None:
    """Generate a synthetic checkpoint family that looks like real fine-tunes.

    Example: mergedb synth ./family --experts 4 --size small
    """
    from .units import parse_size

    synth.make_family(out_dir, experts, size, dtype, seed, parse_size(shard_size, what="shard size"))
    _out().print(f"wrote {out_dir}/base and {experts} experts")


@app.command()
def sql(
    query: str = typer.Argument(..., help="One SQL statement."),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json."),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Run SQL against the catalog (read-only).

    Example: mergedb sql "SELECT * FROM expert_costs"
    """
    if fmt not in ("table", "csv", "json"):
        raise MergeDBError(f"unknown --format {fmt!r}; use table, csv or json")
    _print_table(_catalog(catalog, wait).sql(query), fmt)


@app.command("ls")
def ls_cmd(catalog: Path | None = CatalogOpt, wait: float = WaitOpt) -> None:
    """List registered checkpoints.

    Example: mergedb ls
    """
    rows = _catalog(catalog, wait).checkpoints()
    t = Table()
    for c in ("name", "role", "base", "dtype", "tensors", "size", "path"):
        t.add_column(c)
    for r in rows:
        t.add_row(r.name, r.role, r.base or "", r.dtype, str(r.n_tensors), format_size(r.bytes), r.path)
    _out().print(t)


@app.command()
def show(name: str, catalog: Path | None = CatalogOpt, wait: float = WaitOpt) -> None:
    """Show one checkpoint: its files and, for an expert, what it changed per tensor.

    Example: mergedb show expert_00
    """
    cat = _catalog(catalog, wait)
    row = cat.checkpoint(name)
    _out().print(f"[bold]{row.name}[/] ({row.role}{', base ' + row.base if row.base else ''}) {row.path}")
    _out().print(f"{row.n_tensors} tensors, {row.dtype}, {format_size(row.bytes)}, fingerprint {row.fingerprint[:16]}")
    if row.role == "expert":
        _print_table(cat.tensor_summary(name), title="per-tensor delta")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
