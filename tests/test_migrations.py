"""Catalogs written at every older schema version open, upgrade to the latest, keep their rows, and plan.

An old catalog is built by hand, the way an older mergedb left it: the schema files up to that
version applied in order with DuckDB, one `schema_version` row per file, the settings row, then
real rows (copied from a catalog that registered a tiny family and planned on it) in the tables
that version had.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.check import check_catalog
from mergedb.errors import PlanError
from mergedb.mkplan import plan_to_mergekit
from mergedb.planner import PlanRequest

SCHEMA = Path(__file__).resolve().parents[1] / "schema"
FILES = sorted(SCHEMA.glob("[0-9][0-9][0-9]_*.sql"))
LATEST = int(FILES[-1].name[:3])
TIES = PlanRequest("base", None, "ties", "50%", params={"density": 0.3})
TASK = PlanRequest("base", None, "task_arithmetic", "30%", weights=(1.0, -0.5), params={"lambda": 0.7})
PER_TENSOR_SINCE = 7  # plans with per-(expert, tensor) values (plan_tensor_params) exist from 007 on


def _per_tensor(tensor: str) -> PlanRequest:
    """A linear plan whose second expert weighs 3 on one tensor (rows in plan_tensor_params)."""
    tp = pa.table(
        {
            "position": pa.array([1], pa.int32()),
            "tensor": [tensor],
            "param": ["weight"],
            "value": pa.array([3.0], pa.float64()),
        }
    )
    return PlanRequest("base", None, "linear", "all", tensor_params=tp, name="per-tensor")


def _tables(con: duckdb.DuckDBPyConnection, schema: str = "main") -> list[str]:
    return [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = ? AND table_type = 'BASE TABLE' "
            "AND table_catalog = current_database() ORDER BY 1",
            [schema],
        ).fetchall()
    ]


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    return [r[1] for r in con.execute(f"PRAGMA table_info('{table}')").fetchall()]


def _layout(path: Path) -> list[tuple]:
    """Every table and view column of a catalog: (table, position, name, type, nullable, default)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(
            "SELECT table_name, ordinal_position, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = 'main' AND table_name <> 'schema_version' "
            "ORDER BY 1, 2"
        ).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A latest-version catalog with a registered tiny family (base + 2 experts) and two plans."""
    root = tmp_path_factory.mktemp("mig")
    fam = synth.make_family(root / "fam", experts=2, size="tiny", seed=21)
    cat = Catalog(root / "source.duckdb")
    cat.register([fam], base_model="base", block_size="32KiB")
    tensor = cat.sql("SELECT name FROM family_tensors WHERE mergeable ORDER BY tensor_idx LIMIT 1").to_pylist()[0]
    plans = [cat.plan(TIES), cat.plan(TASK), cat.plan(_per_tensor(tensor["name"]))]
    return fam, root / "source.duckdb", plans


# plan_mask's rows before 010: the view's columns, and the per-candidate score and value it no
# longer has (arbitrary here: 010 drops them)
_OLD_MASK = "plan_id, checkpoint_id, tensor_idx, block_idx, selected, free, 0.5, 0.25, nbytes"


def _old_catalog(
    path: Path, version: int, source: Path, every_table: bool = True
) -> dict[str, tuple[list[str], list[tuple]]]:
    """A catalog at schema `version`, as mergedb's migration code writes it, holding the source's
    rows in every table that version had (each with a row, unless not `every_table`). Returns
    table -> (that version's columns, its rows)."""
    con = duckdb.connect(str(path))
    try:
        con.execute("BEGIN")
        con.execute(
            "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, "
            "applied_at TIMESTAMP NOT NULL)"
        )
        for f in FILES[:version]:
            con.execute(f.read_text())
            con.execute("INSERT INTO schema_version VALUES (?, ?, current_timestamp)", [int(f.name[:3]), f.stem])
        con.execute("COMMIT")
        con.execute(f"ATTACH '{source}' AS src (READ_ONLY)")
        for table in _tables(con):
            if table == "schema_version":
                continue
            cols = ", ".join(_columns(con, table))
            con.execute(f"DELETE FROM {table}")  # density_grid is filled by 001 itself
            if table == "plan_mask":  # a table before 010, a view of plan_mask_bits since: what 010 converts
                con.execute(f"INSERT INTO plan_mask ({cols}) SELECT {_OLD_MASK} FROM src.plan_mask")
                continue
            con.execute(f"INSERT INTO {table} ({cols}) SELECT {cols} FROM src.{table}")
        con.execute("DETACH src")
        if version < PER_TENSOR_SINCE:  # such a plan could not exist then: drop it from every plan table
            for table in _tables(con):
                if "plan_id" in _columns(con, table):
                    con.execute(f"DELETE FROM {table} WHERE plan_id = 3")
        if "runs" in _tables(con) and every_table:  # a run, so that every table of the version holds a row
            con.execute(
                "INSERT INTO runs (run_id, plan_id, out, status, error) VALUES (1, 1, '/nowhere', 'failed', 'killed')"
            )
        if "scores" in _tables(con) and every_table:  # and a score
            con.execute("INSERT INTO scores (score_id, plan_id, metric, value) VALUES (1, 1, 'loss', 1.5)")
        rows = {t: _rows(con, t, _columns(con, t)) for t in _tables(con) if t != "schema_version"}
    finally:
        con.close()
    assert not every_table or all(data for _, data in rows.values()), [t for t, (_, d) in rows.items() if not d]
    return rows


def _rows(con: duckdb.DuckDBPyConnection, table: str, cols: list[str]) -> tuple[list[str], list[tuple]]:
    return cols, con.execute(f"SELECT {', '.join(cols)} FROM {table} ORDER BY ALL").fetchall()


def test_schema_files_are_numbered_without_gaps():
    assert [int(f.name[:3]) for f in FILES] == list(range(1, LATEST + 1))
    assert LATEST >= 2  # otherwise there is no older version to upgrade from


def test_source_catalog_fills_base_dot(source):
    """The latest schema fills every expert block's base_dot (so the NULL check above can fail)."""
    con = duckdb.connect(str(source[1]), read_only=True)
    try:
        total, filled = con.execute("SELECT count(*), count(base_dot) FROM expert_blocks").fetchall()[0]
    finally:
        con.close()
    assert total > 0 and filled == total


@pytest.mark.parametrize("opener", ["read", "write"])
@pytest.mark.parametrize("version", range(1, LATEST))
def test_old_catalog_upgrades_keeps_rows_and_plans(source, tmp_path, version, opener):
    fam, src_path, src_plans = source
    path = tmp_path / f"v{version}.duckdb"
    rows = _old_catalog(path, version, src_path)
    cat = Catalog(path)
    if opener == "read":  # a read-only command upgrades an old catalog first (briefly read-write)
        assert [c.name for c in cat.checkpoints()] == ["base", "expert_00", "expert_01"]
    else:  # a writing command: registering the same files again finds them unchanged
        res = cat.register([fam], base_model="base")
        assert res.registered == () and set(res.unchanged) >= {"expert_00", "expert_01"}
    con = duckdb.connect(str(path), read_only=True)
    try:
        versions = con.execute("SELECT version, name FROM schema_version ORDER BY version").fetchall()
        assert versions == [(int(f.name[:3]), f.stem) for f in FILES]
        for table, (cols, before) in rows.items():  # every row survives, unchanged, in the old columns
            if table == "plan_mask":  # the view shows the old rows' keys and flags (score, value are gone)
                keep = [i for i, c in enumerate(cols) if c not in ("score", "value")]
                kept = [c for c in cols if c not in ("score", "value")]
                assert _rows(con, table, kept) == (kept, sorted(tuple(r[i] for i in keep) for r in before))
                continue
            assert _rows(con, table, cols) == (cols, before), table
        if version >= 2:  # plans made before 004 were ranked plans
            assert con.execute("SELECT DISTINCT strategy FROM plans").fetchall() == [("ranked",)]
        if version < 6:  # base_dot (006) is unknown for rows registered before it: NULL, never a guess
            assert con.execute("SELECT count(*), count(base_dot) FROM expert_blocks").fetchall()[0][1] == 0
    finally:
        con.close()
    # the same tables, columns, types and defaults as a catalog created at the latest version
    assert _layout(path) == _layout(src_path)
    # old plans still load and execute-plan; new plans match the ones the source catalog made
    kept = src_plans if version >= PER_TENSOR_SINCE else src_plans[:2]
    if version >= 2:
        assert [p.plan_hash for p in cat.plans()] == [p.plan_hash for p in kept]
        for p in kept:
            assert cat.execution_plan(p.plan_id).plan_hash == p.plan_hash
    tensor = cat.sql("SELECT name FROM family_tensors WHERE mergeable ORDER BY tensor_idx LIMIT 1").to_pylist()[0]
    again = [cat.plan(TIES), cat.plan(TASK), cat.plan(replace(_per_tensor(tensor["name"]), name="again"))]
    assert [p.plan_hash for p in again] == [p.plan_hash for p in src_plans]  # the name is not hashed
    assert [p.selected_bytes for p in again] == [p.selected_bytes for p in src_plans]
    assert Catalog(path).sql("SELECT max(version) AS v FROM schema_version").to_pylist() == [{"v": LATEST}]


@pytest.fixture(scope="module")
def dare_source(tmp_path_factory):
    """A latest-version catalog holding one DARE-TIES plan, and that plan's output."""
    root = tmp_path_factory.mktemp("mig-dare")
    fam = synth.make_family(root / "fam", experts=2, size="tiny", seed=22)
    cat = Catalog(root / "source.duckdb")
    cat.register([fam], base_model="base", block_size="32KiB")
    plan = cat.plan(PlanRequest("base", None, "dare_ties", "all", params={"density": 0.5}, seed=5, name="dare"))
    cat.execute(plan.plan_id, root / "out")
    return root / "source.duckdb", plan, (root / "out" / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "version, hours, known",
    [(8, 0, False), (8, 40, False), (9, 27, True), (13, 27, True), (13, 2, False), (13, -1, False)],
)
def test_a_plan_that_draws_names_its_stream_after_an_upgrade(dare_source, tmp_path, version, hours, known):
    """014: DARE/DELLA drew from splitmix64 before b3b45c5, from Threefry since, and a plan's hash
    does not say which: an old DARE plan executed to other bytes under its hash, silently. A plan
    made once its catalog was at 009 or later (only Threefry mergedbs know 009) executes as before;
    one made earlier has an unknown stream and is refused, with the way out. The plan is made
    `hours` after the catalog first reached 009 (a catalog at 008 reaches it now, in the upgrade);
    the times are local clocks of two processes, which may sit in zones up to 26 hours apart, so
    a plan within 26 hours of it counts as unknown (a false refusal, never a wrong merge)."""
    src, plan, bytes_then = dare_source
    path = tmp_path / "old.duckdb"
    _old_catalog(path, version, src, every_table=False)
    con = duckdb.connect(str(path))
    since = "(SELECT applied_at FROM schema_version WHERE version = 9)" if version >= 9 else "current_timestamp"
    con.execute(f"UPDATE plans SET created = CAST({since} AS TIMESTAMP) + INTERVAL ({hours}) HOUR")
    con.close()
    cat = Catalog(path)
    assert cat.sql("SELECT rng FROM plans").to_pylist() == [{"rng": "threefry2x32-20" if known else None}]
    if known:
        cat.execute("dare", tmp_path / "out")
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == bytes_then
        return
    with pytest.raises(PlanError, match=r"stream it does not record .* another --name than 'dare'"):
        cat.execute("dare", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    again = cat.plan(PlanRequest("base", None, "dare_ties", "all", params={"density": 0.5}, seed=5, name="again"))
    assert again.plan_hash == plan.plan_hash  # the same request: the same plan, now with its stream
    cat.execute("again", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == bytes_then


def test_a_catalog_that_skipped_009_names_the_stream_of_plans_made_at_a_later_version(dare_source, tmp_path):
    """A catalog of the 5998f66 branch (010 without 009) gets 009 in the upgrade; its plans, made at
    010 by a Threefry mergedb, keep their stream (counted from 010, not from 009 applied now)."""
    src, plan, bytes_then = dare_source
    path = tmp_path / "gap.duckdb"
    _old_catalog(path, 10, src, every_table=False)
    con = duckdb.connect(str(path))
    _without_009(con)
    con.execute("UPDATE schema_version SET applied_at = applied_at - INTERVAL 100 HOUR")  # made days ago
    ten = "(SELECT applied_at FROM schema_version WHERE version = 10)"
    con.execute(f"UPDATE plans SET created = {ten} + INTERVAL 30 HOUR")  # at 010, before the upgrade
    con.close()
    cat = Catalog(path)
    assert cat.sql("SELECT rng FROM plans").to_pylist() == [{"rng": "threefry2x32-20"}]
    cat.execute("dare", tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == bytes_then


def test_new_plans_record_their_stream_and_another_stream_is_refused(dare_source, tmp_path):
    """Every plan records the stream it was made for; a drawing plan made for another is refused by
    execute (its name in the message), a plan that draws nothing is not."""
    src, plan, _ = dare_source
    path = tmp_path / "c.duckdb"
    path.write_bytes(src.read_bytes())
    cat = Catalog(path)
    ta = cat.plan(PlanRequest("base", None, "task_arithmetic", "all"))
    assert cat.sql("SELECT rng FROM plans ORDER BY plan_id").to_pylist() == [{"rng": "threefry2x32-20"}] * 2
    con = duckdb.connect(str(path))
    con.execute("UPDATE plans SET rng = 'splitmix64'")
    con.close()
    with pytest.raises(PlanError, match="from the stream 'splitmix64', but this mergedb draws from 'threefry2x32-20'"):
        cat.execute(plan.plan_id, tmp_path / "out")
    cat.execute(ta.plan_id, tmp_path / "out")  # task arithmetic draws nothing
    # reading the plan for another use than merging it is not refused: a mergekit config of it, and
    # `check --deep`, which still checks its rows against its hash
    assert "dare_ties" in plan_to_mergekit(cat, plan.plan_id)
    assert not check_catalog(cat, deep=True)
    con = duckdb.connect(str(path))
    con.execute("UPDATE plan_experts SET weight = weight + 1 WHERE plan_id = ?", [plan.plan_id])
    con.close()
    assert any("no longer give its hash" in p.what for p in check_catalog(cat, deep=True))


# expert_costs as 001 defined it and plan_mask as 010 first did (5998f66): neither knows 009's columns
_OLD_COSTS = (
    "CREATE OR REPLACE VIEW expert_costs AS SELECT c.name AS expert, b.name AS base, "
    "CAST(sum(bl.nbytes) AS BIGINT) AS total_bytes, "
    "CAST(sum(bl.nbytes) FILTER (WHERE NOT eb.identical) AS BIGINT) AS changed_bytes, "
    "sqrt(sum(eb.delta_norm * eb.delta_norm)) AS delta_norm, CAST(sum(eb.nnz) AS BIGINT) AS nnz, "
    "CAST(sum(eb.nonfinite) AS BIGINT) AS nonfinite FROM expert_blocks eb "
    "JOIN checkpoints c ON c.checkpoint_id = eb.checkpoint_id JOIN checkpoints b ON b.checkpoint_id = c.base_id "
    "JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx "
    "GROUP BY c.name, b.name"
)
_OLD_PLAN_MASK = (
    "CREATE OR REPLACE VIEW plan_mask AS SELECT m.plan_id, m.checkpoint_id, m.tensor_idx, eb.block_idx, "
    "get_bit(m.selected, eb.block_idx) = 1 AS selected, eb.identical AS free, bl.nbytes FROM plan_mask_bits m "
    "JOIN plans p ON p.plan_id = m.plan_id "
    "JOIN expert_blocks eb ON eb.checkpoint_id = m.checkpoint_id AND eb.tensor_idx = m.tensor_idx "
    "JOIN blocks bl ON bl.base_id = p.base_id AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx "
    "WHERE eb.nonfinite = 0 OR get_bit(m.selected, eb.block_idx) = 1"
)


def _without_009(con: duckdb.DuckDBPyConnection) -> None:
    """A catalog at 010 or later as the 5998f66 branch left it: 009 never applied (its columns and
    views absent, no schema_version row)."""
    con.execute(_OLD_COSTS)
    con.execute(_OLD_PLAN_MASK)
    for table_column in ("checkpoints adapter", "expert_blocks read_bytes", "expert_tensors fixed_bytes"):
        con.execute("ALTER TABLE {} DROP COLUMN {}".format(*table_column.split()))
    con.execute("DELETE FROM schema_version WHERE version = 9")


def _views(path: Path) -> dict[str, str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return dict(con.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal").fetchall())
    finally:
        con.close()


def _columns_by_name(path: Path) -> set[tuple]:
    """_layout without the column positions (a migration applied late adds its columns last)."""
    return {(t, name, *rest) for t, _, name, *rest in _layout(path)}


def test_a_migration_a_catalog_never_had_is_applied(source, tmp_path):
    """A catalog made by code of a branch that lacked a migration (5998f66..78854fa had 010 but no
    009) was taken as being at its highest version: 009 was never applied, so its columns and
    views were missing for good. A version missing below the highest is applied when the catalog
    is next opened, in order; the catalog then has every column a new one has, and plans."""
    fam, src_path, src_plans = source
    path = tmp_path / "gap.duckdb"
    _old_catalog(path, 10, src_path)
    con = duckdb.connect(str(path))
    _without_009(con)
    con.close()
    cat = Catalog(path)
    assert [c.name for c in cat.checkpoints()] == ["base", "expert_00", "expert_01"]
    versions = cat.sql("SELECT version FROM schema_version ORDER BY version").column("version").to_pylist()
    assert versions == list(range(1, LATEST + 1))
    assert _columns_by_name(path) == _columns_by_name(src_path)
    assert _views(path) == _views(src_path)
    assert [p.plan_hash for p in cat.plans()] == [p.plan_hash for p in src_plans]
    for p in src_plans:
        assert cat.execution_plan(p.plan_id).plan_hash == p.plan_hash
    assert cat.plan(TIES).plan_hash == src_plans[0].plan_hash


def test_views_a_migration_defined_before_it_was_edited_are_made_again(source, tmp_path):
    """009 and 010 were edited after they first landed; a catalog migrated in between kept their
    older expert_costs and plan_mask (an adapter's blocks at their dense bytes). 015 makes them
    again as today's catalogs have them."""
    fam, src_path, _ = source
    path = tmp_path / "views.duckdb"
    _old_catalog(path, 14, src_path)
    con = duckdb.connect(str(path))
    con.execute(_OLD_COSTS)
    con.execute(_OLD_PLAN_MASK)
    con.close()
    assert _views(path) != _views(src_path)
    assert [c.name for c in Catalog(path).checkpoints()] == ["base", "expert_00", "expert_01"]
    assert _views(path) == _views(src_path)
