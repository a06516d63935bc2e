"""A sweep run again: what an earlier run of the same command stored and wrote, and how to finish it.

A sweep stores all its plans first, then writes the outputs; interrupted in between (Ctrl-C, a
killed job, a full disk), it leaves every plan stored and some outputs missing. The same command
again cannot plan them under their names, and must not plan them again under new ones: this says
which plans are the earlier run's, which of their outputs are complete, and the `mergedb execute`
commands that write the rest (each the plan's output exactly, as the sweep would have written it).

It does not run them itself: that the stored plan is the one the rerun would make is judged from
the request (method, base, experts, weights, budget, seed, parameters), not proved by planning it
again (the name is taken, and a second plan under another name is what must not happen)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import jsondoc, outdir, plans
from .errors import PlanExistsError
from .manifest import MANIFEST
from .plainfile import read_small
from .planner import PlanRequest
from .tensorfile import normalize_dtype

if TYPE_CHECKING:
    from .catalog import Catalog
    from .plans import PlanSummary

SHARD_DEFAULT = 5 * 10**9  # sweep's and execute's max_shard_size: a command needs it only when it differs


def check(
    cat: Catalog, requests: Sequence[object], root: Path, dtypes: Sequence[str | None], max_shard_size: int
) -> None:
    """Refuse, before anything is planned, a sweep whose named plans an earlier run of it stored,
    saying how to finish it. Names stored by plans this sweep would not make are left to the
    planner's refusal (another --name)."""
    named = {r.name: (r, dt) for r, dt in zip(requests, dtypes) if isinstance(r, PlanRequest) and r.name}
    if not named:
        return
    rows = cat.sql("SELECT plan_id, name FROM plans WHERE list_contains(?, name)", [list(named)]).to_pylist()
    if not rows:
        return
    bases = sorted({r.base for r, _ in named.values()})
    with cat.duckdb_connection() as con:
        stored = {r["name"]: plans.load_plan(con, r["plan_id"]) for r in rows}
        experts = con.execute(
            "SELECT b.name, e.name FROM checkpoints e JOIN checkpoints b ON b.checkpoint_id = e.base_id "
            "WHERE e.role = 'expert' AND b.role = 'base' AND list_contains(?, b.name)",
            [bases],
        ).fetchall()
    everyone: dict[str, list[str]] = {b: [] for b in bases}  # each base's experts now, what --all takes,
    for b, e in sorted(experts, key=lambda r: r[1].encode()):  # in the planner's order (UTF-8 bytes)
        everyone[b].append(e)
    if not all(_same(s, named[n][0], everyone[named[n][0].base]) for n, s in stored.items()):
        return
    with cat.duckdb_connection() as con:  # re-registered with other bytes since: the earlier run merged those
        changed = [
            r[0]
            for r in con.execute(
                "SELECT DISTINCT c.name FROM plans p JOIN plan_experts pe USING (plan_id) "
                "JOIN checkpoints c USING (checkpoint_id) WHERE list_contains(?, p.name) "
                "AND pe.content_hash <> c.content_hash ORDER BY c.name",
                [list(stored)],
            ).fetchall()
        ]
    if changed:
        raise PlanExistsError(
            f"the plans of this sweep are stored already by an earlier run of it, but {_names(changed)} "
            f"{'was' if len(changed) == 1 else 'were'} registered again with other weights since: those plans and "
            "their outputs merge the old ones; another --name plans the sweep again over the weights registered now"
        )
    order = [n for n in named if n in stored]  # the sweep's order
    live = [(n, pid) for n in order if (pid := outdir.writer(root / n)) is not None]
    if live:  # its advice (execute the missing ones) would collide with the outputs that run writes next
        raise PlanExistsError(
            f"an earlier run of this sweep is still writing its outputs under {root} (process {live[0][1]} is "
            f"writing {live[0][0]}); wait for it to finish, then run the command again to see what is left"
        )
    state = {n: _output_state(root / n, stored[n], named[n][1], max_shard_size) for n in order}
    complete = [n for n in order if state[n] == "complete"]
    todo = [n for n in order if state[n] != "complete"]
    in_way = [n for n in order if state[n] == "in the way"]
    other = [n for n in order if state[n] == "other settings"]
    new = [n for n in named if n not in stored]
    k = len(order)
    head = f"{k} of the {len(named)} plans" if new else f"the {k} plan{'s' * (k != 1)}"
    msg = (
        f"{head} of this sweep {'are' if k != 1 else 'is'} stored already by an earlier run of it (same names, "
        "method, base, experts, weights, budget, seed and parameters)"
    )
    if not todo:
        msg += f": {'its output is' if k == 1 else f'all {k} outputs are'} complete under {root}"
    else:
        missing = len(todo) - len(in_way) - len(other)
        msg += f"; under {root}: {len(complete)} complete{_few(complete)}, {missing} missing"
        if other:
            msg += (
                f", {len(other)} written with another --dtype or --max-shard-size{_few(other)}: move them away, or "
                "run the sweep with the options they were written with"
            )
        if in_way:
            msg += f", {len(in_way)} in the way{_few(in_way)}: a folder that holds no output of its plan, move it away"
        dts = [named[n][1] for n in todo]
        msg += f". Write the missing outputs with {_commands(todo, root, dts, max_shard_size, cat.path)}"
    if new:
        msg += (
            f"; {_names(new)} {'is' if len(new) == 1 else 'are'} not stored: sweep "
            f"{'it' if len(new) == 1 else 'them'} alone (a --grid of only the new values)"
        )
    raise PlanExistsError(msg + "; another --name plans the whole sweep again")


