"""`mergedb sql` is read-only and sandboxed; the catalog layer refuses files that are not mergedb
catalogs, reports damaged catalogs and unwritable folders clearly; names stay addressable.

Every refusal is checked to leave the catalog (and every other file) byte for byte unchanged.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import CatalogError, MergeDBError, PlanError
from mergedb.planner import PlanRequest

runner = CliRunner(env={"COLUMNS": "250"})
CLI = [sys.executable, "-m", "mergedb.cli"]
SCHEMA = Path(__file__).resolve().parents[1] / "schema"
TIES = PlanRequest("base", None, "ties", "50%", params={"density": 0.3})


def _digest(*roots: Path) -> dict[str, str]:
    """sha256 of every file under (or at) each root, by path."""
    out = {}
    for root in roots:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _clean_failure(res, *phrases: str) -> None:
    """A CLI result that failed the documented way: exit 1, one error line, no traceback."""
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Error:" in res.output and "Traceback" not in res.output, res.output
    for p in phrases:
        assert p in res.output, (p, res.output)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A registered tiny family with one plan and a score, plus files an attacker would like to read or write."""
    root = tmp_path_factory.mktemp("sqlcat")
    fam = synth.make_family(root / "fam", experts=2, size="tiny", seed=11)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="32KiB")
    cat.record_score(cat.plan(TIES).plan_id, "loss", 1.5)  # so the plan_scores view has a row
    side = root / "side"
    side.mkdir()
    (side / "secret.txt").write_text("s3cr3t-token\n")
    (side / "table.csv").write_text("a,b\ns3cr3t,2\n")
    pq.write_table(pa.table({"a": ["s3cr3t"]}), side / "table.parquet")
    other = duckdb.connect(str(side / "other.duckdb"))
    other.execute("CREATE TABLE precious AS SELECT 42 AS answer")
    other.close()
    return root, fam, cat, side


# -- item 6: mergedb sql is read-only and reaches nothing but the catalog ---------------------

