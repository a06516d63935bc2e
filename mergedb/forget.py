"""Forgetting checkpoints: the catalog's rows of experts deleted from the disk or no longer wanted.

Without it a deleted expert stayed in every `plan --all` (each plan then refused at execution as
reading a checkpoint that is gone), and `mergedb check` reported it for good. A checkpoint's rows
(files, tensors, block statistics; a base's layout too) go in one transaction. A base goes only
with all its experts named beside it (their statistics are deltas against it). A plan that merges
a forgotten checkpoint could never execute again, so such plans are refused unless asked for too
(`with_plans`): then they go with their runs and scores. Their outputs keep their manifests, which
`mergedb replay` writes again from the files without the catalog. Nothing is read from the disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import CatalogError, MergeDBError
from .faults import rollback
from .units import shown

if TYPE_CHECKING:
    from .catalog import Catalog

# rows of a plan, by plan_id; plans last (what the others' rows belong to)
PLAN_TABLES = ("plan_experts", "plan_thresholds", "plan_mask_bits", "plan_tensor_params", "runs", "scores", "plans")
# rows of a checkpoint, by checkpoint_id; and of a base's layout, by base_id
CHECKPOINT_TABLES = ("expert_blocks", "expert_tensors", "tensors", "files")
BASE_TABLES = ("blocks", "family_tensors")


@dataclass(frozen=True)
class Forgotten:
    """What `forget` removed: checkpoint names in the order given, plan ids ascending."""

    checkpoints: tuple[str, ...]
    plans: tuple[int, ...]


def forget(cat: Catalog, names: Sequence[str], with_plans: bool = False) -> Forgotten:
    """Remove the checkpoints `names` from the catalog (see the module note); nothing is changed
    when anything is refused."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names) or not names:
        raise MergeDBError(f"forget takes a list of checkpoint names, got {shown(names)}")  # a generator: used up
    if not isinstance(with_plans, bool):  # "no" would be taken as true, and remove the plans
        raise MergeDBError(f"forget's with_plans is True or False, got {shown(with_plans)}")
    names = list(dict.fromkeys(names))  # each once, in the order given
    with cat.duckdb_connection(write=True) as con:
        con.execute("BEGIN")
        try:
            listed = con.execute("SELECT name, checkpoint_id, role, base_id FROM checkpoints").fetchall()
            rows = {r[0]: r[1:] for r in listed}
            unknown = [n for n in names if n not in rows]
            if unknown:
                raise CatalogError(f"no checkpoint named {unknown[0]!r} in {cat.path}; `mergedb ls` lists them")
            ids = [rows[n][0] for n in names]
            bases = [rows[n][0] for n in names if rows[n][1] == "base"]
            for b in bases:
                kept = sorted(n for n, (cid, role, base_id) in rows.items() if base_id == b and n not in names)
                if kept:
                    base = next(n for n in names if rows[n][0] == b)
                    raise CatalogError(
                        f"base {base!r} has experts not named here ({', '.join(kept[:5])}"
                        f"{' …' if len(kept) > 5 else ''}), whose statistics are deltas against it: name them too, "
                        "or keep the base"
                    )
            pids = [
                int(r[0])
                for r in con.execute(
                    "SELECT plan_id FROM plan_experts WHERE list_contains($1, checkpoint_id) "
                    "UNION SELECT plan_id FROM plans WHERE list_contains($2, base_id) ORDER BY plan_id",
                    [ids, bases],
                ).fetchall()
            ]
            if pids and not with_plans:
                shown_ids = ", ".join(map(str, pids[:8])) + (" …" if len(pids) > 8 else "")
                raise CatalogError(
                    f"{len(pids)} stored plan{'s' * (len(pids) != 1)} ({shown_ids}) merge{'s' * (len(pids) == 1)} "
                    f"{'it' if len(names) == 1 else 'them'} and could never execute again: pass --with-plans to "
                    "forget those plans too (with their runs and scores; their outputs keep their manifests, which "
                    f"`mergedb replay` writes again), or keep {'it' if len(names) == 1 else 'them'} (nothing changed)"
                )
            for table in PLAN_TABLES:
                con.execute(f"DELETE FROM {table} WHERE list_contains(?, plan_id)", [pids])
            for table in CHECKPOINT_TABLES:
                con.execute(f"DELETE FROM {table} WHERE list_contains(?, checkpoint_id)", [ids])
            for table in BASE_TABLES:
                con.execute(f"DELETE FROM {table} WHERE list_contains(?, base_id)", [bases])
            con.execute("DELETE FROM checkpoints WHERE list_contains(?, checkpoint_id)", [ids])
            con.execute("COMMIT")
        except BaseException:
            rollback(con)
            raise
    return Forgotten(tuple(names), tuple(pids))
