"""The `mergedb` command: a thin adapter over the library. Parses, calls one function, prints.

It is long because every command declares its options as typer parameters (a dozen lines each); the
bodies stay a few lines that parse, call one library function and print."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperArgument, TyperGroup

from . import cliparse, render
from .errors import MergeDBError, PlanExistsError
from .render import escape
from .units import block_sizes, check_threads, format_size

if TYPE_CHECKING:
    from .catalog import Catalog

# Only typer loads at import (rich when a command first prints): the catalog (DuckDB, pyarrow) and the kernels are
# imported inside the commands that need them, so `mergedb --help` answers at once.


class _Group(TyperGroup):
    """Shows a MergeDBError as one clear line and exits 1; anything else is a bug with a traceback.
    Help shows plain metavars (PATH..., FILE, N) instead of typer's `{paths}...` and `<list[Path]>`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for cmd in self.commands.values():
            for p in cmd.params:
                _plain_metavar(p)
                cliparse.install(p)  # str/int/float/Path values without pydantic (~0.05 s a process)
            cmd.get_help_option = _plain_help(cmd.get_help_option)  # type: ignore[method-assign]

    def get_help_option(self, ctx: Any) -> Any:
        return _plain_help(super().get_help_option)(ctx)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except MergeDBError as e:
            # escaped: a message's own brackets (pip install 'mergedb[ray]') are text, not rich markup
            render.out(stderr=True).print(f"[bold red]Error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            ctx.exit(1)
        except KeyboardInterrupt as e:  # also SIGTERM's SystemExit when DuckDB caught it (catalog._interrupted)
            _notes(e)
            if _TERMINATED:
                raise SystemExit(128 + _TERMINATED) from None
            raise
        except SystemExit as e:  # SIGTERM (_terminated), or the command's own exit
            _notes(e)
            raise
        except RuntimeError as e:  # an interrupt raised inside a lock's release (Thread.start): "release unlocked
            cause = e.__context__  # lock" replaced it as it unwound, after the same clean-up ran
            if _TERMINATED or isinstance(cause, KeyboardInterrupt):
                raise SystemExit(128 + _TERMINATED if _TERMINATED else 130) from None
            raise


_METAVARS = {"int": "N", "float": "X", "str": "TEXT", "path": "PATH", "list[Path]": "PATH"}


def _plain_metavar(p: Any) -> None:
    """Click-style metavars: `PATH...` for many arguments, `FILE`/`N`/`TEXT` for options, none for flags."""
    if isinstance(p, TyperArgument):
        name = p.metavar or (p.name or "ARG").upper()
        shown = name if p.nargs == 1 else f"{name.rstrip('S')}..."
        p.metavar = shown
        p._usage_display_name = lambda: shown if p.required else f"[{shown}]"
        p.display_type_rich = lambda ctx: None
    elif p.metavar is None:
        p.metavar = "" if p.is_flag else _METAVARS.get(p.display_type(None).strip("<>"), "TEXT")
    if p.help:
        p.help = p.help.replace("[", "\\[")  # help text is rich markup: keep "[default: …]" as written


def _plain_help(get: Any) -> Any:
    def get_help_option(ctx: Any) -> Any:
        opt = get(ctx)
        if opt is not None:
            opt.metavar = ""
            cliparse.install(opt)
        return opt

    return get_help_option


app = typer.Typer(
    cls=_Group,
    help="mergedb: plan and run weight-space merges of fine-tuned checkpoints from a block catalog.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


CatalogOpt = typer.Option(
    None, "--catalog", "-c", envvar="MERGEDB_CATALOG", metavar="FILE", help="Catalog file (default: ./mergedb.duckdb)."
)
WaitOpt = typer.Option(0.0, "--wait", help="Seconds to wait for a catalog locked by another process.")
# per-method defaults for plan's help, written out (importing methods would load numpy for --help;
# test_help checks them against methods.METHODS)
DENSITY_DEFAULTS = (
    "[default: ties 0.2; dare_linear, dare_ties 0.5; della, della_linear 0.7; breadcrumbs, breadcrumbs_ties 0.9]"
)
NORMALIZE_DEFAULTS = "[default: on for linear, ties, dare_ties, breadcrumbs_ties, della]"
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress bar.")


FormatOpt = typer.Option("table", "--format", "-f", metavar="FMT", help="table | csv | json.")
# --ray (execute, register): run the work as Ray tasks (mergedb/rayexec.py; pip install 'mergedb[ray]')
RayOpt = typer.Option(
    None,
    "--ray",
    metavar="ADDRESS",
    help="Run on Ray: local (start one here), auto (this machine's cluster) or the head's address.",
)


def _experts_and_weights(
    experts: str | None, all_experts: bool, weights: str | None
) -> tuple[tuple[str, ...] | None, tuple[float, ...] | None]:
    """--experts a,b,c (or --all: None) and --weights 1,0.5 (or None) of `plan` and `sweep`."""
    if (experts is None) == (not all_experts):
        raise MergeDBError("name the experts with --experts a,b,c or pass --all")
    names = tuple(e.strip() for e in experts.split(",") if e.strip()) if experts else None
    try:
        w = tuple(float(x) for x in weights.split(",")) if weights else None
    except ValueError:
        raise MergeDBError(f"--weights {weights!r}: give comma-separated numbers, e.g. --weights 1,0.5,0.5") from None
    return names, w


def _catalog(path: Path | None, wait: float = 0.0) -> Catalog:
    from .catalog import Catalog, default_path

    return Catalog(path or default_path(), wait=wait, on_wait=_waiting)  # told only when it waits


def _waiting(message: str) -> None:
    """Said once when a command waits for a catalog another process holds (--wait; execute's record)."""
    render.out(stderr=True).print(escape(message), highlight=False, soft_wrap=True)


def _notes(e: BaseException) -> None:
    """An interrupt's notes (what was complete when it came: catalog.Catalog.execute) on stderr."""
    for note in getattr(e, "__notes__", ()):
        render.out(stderr=True).print(escape(note), highlight=False, soft_wrap=True)


@app.command()
def register(
    paths: list[str] = typer.Argument(
        ..., help="Model folders, .safetensors files, folders of them, or URLs (s3://…, https://…/model.safetensors)."
    ),
    base: bool = typer.Option(False, "--base", help="Register PATHS as base models."),
    base_model: str | None = typer.Option(None, "--base-model", help="Name of the base the experts share."),
    name: str | None = typer.Option(None, "--name", help="Name for a single checkpoint [default: folder name]."),
    block_size: str | None = typer.Option(
        None,
        "--block-size",
        show_default=False,
        help="Block size of a new base's layout: a size (1B-1TiB) for every tensor, or auto: the "
        "vocabulary tensors (embeddings, LM heads) in 64KiB blocks of at most 64 rows, others 4MiB "
        "[default: auto].",
    ),
    vocab_block_size: str | None = typer.Option(
        None, "--vocab-block-size", help="Block size of a new base's vocabulary tensors only (1B-1TiB)."
    ),
    refresh: bool = typer.Option(
        False,
        "--refresh",
        help="Re-scan experts whose files changed, and an expert named itself (bytes changed in place: --verify).",
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        show_default=False,
        help="Worker threads (1 to 1024) [default: this machine's cores; with --ray, 1 per expert's task].",
    ),
    ray: str | None = RayOpt,
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Scan checkpoints into the catalog (each file read once).

    Example: mergedb register ./experts --base-model base
    Remote: mergedb register s3://bucket/family --base-model base (pip install 'mergedb\\[remote]')
    """
    rule = None  # the default for a new base, and an existing base's own layout
    if block_size is not None or vocab_block_size is not None:  # checked here, before any read
        rule = block_sizes("auto" if block_size is None else block_size, vocab_block_size)
    if threads is not None:
        check_threads(threads)
    scanner = None
    if ray is not None:
        from .rayexec import expert_scanner  # one Ray task per expert; this process writes the catalog

        scanner = expert_scanner(ray, threads_per_task=threads or 1)  # as execute --ray: --threads cores a task
    with _held_progress(quiet, "register") as (advance, on_total):
        r = _catalog(catalog, wait).register(
            paths,
            base=base,
            base_model=base_model,
            name=name,
            block_size=rule,
            refresh=refresh,
            threads=threads or os.cpu_count() or 1,
            progress=advance,
            on_total=on_total,
            scanner=scanner,
        )
    if not quiet:
        rate = r.bytes_read / r.seconds / 1e6 if r.seconds else 0.0
        moved = f" (moved here: {', '.join(r.moved)})" if r.moved else ""
        render.line(
            f"registered {len(r.registered)} ({', '.join(r.registered) or '-'}), unchanged {len(r.unchanged)}{moved}; "
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
    from . import synth
    from .units import parse_size

    if not 0 <= experts <= synth.MAX_EXPERTS:  # before the folder names below are listed
        raise MergeDBError(f"--experts must be a whole number from 0 to {synth.MAX_EXPERTS}, got {experts}")
    taken = [d for d in ["base", *(f"expert_{k:02d}" for k in range(experts))] if (out_dir / d).exists()]
    if taken:  # never over a model (a real one would be overwritten file by file)
        raise MergeDBError(
            f"{out_dir / taken[0]} exists; synth writes new checkpoints there: choose a new or empty folder"
        )
    synth.make_family(out_dir, experts, size, dtype, seed, parse_size(shard_size, what="shard size"))
    render.line(f"wrote {out_dir}/base and {experts} experts")


@app.command()
def sql(
    query: str = typer.Argument(..., help="One SQL statement."),
    fmt: str = FormatOpt,
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Run one read-only query (SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN…) on the catalog.

    Example: mergedb sql "SELECT * FROM expert_costs"
    """
    narrow = " (or narrow the query with WHERE or LIMIT)"
    render.print_table(_catalog(catalog, wait).sql(query), render.check_format(fmt), narrow=narrow)


@app.command("ls")
def ls_cmd(fmt: str = FormatOpt, catalog: Path | None = CatalogOpt, wait: float = WaitOpt) -> None:
    """List registered checkpoints.

    Example: mergedb ls --format csv
    """
    from dataclasses import asdict

    rows = _catalog(catalog, wait).checkpoints()
    render.print_records(render.CHECKPOINT_COLS, [asdict(r) for r in rows], render.check_format(fmt))


@app.command()
def show(
    name: str = typer.Argument(..., metavar="NAME", help="A registered checkpoint."),
    fmt: str = FormatOpt,
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Show one checkpoint: its files and, for an expert, what it changed per tensor.

    Example: mergedb show expert_00
    """
    cat = _catalog(catalog, wait)
    row = cat.checkpoint(name)
    if render.check_format(fmt) != "table":  # csv, json: the per-tensor rows (a base has none: the header only)
        render.print_table(cat.tensor_summary(name), fmt)
        return
    render.line(f" ({row.role}{', base ' + row.base if row.base else ''}) {row.path}", f"[bold]{escape(row.name)}[/]")
    render.line(f"{row.n_tensors} tensors, {row.dtype}, {format_size(row.bytes)}, fingerprint {row.fingerprint[:16]}")
    if row.role == "expert":
        render.print_table(cat.tensor_summary(name), title="per-tensor delta")


@app.command()
def plan(
    base: str | None = typer.Option(None, "--base", help="Name of the registered base."),
    experts: str | None = typer.Option(None, "--experts", help="Comma-separated expert names, in order."),
    all_experts: bool = typer.Option(False, "--all", help="Every expert of the base."),
    method: str | None = typer.Option(
        None,
        "--method",
        "-m",
        help="linear, task_arithmetic, ties, dare_linear, dare_ties, "
        "breadcrumbs, breadcrumbs_ties, della, della_linear, model_stock, slerp.",
    ),
    config: Path | None = typer.Option(
        None, "--config", metavar="FILE", help="A mergekit YAML config: it sets the models, method and parameters."
    ),
    budget: str = typer.Option("all", "--budget", "-b", help="Expert bytes to read: 500MB, 2GiB, 25%, all, 0."),
    weights: str | None = typer.Option(None, "--weights", help="Comma-separated weights, one per expert."),
    density: float | None = typer.Option(None, "--density", help=f"Fraction of each delta kept. {DENSITY_DEFAULTS}"),
    lam: float | None = typer.Option(None, "--lambda", help="Scale of the merged delta. [default: 1]"),
    gamma: float | None = typer.Option(
        None, "--gamma", help="Breadcrumbs: fraction of largest deltas dropped. [default: 0.01]"
    ),
    epsilon: float | None = typer.Option(
        None, "--epsilon", help="DELLA: spread of keep probabilities. [default: 0.15]"
    ),
    t: float | None = typer.Option(None, "--t", help="SLERP: 0 gives the base, 1 the expert."),
    normalize: bool | None = typer.Option(
        None, "--normalize/--no-normalize", help=f"Divide by the weights' sum. {NORMALIZE_DEFAULTS}"
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the random drops (DARE, DELLA)."),
    name: str | None = typer.Option(None, "--name", help="A name to refer to the plan by."),
    allow_nonfinite: bool = typer.Option(
        False, "--allow-nonfinite", help="Leave NaN/Inf blocks out instead of refusing."
    ),
    strategy: str = typer.Option(
        "ranked", "--strategy", help="ranked (by value for the bytes: --value) or random (ablation)."
    ),
    estimate: bool | None = typer.Option(
        None, "--estimate/--no-estimate", help="Sketch error estimate (default: up to 2M omitted blocks)."
    ),
    explain: bool = typer.Option(False, "--explain", help="Print the SQL steps that ran, with row counts."),
    # access-set rules (accessrules.py; README "Access-set rules")
    value_model: str | None = typer.Option(
        None,
        "--value",
        show_default=False,
        help="Value of a block per byte: norm-sqrt (|c|·‖Δ‖ per √byte), norm (per byte) or consensus (TIES-style "
        "methods) [default: norm-sqrt; --strategy random ignores values].",
    ),
    min_coverage: float | None = typer.Option(
        None, "--min-coverage", metavar="F", help="Read at least fraction F of each expert's useful bytes first."
    ),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Plan a merge under a byte budget, from the catalog alone.

    Example: mergedb plan --base base --all --method ties --density 0.2 --budget 25%
    """
    if config is not None:
        given = {"--base": base, "--experts": experts, "--all": all_experts or None, "--method": method}
        given |= {"--weights": weights, "--density": density, "--lambda": lam, "--gamma": gamma}
        clash = [
            f
            for f, v in {**given, "--epsilon": epsilon, "--t": t, "--normalize/--no-normalize": normalize}.items()
            if v is not None
        ]
        if clash:
            raise MergeDBError(f"{clash[0]} cannot be combined with --config: the config sets it; change it there")
        from .configs import parse_config

        cfg, cat = parse_config(config), _catalog(catalog, wait)
        opts = {"seed": seed, "allow_nonfinite": allow_nonfinite, "strategy": strategy, "estimate": estimate}
        opts |= {"value_model": value_model, "min_coverage": min_coverage}  # access-set rules
        summary = cat.plan_from_config(cfg, budget, name, explain=explain, **opts)
        _print_plan(summary)
        render.print_config_dtype(
            summary, cfg.output_dtype, cat.checkpoint(summary.base).dtype, catalog and str(catalog)
        )
        return
    if base is None or method is None:
        raise MergeDBError("give --base and --method (or a mergekit config: --config merge.yml)")
    names, w = _experts_and_weights(experts, all_experts, weights)
    params = {
        k: v
        for k, v in {
            "density": density,
            "lambda": lam,
            "gamma": gamma,
            "epsilon": epsilon,
            "t": t,
            "normalize": normalize,
        }.items()
        if v is not None
    }
    from .planner import PlanRequest

    req = PlanRequest(
        base,
        names,
        method,
        budget,
        w,
        params,
        seed,
        name,
        allow_nonfinite,
        strategy,
        estimate,
        value_model=value_model,
        min_coverage=min_coverage,
    )
    _print_plan(_catalog(catalog, wait).plan(req, explain=explain))


def _print_plan(summary: Any) -> None:
    for step, sql_text, rows in summary.explain:  # only with --explain
        render.line("", f"[bold]-- {escape(step)}: {rows} rows[/]")
        render.out().print(sql_text.strip(), highlight=False, markup=False, soft_wrap=True)  # SQL as written
    render.print_plan(summary)


@app.command()
def plans(fmt: str = FormatOpt, catalog: Path | None = CatalogOpt, wait: float = WaitOpt) -> None:
    """List stored plans.

    Example: mergedb plans --format json
    """
    records = [render.plan_record(p) for p in _catalog(catalog, wait).plans()]
    render.print_records(render.PLAN_COLS, records, render.check_format(fmt))


@app.command("show-plan")
def show_plan(
    plan_ref: str = typer.Argument(..., metavar="PLAN", help="Plan id, name or hash prefix."),
    fmt: str = typer.Option(
        "table", "--format", "-f", metavar="FMT", help="table | csv | json | mergekit (an equivalent mergekit config)."
    ),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Show one plan: budget, coverage per expert, error bounds; or write it as a mergekit config.

    Example: mergedb show-plan 1 --format mergekit > merge.yml
    """
    if fmt == "mergekit":
        from .mkplan import plan_to_mergekit

        return typer.echo(plan_to_mergekit(_catalog(catalog, wait), plan_ref), nl=False)  # the YAML alone
    fmt = render.check_format(fmt, "mergekit")
    render.print_plan(_catalog(catalog, wait).get_plan(plan_ref), fmt)


@app.command()
def execute(
    plan_ref: str = typer.Argument(..., metavar="PLAN", help="Plan id, name or hash prefix."),
    out_dir: Path | None = typer.Option(
        None, "--out", "-o", help="Output folder (created; must not exist or be empty)."
    ),
    max_shard_size: str | None = typer.Option(None, "--max-shard-size", help="Largest output shard [default: 5GB]."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 [default: the base's]."),
    verify: bool = typer.Option(False, "--verify", help="Re-hash every block read against the catalog."),
    force: bool = typer.Option(False, "--force", help="Replace a previous mergedb output in --out."),
    threads: int | None = typer.Option(
        None, "--threads", help="Merge threads (1 to 1024; the output does not depend on it) [default: all cores]."
    ),
    ray: str | None = RayOpt,
    as_lora: Path | None = typer.Option(
        None,
        "--as-lora",
        help="Write a PEFT LoRA adapter folder here instead of a model (linear / task_arithmetic over adapters; "
        "float32 factors unless --dtype).",
    ),
    rank: int | None = typer.Option(
        None, "--rank", help="With --as-lora: cut each module to this rank (truncated SVD) [default: exact]."
    ),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Merge a plan into a Hugging-Face folder, reading only the planned expert bytes.

    Example: mergedb execute 1 --out ./merged   (or --as-lora ./adapter [--rank 16])
    """
    from .units import parse_size

    if (out_dir is None) == (as_lora is None):
        raise MergeDBError("give --out DIR (a model) or --as-lora DIR (a LoRA adapter), one of them")
    if rank is not None and as_lora is None:
        raise MergeDBError("--rank applies to a LoRA output only: use it with --as-lora DIR")
    if ray is not None and as_lora is not None:
        raise MergeDBError("--ray writes a model (--out DIR); an --as-lora adapter is written here: drop --ray")
    if max_shard_size is not None and as_lora is not None:
        raise MergeDBError("--max-shard-size applies to a model (--out DIR); an --as-lora adapter is one file")
    if as_lora is not None:
        res = _catalog(catalog, wait).execute(
            plan_ref, as_lora, dtype=dtype, force=force, as_lora=True, rank=rank, verify=verify, threads=threads
        )
        lo = res.manifest["lora"]
        ranks = sorted({m["rank"] for m in lo["modules"]})
        if not quiet:
            render.line(
                f"wrote adapter {as_lora}: {len(lo['modules'])} modules, rank {'/'.join(map(str, ranks)) or 0}"
                + (" (exact)" if lo["exact"] else f", largest relative error {lo['max_rel_error']:.3g}")
                + f", expert bytes {format_size(res.expert_bytes)}, {res.seconds:.2f}s"
            )
        return

    shard = parse_size("5GB" if max_shard_size is None else max_shard_size, what="shard size")
    write_shards = None
    if ray is not None:
        from .rayexec import shard_writer  # one Ray task per shard, each on --threads cores (default 1)

        write_shards = shard_writer(ray, verify=verify, threads=threads or 1)
    _end_fast()
    with _held_progress(quiet, "merge") as (advance, on_total):
        res = _catalog(catalog, wait).execute(
            plan_ref,
            out_dir,
            max_shard_size=shard,
            dtype=dtype,
            verify=verify,
            force=force,
            progress=advance,
            on_total=on_total,
            threads=threads,
            write_shards=write_shards,
        )
    if not quiet:
        render.line(
            f"wrote {out_dir}: expert bytes {format_size(res.expert_bytes)} "
            f"(budget {format_size(res.manifest['budget_bytes'])}), "
            f"base {format_size(res.base_bytes)}, physical reads {format_size(res.physical_bytes)}, "
            f"{res.seconds:.2f}s, peak RSS {format_size(res.peak_rss)}"
        )


@app.command()
def replay(
    manifest: Path = typer.Argument(..., help="An output's mergedb_manifest.json (or the output's folder)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Folder to re-create the model in."),
    force: bool = typer.Option(False, "--force", help="Replace a previous mergedb output in --out."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Re-execute a merge from its manifest and mask alone, and verify every tensor hash. Where a
    catalog is (--catalog, else ./mergedb.duckdb if there), --out is refused over its checkpoints.

    Example: mergedb replay ./merged/mergedb_manifest.json --out ./merged-again
    """
    from . import loraout, outdir

    cat = _catalog(catalog, wait)
    if catalog is not None or cat.path.exists():  # as execute: never into, over or around a registered checkpoint
        registered = cat.sql("SELECT path, root FROM checkpoints").to_pylist()
        with outdir.named("--out"):
            outdir.check_clear_of(out_dir, [p for r in registered for p in r.values()], "a registered checkpoint")
    with _held_progress(quiet, "replay") as (advance, on_total):  # a model (executor.replay) or an adapter
        res = loraout.replay(manifest, out_dir, force=force, progress=advance, on_total=on_total)
    if not quiet:
        render.line(f"replayed into {out_dir}: {len(res.manifest['tensor_hashes'])} tensors identical to the original")


@app.command()
def demo(
    workdir: Path = typer.Option(
        Path("mergedb-demo"),
        "--dir",
        metavar="DIR",
        help="Working folder: new or empty; a rerun replaces only what the demo wrote.",
    ),
    # the same defaults as mergedb.demo's DEFAULT_* (written out: importing demo would load numpy for --help)
    experts: int = typer.Option(16, "--experts", "-k", help="Number of experts."),
    size: str = typer.Option("small", "--size", help="tiny | small | bench."),
    repeats: int = typer.Option(3, "--repeats", help="Cold-cache runs per budget; the median is shown."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress line."),
    fmt: str = FormatOpt,
) -> None:
    """Generate a family, register it, merge at 100/50/10% budgets from a cold cache, and compare.

    Example: mergedb demo --dir ./mergedb-demo
    """
    from .demo import demo as run

    render.check_format(fmt)
    with render.status(quiet) as say:
        res = run(workdir, experts, size, repeats=repeats, progress=say)
    render.print_demo(res, fmt, str(workdir))


@app.command()
def frontier(
    base: str = typer.Option(..., "--base", help="Name of the registered base."),
    method: str = typer.Option(..., "--method", "-m", help="Merge method, as for `mergedb plan`."),
    experts: str | None = typer.Option(None, "--experts", help="Comma-separated expert names (default: all)."),
    lam: float | None = typer.Option(None, "--lambda", help="Scale of the merged delta. [default: 1]"),
    density: float | None = typer.Option(None, "--density", help=f"Fraction of each delta kept. {DENSITY_DEFAULTS}"),
    t: float | None = typer.Option(None, "--t", help="SLERP: 0 gives the base, 1 the expert."),
    out_png: Path | None = typer.Option(None, "--out", "-o", metavar="FILE", help="Also draw it into a PNG."),
    keep: bool = typer.Option(False, "--keep", help="Store the plans (named NAME@BUDGET with --name)."),
    name: str | None = typer.Option(None, "--name", help="Base name of kept plans."),
    fmt: str = FormatOpt,
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Bytes read against deviation at 5-100% budgets, from the catalog alone (nothing stored).

    Example: mergedb frontier --base base -m task_arithmetic --out frontier.png
    """
    from . import frontier as fr
    from .planner import PlanRequest

    render.check_format(fmt)
    names = tuple(e.strip() for e in experts.split(",") if e.strip()) if experts else None
    params = {k: v for k, v in {"lambda": lam, "density": density, "t": t}.items() if v is not None}
    if out_png is not None:
        fr.check_plot_path(out_png)  # before --keep stores anything
    summaries = _catalog(catalog, wait).frontier(PlanRequest(base, names, method, params=params, name=name), keep=keep)
    rows = fr.records(summaries)
    title = f"{method} over {len(summaries[0].experts)} experts of {base}"
    render.print_frontier(rows, fmt, title, kept=keep)
    if out_png is not None:
        fr.plot(rows, out_png, title)
        if fmt == "table":
            render.line(f"wrote {out_png}")


@app.command()
def check(
    output: list[Path] = typer.Option([], "--output", help="Also verify a merged output against its manifest."),
    deep: bool = typer.Option(False, "--deep", help="Re-hash every registered block (reads all files)."),
    quiet: bool = QuietOpt,
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Verify the catalog against the files (and outputs against their manifests).

    Example: mergedb check --deep --output ./merged
    """
    from .check import check_catalog, check_output

    cat = _catalog(catalog, wait)
    alone = bool(output) and catalog is None and not cat.path.exists()  # an output checked on its own machine
    found = []
    if not alone:
        with render.progress(quiet or not deep, "check") as (advance, set_total):  # --deep reads every file
            found = check_catalog(cat, deep, advance, set_total)
    problems = [f"{p.where}: {p.what} (fix: {p.fix})" for p in found]
    for o in output:
        problems += check_output(o)
    for p in problems:
        render.line(p, "[red]problem:[/] ")
    if problems:
        raise typer.Exit(1)
    render.line("ok: " + ("outputs" if alone else "catalog" + (" and outputs" if output else "")) + " verified")


@app.command()
def sweep(
    config_files: list[Path] | None = typer.Argument(
        None, metavar="CONFIG", help="With --configs: mergekit YAML configs, one plan each."
    ),
    configs: bool = typer.Option(
        False, "--configs", help="Plan each CONFIG file (a mergekit config) as a plan named after the file."
    ),
    base: str | None = typer.Option(None, "--base", help="Name of the registered base."),
    experts: str | None = typer.Option(None, "--experts", help="Comma-separated expert names, in order."),
    all_experts: bool = typer.Option(False, "--all", help="Every expert of the base."),
    method: str | None = typer.Option(None, "--method", "-m", help="Merge method, as for `mergedb plan`."),
    grid: list[str] = typer.Option(
        [], "--grid", help="NAME=V1,V2,...: values of density, lambda, gamma, epsilon, normalize, budget or seed."
    ),
    budget: str | None = typer.Option(
        None, "--budget", "-b", help="Expert bytes each plan may read: 500MB, 25%, all. [default: all]"
    ),
    weights: str | None = typer.Option(None, "--weights", help="Comma-separated weights, one per expert."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the random drops (DARE, DELLA). [default: 0]"),
    name: str | None = typer.Option(
        None, "--name", help="Prefix of the plans' names [default: METHOD-sweepN; with --configs none]."
    ),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Folder that receives one output folder per plan."),
    max_parallel: int = typer.Option(8, "--max-parallel", help="Plans merged at once (memory grows with it)."),
    threads: int | None = typer.Option(None, "--threads", help="Merge threads per plan [default: cores / plans]."),
    dtype: str | None = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 [default: the base's]."),
    max_shard_size: str | None = typer.Option(None, "--max-shard-size", help="Largest output shard [default: 5GB]."),
    quiet: bool = QuietOpt,
    fmt: str = FormatOpt,
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Plan a parameter grid (or mergekit configs) and merge every plan in one pass over the experts.

    Example: mergedb sweep --base base --all -m ties --grid density=0.1,0.2,0.3 --grid lambda=0.5,1 --out sweeps

    Example: mergedb sweep --configs a.yml b.yml --out sweeps
    """
    from . import grid as grids
    from . import sweep as sw
    from .planner import PlanRequest
    from .units import parse_size

    render.check_format(fmt)
    shard = parse_size("5GB" if max_shard_size is None else max_shard_size, what="shard size")
    cat = _catalog(catalog, wait)
    dtypes: str | None | list[str | None] = dtype
    if configs:
        given = {"--base": base, "--experts": experts, "--all": all_experts or None, "--method": method}
        clash = [f for f, v in {**given, "--weights": weights, "--grid": grid or None}.items() if v is not None]
        if clash:
            raise MergeDBError(f"{clash[0]} cannot be combined with --configs: each config sets it; change it there")
        from .mkplan import config_requests

        pairs = config_requests(cat, config_files or [], budget or "all", name, seed=seed or 0)
        requests = [r for r, _ in pairs]
        dtypes = [dtype or d for _, d in pairs]  # --dtype overrides every config's
    else:
        if config_files:
            raise MergeDBError(f"unexpected argument {str(config_files[0])!r}; config files need --configs")
        if base is None or method is None:
            raise MergeDBError("give --base and --method (or mergekit configs: --configs a.yml b.yml)")
        names, w = _experts_and_weights(experts, all_experts, weights)
        axes = grids.parse_grid(grid)
        for key, given_value in (("budget", budget), ("seed", seed)):  # one of them would be dropped, silently
            if key in axes and given_value is not None:
                raise MergeDBError(
                    f"--{key} {given_value} and --grid {key}=… both set each plan's {key}; give its values in the "
                    f"grid only (with {given_value}: --grid {key}={','.join(map(str, [given_value, *axes[key]][:3]))})"
                )
        template = PlanRequest(base, names, method, budget or "all", w, seed=seed or 0)
        if name is None:  # the same command run again: its earlier run's plans are under METHOD-sweepN
            from . import rerun

            for earlier in grids.earlier_prefixes(cat, method):
                again = grids.grid_requests(template, axes, earlier)
                rerun.check(cat, again, out_dir, [dtype] * len(again), shard)  # raises if they are this sweep's
        requests = grids.grid_requests(template, axes, name or grids.default_prefix(cat, method))
    for attempt in range(5):
        try:
            with _held_progress(quiet, "sweep") as (advance, on_total):
                res = sw.sweep(
                    cat,
                    requests,
                    out_dir,
                    max_parallel=max_parallel,
                    threads=threads,
                    dtype=dtypes,
                    max_shard_size=shard,
                    progress=advance,
                    on_total=on_total,
                )
            break
        except PlanExistsError:  # another sweep took the default METHOD-sweepN between the two: take the next
            if name is not None or configs or attempt == 4:
                raise
            requests = grids.grid_requests(template, grids.parse_grid(grid), grids.default_prefix(cat, method))
    render.print_sweep(res, fmt)


@app.command(context_settings={"ignore_unknown_options": True})  # VALUE may be negative: -1.5 is not an option
def score(
    plan_ref: str = typer.Argument(..., metavar="PLAN", help="Plan id, name or hash prefix."),
    metric: str = typer.Argument(..., metavar="METRIC", help="What was measured, e.g. loss."),
    value: float = typer.Argument(..., metavar="VALUE", help="The measurement (a finite number)."),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Record a measurement of a plan's merge, to query in SQL (the plan_scores view).

    Example: mergedb score ties-sweep1-density=0.2 loss 1.87
    """
    score_id = _catalog(catalog, wait).record_score(plan_ref, metric, value)
    render.line(f"score {score_id}: {metric} = {value!r} for plan {plan_ref}")


@app.command()
def forget(
    names: list[str] = typer.Argument(..., metavar="NAME", help="Registered checkpoints to remove."),
    with_plans: bool = typer.Option(False, "--with-plans", help="Also remove the stored plans that merge them."),
    catalog: Path | None = CatalogOpt,
    wait: float = WaitOpt,
) -> None:
    """Remove checkpoints from the catalog (an expert deleted from disk); a base only with all its experts.

    Example: mergedb forget expert_03 --with-plans
    """
    res = _catalog(catalog, wait).forget(names, with_plans)
    plans_gone = f" and {len(res.plans)} plan{'s' * (len(res.plans) != 1)} ({', '.join(map(str, res.plans))})"
    render.line(f"forgot {', '.join(res.checkpoints)}{plans_gone if res.plans else ''}; no file was touched")


_PROCESS = False  # running as the `mergedb` command (main), not inside another program
_TERMINATED = 0  # the signal _terminated received, if any


def _hold_collector() -> Callable[[], None]:
    """Hold Python's cyclic garbage collector while a merge or a registration starts: importing
    DuckDB, pyarrow and numba makes ~1M long-lived objects, and the collections they trigger cost
    ~0.06 CPU-s (and the scans' collections ~0.08 CPU-s more in a 4-expert registration). The
    returned call (once the merger or the scan runs; again is harmless) freezes what was imported,
    so that no later collection scans it, and lets the collector run again. Only in the `mergedb` process:
    frozen objects are never collected, which another program calling `app` may not want."""
    if not _PROCESS or not gc.isenabled():
        return lambda: None
    gc.disable()

    def started() -> None:
        if not gc.isenabled():
            gc.freeze()
            gc.enable()

    return started


@contextmanager
def _held_progress(quiet: bool, label: str) -> Iterator[tuple[Any, Callable[[int], None]]]:
    """render.progress's (advance, on_total) for a merge or a registration, with Python's collector
    held (_hold_collector) until the work reports its total, i.e. until it has started; running
    again afterwards whatever happens. In the `mergedb` process a merge also has glibc return its large
    freed buffers (freshmem.map_large: its peak memory then does not grow with the experts)."""
    if _PROCESS and label in ("merge", "replay", "sweep"):
        from . import freshmem

        freshmem.map_large()
    started = _hold_collector()
    try:
        with render.progress(quiet, label) as (advance, set_total):
            yield advance, lambda n: (started(), set_total and set_total(n))
    finally:
        started()


_FAST_END = False  # an `execute` ran in the `mergedb` process: end it without the interpreter's teardown
_OWN_PROCESS = False  # set by entry(): the console script owns its process (a caller of main() does not)


def _end_fast() -> None:
    global _FAST_END
    _FAST_END = _PROCESS and _OWN_PROCESS


def _exit_now(code: object, interrupted: bool = False) -> None:
    """End the process with `code` (SystemExit's) once an `execute` command is done, skipping the
    interpreter's teardown: freeing every module and object one by one after numba, pyarrow and
    DuckDB were loaded costs ~0.04 s. The atexit handlers still run and the standard streams are
    flushed; returns (the ordinary exit follows) while another non-daemon thread runs or a stream
    cannot be flushed. `interrupted` (Ctrl-C, SIGTERM, after the command's own clean-up ran): other
    threads are not waited for, since a pool worker may never finish (merger.close)."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if not interrupted and any(t.is_alive() and not t.daemon for t in others):
        return
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        return
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


def main() -> None:
    """The `mergedb` command. When its process ends every object is frozen first: the interpreter's
    last collection then skips them (it costs 0.12-0.15 s once numba is loaded). Frozen at exit
    (atexit), not on return, so that a program calling main() keeps a working collector. Started by
    entry() (the console script), an `execute` process then ends without the interpreter's teardown
    (`_exit_now`)."""
    global _PROCESS, _FAST_END
    _PROCESS, _FAST_END = True, False
    atexit.register(gc.freeze)
    try:
        app()
    except SystemExit as e:
        interrupted = _OWN_PROCESS and e.code in (130, 128 + signal.SIGTERM)
        if _FAST_END or interrupted:
            _PROCESS = False
            _exit_now(e.code, interrupted)
        raise
    finally:
        _PROCESS, _FAST_END = False, False


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (kill, timeout, docker stop, a batch scheduler) ends a command as Ctrl-C does: every
    clean-up runs (an unfinished output's temporary folder and lock, a new catalog), then the
    process exits with 128 + 15. A second SIGTERM meanwhile ends it at once (the next run into the
    same output removes what that leaves)."""
    global _TERMINATED
    _TERMINATED = signum  # if DuckDB turns the exit below into "Query interrupted", _Group still exits 143
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def _take_signals() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    sys.unraisablehook = _unraisable


def _unraisable(u: Any) -> None:
    """sys.unraisablehook of the `mergedb` process. A signal's exception raised while Python ran a
    weakref callback or a `__del__` (an import's module lock, seen once in this suite) is printed and
    dropped there, and the command went on as if never signalled: the merge finished and the process
    exited 0 after a SIGTERM. The signal is sent again 50 ms later from another thread: raised in this
    hook, it would be dropped too."""
    sig, e = 0, u.exc_value
    if threading.current_thread() is threading.main_thread():  # the only thread signals are raised in
        if isinstance(e, KeyboardInterrupt) and callable(signal.getsignal(signal.SIGINT)):
            sig = signal.SIGINT
        elif isinstance(e, SystemExit) and _TERMINATED and e.code == 128 + _TERMINATED:
            sig = _TERMINATED
            signal.signal(sig, _terminated)
    if not sig:
        sys.__unraisablehook__(u)
        return
    again = threading.Timer(0.05, os.kill, (os.getpid(), sig))  # this hook has returned by then (if the
    again.daemon = True  # callback still runs, it is dropped there again, and sent again)
    again.start()


def entry() -> None:
    """The `mergedb` console script (called by console.main) and `python -m mergedb.cli`: main() in a
    process of its own, which an `execute` may end without the interpreter's teardown, and which
    SIGTERM ends with its clean-up (_terminated); Ctrl-C before a command runs exits 130 quietly. A
    program calling main() keeps running after it (SystemExit, as typer raises it) and keeps its own
    signal handlers."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    _take_signals()
    try:
        main()
    except KeyboardInterrupt:  # before a command's own handler (_Group.invoke), e.g. while typer builds the app
        raise SystemExit(130) from None


if __name__ == "__main__":
    entry()