ATTACKS = {
    "read_text": "SELECT content FROM read_text('{side}/secret.txt')",
    "read_csv": "SELECT * FROM read_csv('{side}/table.csv')",
    "replacement_scan": "SELECT * FROM '{side}/table.csv'",
    "read_parquet": "SELECT * FROM read_parquet('{side}/table.parquet')",
    "glob": "SELECT * FROM glob('{side}/*')",
    "copy_over_checkpoint": "COPY (SELECT 1 AS x) TO '{fam}/expert_00/model.safetensors' (FORMAT csv)",
    "copy_out": "COPY checkpoints TO '{side}/dump.csv'",
    "export": "EXPORT DATABASE '{side}/export'",
    "attach": "ATTACH '{side}/other.duckdb' AS o",
    "attach_and_drop": "ATTACH '{side}/other.duckdb' AS o; DROP TABLE o.precious",
    "two_selects": "SELECT 1; SELECT 2",
    "select_then_drop": "SELECT 1; DROP TABLE plans",
    "install": "INSTALL httpfs",
    "load": "LOAD httpfs",
    "set": "SET enable_external_access = true",
    "set_threads": "SET threads = 1",
    "pragma": "PRAGMA enable_profiling",
    "reset": "RESET threads",
    "drop": "DROP TABLE plans",
    "delete": "DELETE FROM plans",
    "create_temp": "CREATE TEMP TABLE t AS SELECT 1",
    "checkpoint": "CHECKPOINT",
    "call": "CALL pragma_version()",
    "use": "USE memory",
    "empty": "  ",
    # EXPLAIN ANALYZE runs what it explains; its statement must be a query too
    "explain_analyze_create": "/* x */ EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1",
    "explain_analyze_checkpoint": "EXPLAIN ANALYZE CHECKPOINT",
    "explain_options_set": "EXPLAIN (FORMAT json) SET VARIABLE x = 1",
    "update_extensions": "UPDATE EXTENSIONS",  # a type DuckDB's Python layer cannot name (was a ValueError)
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_sql_attacks_refused_and_nothing_changes(world, attack):
    root, fam, cat, side = world
    before = _digest(root)
    text = ATTACKS[attack].format(side=side, fam=fam)
    with pytest.raises(MergeDBError) as err:
        cat.sql(text)
    assert "s3cr3t" not in str(err.value)
    res = runner.invoke(app, ["sql", text, "-c", str(cat.path)])
    _clean_failure(res)
    assert "s3cr3t" not in res.output
    assert _digest(root) == before  # catalog, checkpoints, side files: byte for byte
    assert not (side / "dump.csv").exists() and not (side / "export").exists()


def test_sql_refusals_say_why(world):
    _, _, cat, side = world
    with pytest.raises(MergeDBError, match="exactly one statement; this text has 2"):
        cat.sql("SELECT 1; SELECT 2")
    with pytest.raises(MergeDBError, match="only reads the catalog.*DROP"):
        cat.sql("DROP TABLE plans")
    with pytest.raises(MergeDBError, match="reads the catalog only"):
        cat.sql(f"SELECT * FROM read_csv('{side}/table.csv')")
    for pivot in ("PIVOT plans ON method USING count(*)", "-- a note\nPIVOT plans ON method USING count(*)"):
        with pytest.raises(MergeDBError, match=r"runs PIVOT with its values listed, e.g. PIVOT plans ON method IN"):
            cat.sql(pivot)  # after a comment it was "a MULTI statement is not a query" (review, 2026-12-03)
    for text, word in (
        ("INSTALL spatial", "an INSTALL"),
        ("CHECKPOINT", "a CHECKPOINT"),
        ("/* x */ USE memory", "a USE"),
    ):
        with pytest.raises(MergeDBError, match=f"{word} statement is not a query"):  # not DuckDB's LOAD, CALL, SET
            cat.sql(text)
    # a query's own text naming a checksum or a permission was reported as a damaged catalog, a full disk
    # or a read-only folder, with advice to restore it from a backup (review, 2026-12-03)
    for query, words in (
        ("SELECT name, checksum FROM checkpoints", 'Referenced column "checksum" not found'),
        ("SELECT 'Permission denied'::DATE", "Conversion Error"),
        ("SELECT CAST('No space left on device' AS INT)", "Conversion Error"),
    ):
        with pytest.raises(MergeDBError, match=f"^SQL error: .*{words}") as e:
            cat.sql(query)
        assert not isinstance(e.value, CatalogError) and "backup" not in str(e.value)
    with pytest.raises(MergeDBError, match="exists in the spatial extension .extensions are off limits in mergedb sql"):
        cat.sql("SELECT st_point(1, 2)")
    with pytest.raises(MergeDBError, match="explains queries only, and a CREATE statement is not one"):
        cat.sql("EXPLAIN ANALYZE CREATE TEMP MACRO m() AS 1")
    for query in ("EXPLAIN ANALYZE SELECT count(*) FROM plans", "EXPLAIN (FORMAT json) SELECT 1", "EXPLAIN (SELECT 1)"):
        assert cat.sql(query).num_rows >= 1, query
    got = cat.sql("PIVOT (SELECT strategy, method FROM plans) ON method IN ('ties', 'nothing') USING count(*)")
    want = cat.sql("SELECT strategy, count(*) FILTER (method = 'ties') AS n FROM plans GROUP BY strategy")
    assert want.num_rows and sorted(zip(*got.to_pydict().values())) == sorted(
        (s, n, 0) for s, n in zip(*want.to_pydict().values())
    )


def test_sql_queries_and_every_view_work(world):
    _, _, cat, _ = world
    views = re.findall(r"CREATE VIEW (\w+)", "\n".join(p.read_text() for p in sorted(SCHEMA.glob("*.sql"))))
    assert {"expert_costs", "tensor_summary"} <= set(views)
    for v in views:
        assert cat.sql(f"SELECT * FROM {v}").num_rows > 0, v
    experts = ["expert_00", "expert_01"]
    queries = [
        "SELECT expert FROM expert_costs ORDER BY expert",
        "WITH e AS (SELECT expert FROM expert_costs) SELECT * FROM e ORDER BY 1",
        "FROM expert_costs SELECT expert ORDER BY expert;",
        "SELECT name AS expert FROM checkpoints WHERE role = ? ORDER BY 1",
    ]
    for q in queries:
        params = ["expert"] if "?" in q else None
        assert cat.sql(q, params).column(0).to_pylist() == experts, q
    assert cat.sql("VALUES (1, 'a')").num_rows == 1
    assert "name" in cat.sql("DESCRIBE checkpoints").column(0).to_pylist()
    assert "plans" in cat.sql("SHOW TABLES").column(0).to_pylist()
    assert cat.sql("SUMMARIZE checkpoints").num_rows > 0
    assert cat.sql("EXPLAIN SELECT * FROM expert_costs").num_rows > 0
    res = runner.invoke(app, ["sql", "SELECT expert FROM tensor_summary LIMIT 1", "-c", str(cat.path), "-f", "csv"])
    assert res.exit_code == 0 and res.output.startswith("expert\n"), res.output


# -- item 8: never migrate a DuckDB file that is not a mergedb catalog ------------------------


def _foreign_db(path: Path) -> Path:
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE settings (k VARCHAR, v VARCHAR); INSERT INTO settings VALUES ('theme', 'dark')")
    con.execute("CREATE TABLE notes AS SELECT 'keep me' AS note")
    con.close()
    return path


def _calls(cat: Catalog, fam: Path):
    return {
        "sql": lambda: cat.sql("SELECT 1"),
        "ls": cat.checkpoints,
        "show": lambda: cat.checkpoint("base"),
        "plans": cat.plans,
        "show-plan": lambda: cat.get_plan(1),
        "plan": lambda: cat.plan(TIES),
        "register": lambda: cat.register([fam], base_model="base"),
    }


def test_other_duckdb_file_is_refused_never_migrated(world, tmp_path):
    _, fam, _, _ = world
    other = _foreign_db(tmp_path / "other.duckdb")
    before = _digest(other)
    for name, call in _calls(Catalog(other), fam).items():
        with pytest.raises(CatalogError, match="is a DuckDB file but not a mergedb catalog"):
            call()
        assert _digest(other) == before, name
    for cmd in (["sql", "SELECT 1"], ["ls"], ["plans"], ["check"], ["show", "base"]):
        _clean_failure(runner.invoke(app, [*cmd, "-c", str(other)]), "not a mergedb catalog")
    assert _digest(other) == before
    con = duckdb.connect(str(other), read_only=True)
    assert con.execute("SELECT table_name FROM duckdb_tables() ORDER BY 1").fetchall() == [("notes",), ("settings",)]
    con.close()


@pytest.mark.parametrize(
    "ddl",
    ["CREATE SCHEMA app; CREATE TABLE app.users (name VARCHAR); INSERT INTO app.users VALUES ('ada')",
     "CREATE MACRO price(a) AS a * 2; CREATE SEQUENCE invoice_no"],
    ids=["tables-in-another-schema", "macro-and-sequence"],
)  # fmt: skip
def test_a_duckdb_file_with_nothing_in_main_is_not_taken_for_empty(world, tmp_path, ddl):
    """A DuckDB file whose tables live in another schema (or that holds only macros and sequences)
    looked empty to the check, which listed main's tables only: register wrote the whole mergedb
    schema into it, beside the user's (review, 2026-12-02). Refused and left unchanged now."""
    _, fam, _, _ = world
    other = tmp_path / "other.duckdb"
    con = duckdb.connect(str(other))
    con.execute(ddl)
    con.close()
    before = _digest(other)
    for name, call in _calls(Catalog(other), fam).items():
        with pytest.raises(CatalogError, match="is a DuckDB file but not a mergedb catalog"):
            call()
        assert _digest(other) == before, name


def test_a_catalog_another_process_is_creating_is_waited_for_not_refused(tmp_path):
    """A file without DuckDB's header yet, modified within the last second: another process is making
    the catalog (a second registration into the same new catalog was told "not a DuckDB file" in 4 of
    190 tries of a review, or could remove it as a 0-byte leftover). It is waited for (up to a second);
    an old one is judged at once, as before."""
    import threading
    import time

    from mergedb.synth import simulate

    good = tmp_path / "good.duckdb"
    simulate(Catalog(good), 2, 1, 2)
    data = good.read_bytes()
    path = tmp_path / "c.duckdb"
    for start in (b"", data[:8]):  # nothing written yet; DuckDB's header half written
        path.write_bytes(start)
        maker = threading.Timer(0.3, path.write_bytes, [data])
        maker.start()
        assert len(Catalog(path).checkpoints()) == 3
        maker.join()
        path.unlink()
    for start, words in ((b"", "is an empty file"), (b"not a database", "is not a DuckDB file")):
        path.write_bytes(start)
        os.utime(path, (time.time() - 60,) * 2)
        t0 = time.monotonic()
        with pytest.raises(CatalogError, match=words):
            Catalog(path).checkpoints()
        assert time.monotonic() - t0 < 0.5


def test_empty_files_and_non_duckdb_files_refused(world, tmp_path):
    _, fam, _, _ = world
    zero = tmp_path / "zero.duckdb"
    zero.touch()
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"not a database\n" * 500)
    empty_db = tmp_path / "empty.duckdb"
    duckdb.connect(str(empty_db)).close()  # a valid DuckDB file with no tables at all
    before = _digest(tmp_path)
    cases = [(zero, "is an empty file, not a mergedb catalog"), (junk, "is not a DuckDB file")]
    for path, phrase in cases:
        for name, call in _calls(Catalog(path), fam).items():
            if path == zero and name == "register":
                continue  # a 0-byte file holds nothing: register makes a catalog there (below)
            with pytest.raises(CatalogError, match=phrase):
                call()
    for name, call in _calls(Catalog(empty_db), fam).items():
        if name == "register":
            continue  # an empty DuckDB file is where register may create a catalog
        with pytest.raises(CatalogError, match="empty DuckDB file, not a mergedb catalog yet"):
            call()
    assert _digest(tmp_path) == before
    res = Catalog(empty_db).register([fam], base_model="base", block_size="32KiB")
    assert set(res.registered) == {"base", "expert_00", "expert_01"}
    # a 0-byte file (a creation cut before DuckDB wrote its header, e.g. by SIGKILL): register makes the catalog
    res = Catalog(zero).register([fam], base_model="base", block_size="32KiB")
    assert set(res.registered) == {"base", "expert_00", "expert_01"}