def _same(s: PlanSummary, r: PlanRequest, every_expert: list[str]) -> bool:
    """Whether stored plan `s` is what request `r` asks for (its parameters as given; the stored
    ones also hold the method's defaults; `every_expert`: its base's experts now, what --all takes).
    Per-tensor values are not compared: such a request is never taken for an earlier run's."""
    return (
        r.tensor_params is None
        and (s.method, s.base, s.seed, s.budget_spec, s.strategy)
        == (r.method, r.base, r.seed, str(r.budget), r.strategy)
        and all(s.params.get(k) == v for k, v in r.params.items() if v is not None)
        and [e.name for e in s.experts] == list(every_expert if r.experts is None else r.experts)
        and (r.weights is None or [e.weight for e in s.experts] == list(r.weights))
    )


def _output_state(out: Path, s: PlanSummary, dtype: str | None, max_shard_size: int) -> str:
    """'complete' (its manifest is this plan's, written with `dtype` and `max_shard_size`: installed
    whole, manifest last), 'other settings' (this plan's, written with another dtype or shard size:
    it was called complete, review 2026-12-03), 'missing' (no folder, or an empty one), or 'in the
    way' (anything else)."""
    try:
        if not out.exists() or (out.is_dir() and not any(out.iterdir())):
            return "missing"
        doc = jsondoc.parse(read_small(out / MANIFEST))
    except (OSError, ValueError):
        return "in the way"
    if not isinstance(doc, dict) or doc.get("plan_hash") != s.plan_hash:
        return "in the way"
    run = doc.get("run") if isinstance(doc.get("run"), dict) else {}
    same = doc.get("dtype") == normalize_dtype(dtype) and run.get("max_shard_size") == max_shard_size
    return "complete" if same else "other settings"


def _few(names: list[str]) -> str:
    return f" ({_names(names)})" if names else ""


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _commands(names: list[str], root: Path, dtypes: list[str | None], max_shard_size: int, catalog: Path) -> str:
    """`mergedb execute NAME --out ROOT/NAME -c CATALOG …` for each, or one shell loop for more than
    three (the catalog always named: a plan of that name in another catalog is another plan)."""
    shard = f" -c {shlex.quote(str(catalog))}" + (
        f" --max-shard-size {max_shard_size}" if max_shard_size != SHARD_DEFAULT else ""
    )

    def opts(dt: str | None) -> str:
        return (f" --dtype {shlex.quote(dt)}" if dt else "") + shard

    if len(names) > 3 and len(set(dtypes)) == 1:
        each = " ".join(shlex.quote(n) for n in names)
        return f'`for p in {each}; do mergedb execute "$p" --out {shlex.quote(str(root))}/"$p"{opts(dtypes[0])}; done`'
    return ", ".join(
        f"`mergedb execute {shlex.quote(n)} --out {shlex.quote(str(root / n))}{opts(dt)}`"
        for n, dt in zip(names, dtypes)
    )
