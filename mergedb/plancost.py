"""Fixed read costs in the planner: a LoRA adapter's factor R, read once per (expert, tensor).

A block of an adapter costs its own rows (expert_blocks.read_bytes); the factor R that every block
of the tensor needs (expert_tensors.fixed_bytes, schema/009) is charged to exactly one candidate of
the (expert, tensor), its carrier, which the plan's order puts before the others of its (expert,
tensor) (queries/plan_carriers.sql, plan_fixed_cost.sql). A prefix of the order or a greedy fill
(plan_fill.sql waits for the carrier) then counts R once for every (expert, tensor) it reads from,
so the plan's selected bytes are exactly the bytes the merge reads and stay within the budget.
"""

from __future__ import annotations

import duckdb

from .resources import query


def charge_fixed_costs(
    con: duckdb.DuckDBPyConnection, ids: list[int], random_scores: bool
) -> list[tuple[str, str, int]]:
    """Charge the fixed costs of the plan's experts `ids` to their carriers in plan_candidates;
    creates temp table plan_carriers (empty when no expert has a fixed cost, the dense case).
    `random_scores`: the --strategy random scores stay as they are. Returns the --explain steps."""
    n_fixed = con.execute(
        "SELECT count(*) FROM expert_tensors WHERE fixed_bytes > 0 AND list_contains(?::INTEGER[], checkpoint_id)",
        [[int(i) for i in ids]],
    ).fetchall()[0][0]
    if not n_fixed:
        con.execute(
            "CREATE OR REPLACE TEMP TABLE plan_carriers (position INTEGER, tensor_idx INTEGER, block_idx INTEGER)"
        )
        return []
    steps = []
    for name, params in (("plan_carriers", [random_scores]), ("plan_fixed_cost", [])):
        sql = query(name)
        con.execute(sql, params).fetchall()
        steps.append((name, sql, int(con.execute("SELECT count(*) FROM plan_carriers").fetchall()[0][0])))
    return steps