def test_only_register_creates_a_catalog(world, tmp_path):
    _, fam, _, _ = world
    missing = tmp_path / "new.duckdb"
    for name, call in _calls(Catalog(missing), fam).items():
        if name in ("register", "ls"):
            continue
        with pytest.raises(CatalogError, match=r"no catalog at .*new.duckdb; create one with `mergedb register"):
            call()
        assert not missing.exists(), name
    Catalog(missing).register([fam], base_model="base", block_size="32KiB")
    assert Catalog(missing).plan(TIES).plan_id == 1


# -- items 11 and 17, csv line ends: printing results ------------------------------------------


def test_duplicate_column_names_print_their_own_values(world):
    _, _, cat, _ = world
    q = "SELECT c.name, b.name FROM checkpoints c JOIN checkpoints b ON b.checkpoint_id = c.base_id ORDER BY c.name"
    db = str(cat.path)
    res = runner.invoke(app, ["sql", q, "-c", db, "-f", "csv"])
    assert res.exit_code == 0, res.output
    assert res.output == "name,name\nexpert_00,base\nexpert_01,base\n"  # \n line ends, not \r\n
    res = runner.invoke(app, ["sql", q, "-c", db, "-f", "json"])
    assert json.loads(res.output) == [
        {"name": "expert_00", "name_2": "base"},
        {"name": "expert_01", "name_2": "base"},
    ]
    res = runner.invoke(app, ["sql", q, "-c", db])
    lines = [ln for ln in res.output.splitlines() if "expert_0" in ln]
    assert len(lines) == 2 and all("base" in ln for ln in lines), res.output


def test_values_python_cannot_hold_print_as_duckdb_text(world):
    _, _, cat, _ = world
    q = "SELECT 'infinity'::DATE AS d, '-infinity'::TIMESTAMP AS t, DATE '2024-01-02' AS ok, 7 AS n"
    from mergedb.usersql import table_rows  # imported here so the other tests run on older code too

    assert table_rows(cat.sql(q)) == [("infinity", "-infinity", datetime.date(2024, 1, 2), 7)]
    db = str(cat.path)
    res = runner.invoke(app, ["sql", q, "-c", db, "-f", "csv"])
    assert res.exit_code == 0 and res.output == "d,t,ok,n\ninfinity,-infinity,2024-01-02,7\n", res.output
    res = runner.invoke(app, ["sql", q, "-c", db, "-f", "json"])
    assert json.loads(res.output) == [{"d": "infinity", "t": "-infinity", "ok": "2024-01-02", "n": 7}]
    res = runner.invoke(app, ["sql", q, "-c", db])
    assert res.exit_code == 0 and "infinity" in res.output and "-infinity" in res.output, res.output


# -- item 12: a damaged catalog is reported as damaged, with the way out ------------------------


def _damaged_copies(cat: Catalog, tmp_path: Path) -> dict[str, Path]:
    size = cat.path.stat().st_size
    truncated = tmp_path / "truncated.duckdb"
    shutil.copy(cat.path, truncated)
    os.truncate(truncated, size // 2)
    flipped = tmp_path / "flipped.duckdb"  # 64 inverted bytes every 16 KiB past the file headers
    shutil.copy(cat.path, flipped)
    with open(flipped, "r+b") as f:
        for off in range(12288 + 512, size, 16384):
            f.seek(off)
            chunk = f.read(64)
            f.seek(off)
            f.write(bytes(b ^ 0xFF for b in chunk))
    return {"truncated": truncated, "flipped": flipped}


def test_damaged_catalog_reported_with_recovery(world, tmp_path):
    _, fam, cat, _ = world
    for kind, path in _damaged_copies(cat, tmp_path).items():
        msg = "is damaged"
        res = runner.invoke(app, ["check", "-c", str(path)])
        _clean_failure(res, msg, "restore it from a backup", "mergedb register")
        commands = [
            ["sql", "SELECT sum(delta_norm) FROM expert_blocks"],
            ["ls"],
            ["plans"],
            ["show", "expert_00"],
            ["show-plan", "1"],
            ["plan", "--base", "base", "--all", "-m", "ties"],
        ]
        for cmd in commands:  # each fails as damaged, or works if it reads no damaged block
            res = runner.invoke(app, [*cmd, "-c", str(path)])
            assert "Traceback" not in res.output and isinstance(res.exception, (SystemExit, type(None))), (kind, cmd)
            if res.exit_code:
                assert msg in res.output, (kind, cmd, res.output)


# -- item 13: unwritable or full catalog folders say so --------------------------------------


def test_catalog_in_a_path_that_is_not_a_folder(world, tmp_path):
    _, fam, _, _ = world
    (tmp_path / "afile").write_text("x")
    cat = Catalog(tmp_path / "afile" / "c.duckdb")  # the parent is a regular file: fails even as root
    with pytest.raises(
        CatalogError, match="read-only or not a folder.*pass --catalog with a path in a writable folder"
    ):
        cat.register([fam], base_model="base")
    with pytest.raises(CatalogError, match="no catalog at"):
        cat.plan(TIES)


@pytest.mark.parametrize("limit", [12288, 16384, 65536])
def test_file_size_limit_while_creating_catalog_reports_the_cause(world, tmp_path, limit):
    _, fam, _, _ = world
    db = tmp_path / "c.duckdb"

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = CLI + ["register", str(fam), "--base-model", "base", "-q", "-c", str(db)]
    res = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cap)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and "no transaction is active" not in res.stderr, res.stderr
    assert "disk is full or a size limit was reached" in res.stderr and "File too large" in res.stderr
    if db.exists():  # the failure came after the catalog was made: it is a valid, empty catalog
        assert Catalog(db).checkpoints() == []
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert [c.name for c in Catalog(db).checkpoints()] == ["base", "expert_00", "expert_01"]


# -- item 19: names are unique per catalog; --refresh only re-scans the same path -------------


def test_same_name_from_another_folder_or_base_refused(world, tmp_path):
    _, fam, cat, _ = world
    db = tmp_path / "c.duckdb"
    shutil.copy(cat.path, db)
    mine = Catalog(db)
    other = synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=99)
    before = _digest(db)
    for refresh in (False, True):
        with pytest.raises(CatalogError, match=r"'expert_00' is already registered from .*--name NEW"):
            mine.register([other / "expert_00"], base_model="base", refresh=refresh)
        assert _digest(db) == before
    mine.register([other / "base"], base=True, name="base2")
    before = _digest(db)
    for refresh in (False, True):
        with pytest.raises(CatalogError, match="registered with base 'base', not 'base2'.*--name NEW"):
            mine.register([fam / "expert_00"], base_model="base2", refresh=refresh)
        assert _digest(db) == before
    assert mine.checkpoint("expert_00").path == str((fam / "expert_00").resolve())
    res = mine.register([other / "expert_00"], base_model="base2", name="other_00")
    assert res.registered == ("other_00",)


@pytest.mark.parametrize(
    "bad", ["", "  ", "a,b", " lead", "trail ", "tab\there", "nl\nx", "del\x7f", "\u200b", "\u200b\u2060"]
)
def test_unaddressable_names_refused(tiny_family, tmp_path, bad):
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tiny_family / "base"], base=True)
    with pytest.raises(MergeDBError, match="pass --name NAME"):
        cat.register([tiny_family / "expert_00"], base_model="base", name=bad)
    if bad.strip() and "/" not in bad and "\x00" not in bad:
        folder = tmp_path / "odd" / bad
        shutil.copytree(tiny_family / "expert_00", folder)
        with pytest.raises(MergeDBError, match="pass --name NAME"):
            cat.register([folder], base_model="base")
        assert cat.register([folder], base_model="base", name="fine").registered == ("fine",)
    assert [c.name for c in cat.checkpoints()] in (["base"], ["base", "fine"])


# -- item 21: plan names never shadow ids or hash prefixes -----------------------------------


def test_plan_names_that_look_like_ids_or_hashes_refused(world, tmp_path):
    _, _, cat, _ = world
    db = tmp_path / "c.duckdb"
    shutil.copy(cat.path, db)
    mine = Catalog(db)
    before = _digest(db)
    for bad in ("1", "42", "abcdef", "DEADBEEF01", " x", ""):
        with pytest.raises(PlanError, match="plan name"):
            mine.plan(PlanRequest("base", None, "ties", "40%", params={"density": 0.3}, name=bad))
    assert _digest(db) == before
    p = mine.plan(PlanRequest("base", None, "ties", "40%", params={"density": 0.3}, name="ties-40"))
    assert mine.get_plan("ties-40").plan_id == p.plan_id


def test_resolve_plan_order_id_then_name_then_hash(world, tmp_path):
    _, _, cat, _ = world
    db = tmp_path / "c.duckdb"
    shutil.copy(cat.path, db)
    mine = Catalog(db)
    first = mine.get_plan(1)
    second = mine.plan(PlanRequest("base", None, "task_arithmetic", "30%"))
    # names an older mergedb let through: plan 2 named "1", then named like plan 1's hash prefix
    con = duckdb.connect(str(db))
    con.execute("UPDATE plans SET name = '1' WHERE plan_id = ?", [second.plan_id])
    con.close()
    assert mine.get_plan("1").plan_id == 1  # an exact id wins over a name
    con = duckdb.connect(str(db))
    con.execute("UPDATE plans SET name = ? WHERE plan_id = ?", [first.plan_hash[:8], second.plan_id])
    con.close()
    assert mine.get_plan(first.plan_hash[:8]).plan_id == second.plan_id  # an exact name wins over a prefix
    assert mine.get_plan(first.plan_hash[:10]).plan_id == 1
    assert mine.get_plan(second.plan_hash[:10]).plan_id == second.plan_id
    with pytest.raises(PlanError, match="no plan matching"):
        mine.get_plan("fffffffffffffffffff")
    # the same request planned twice shares its hash: the prefix names both, and the message their ids
    # (it said "several plans matching …; `mergedb plans` lists them", whose hash column cannot tell them apart)
    again = mine.plan(PlanRequest("base", None, "task_arithmetic", "30%"))
    assert again.plan_hash == second.plan_hash
    with pytest.raises(
        PlanError, match=rf"several plans match .* \(ids {second.plan_id}, {again.plan_id}\); give one by"
    ):
        mine.get_plan(second.plan_hash[:10])


def test_results_too_large_for_memory_say_what_to_do():
    """Arrow's and Python's copies of a result are outside DuckDB's memory limit: running out of
    memory there raised MemoryError, and DuckDB's 2 GB string limit advised a SET the sandbox refuses."""
    import duckdb

    from mergedb import usersql

    class Column:
        def to_pylist(self):
            raise MemoryError

    with pytest.raises(MergeDBError, match="does not fit in memory: add a LIMIT"):
        usersql.table_rows(type("Table", (), {"columns": [Column()]})())
    err = usersql.sql_error(duckdb.InvalidInputException("… exceeds this. * SET arrow_large_buffer_size=true to use …"))
    assert "SET" not in str(err) and "more than 2 GB" in str(err) and "add a LIMIT" in str(err)


def test_ctrl_c_stops_a_long_query_from_python(tmp_path):
    """A program calling Catalog.sql gets KeyboardInterrupt soon after Ctrl-C (a SIGINT sent to the
    main thread 0.5 to 2 s into the query), not when the minute-long join ends; the catalog is
    closed and answers the next query."""
    import signal
    import threading
    import time

    from mergedb.synth import simulate

    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)
    main = threading.main_thread().ident
    for after in (0.5, 1.0, 1.5, 2.0):
        timer = threading.Timer(after, lambda: signal.pthread_kill(main, signal.SIGINT))
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            cat.sql("SELECT count(*) FROM range(3000000000) a(x) JOIN range(1000) b(y) ON x % 1000 = y")
        assert time.monotonic() - start < after + 5, after
        assert cat.sql("SELECT count(*) AS n FROM checkpoints").column("n").to_pylist() == [3]


JOIN = "SELECT count(*) FROM range(3000000000) a(x) JOIN range(1000) b(y) ON x % 1000 = y"  # ~30-60 s


def _sigint_main_in(seconds: float) -> None:
    import signal
    import threading

    main = threading.main_thread().ident
    threading.Timer(seconds, lambda: signal.pthread_kill(main, signal.SIGINT)).start()


@pytest.mark.parametrize("after_start", [False, True])
def test_ctrl_c_as_the_query_thread_starts_leaves_a_closable_catalog(tmp_path, monkeypatch, after_start):
    """Ctrl-C while the query's thread is being started (here: raised by Thread.start, before or
    after the thread exists): the query was left running on a connection then closed under it
    (ResourceInUseException, or an abort). Now the statement never runs or is interrupted, and the
    catalog answers the next query at once."""
    import threading
    import time

    from mergedb import usersql
    from mergedb.synth import simulate

    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)

    class Interrupted(threading.Thread):
        def start(self):
            if after_start:
                super().start()
            raise KeyboardInterrupt

    monkeypatch.setattr(usersql.threading, "Thread", Interrupted)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cat.sql(JOIN)
    monkeypatch.undo()
    assert cat.sql("SELECT count(*) AS n FROM checkpoints").column("n").to_pylist() == [3]
    assert time.monotonic() - start < 10


def test_ctrl_c_before_duckdb_runs_the_statement_is_not_forgotten(tmp_path):
    """DuckDB forgets an interrupt that comes before its query executes; a Ctrl-C in that window (here
    widened to 0.3 s by a sleep before the statement) went unseen until the minute-long join ended.
    The interrupt is now repeated until the statement's thread ends."""
    import time

    import duckdb

    from mergedb import usersql

    con = duckdb.connect()

    def work():
        time.sleep(0.3)
        return con.sql(JOIN).to_arrow_table()

    _sigint_main_in(0.1)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        usersql.interruptibly(con, work)
    assert time.monotonic() - start < 5
    con.close()  # not busy: the statement's thread has let go of it


def test_a_second_ctrl_c_while_stopping_gives_no_traceback(tmp_path):
    """Two Ctrl-C a fraction of a millisecond apart: the second one cut the wait for the query's
    thread short, and closing the still-busy connection raised ResourceInUseException. Now one
    KeyboardInterrupt and a catalog that answers."""
    import time

    from mergedb.synth import simulate

    cat = Catalog(tmp_path / "c.duckdb")
    simulate(cat, 2, 1, 2)
    for first in (0.5, 1.0):
        _sigint_main_in(first)
        _sigint_main_in(first + 0.0002)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            cat.sql(JOIN)
        assert time.monotonic() - start < first + 5
        try:
            time.sleep(0.2)  # a second signal that came after the first was raised lands here
        except KeyboardInterrupt:
            pass
        assert cat.sql("SELECT count(*) AS n FROM checkpoints").column("n").to_pylist() == [3]
