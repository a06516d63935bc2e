"""What the commands print, as a pipe or a program reads it (found by a review helper): no value
cut to fit 80 columns, JSON that JSON parsers accept, numbers as numbers, a report line never
folded inside a path, machine formats that carry what the table shows, and paths holding rich
markup printed as they are."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.planner import PlanRequest


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep-folder-name-to-make-paths-long-" + "x" * 40)
    fam = synth.make_family(root / "fam", experts=2, size="tiny", seed=1)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "dare_ties", "50%", seed=7))
    return root, cat, plan


def run(*args: str, columns: int = 80) -> str:
    res = CliRunner(env={"COLUMNS": str(columns)}).invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


def test_tables_never_cut_a_value(world):
    root, cat, _ = world
    values = [f"{c * 7}{i}" for i, c in enumerate("abcdefgh", 1)]
    text = run("sql", "SELECT " + ", ".join(f"'{v}' AS c{i}" for i, v in enumerate(values)), "-c", cat.path)
    assert all(v in text for v in values), text  # rich cropped 4 of 8 when the width was misjudged
    narrow = run("ls", "-c", cat.path, columns=40)
    assert str(root / "fam" / "expert_00") in narrow  # the one-record view has room for the whole path


def test_json_is_json_and_numbers_are_numbers(world):
    root, cat, _ = world
    query = "SELECT 'nan'::DOUBLE AS x, 'inf'::DOUBLE AS y, sum(nbytes) AS n FROM blocks"
    doc = json.loads(run("sql", query, "-c", cat.path, "-f", "json"), parse_constant=lambda c: pytest.fail(c))
    n = cat.sql("SELECT sum(nbytes)::BIGINT AS n FROM blocks").column("n")[0].as_py()
    assert doc == [{"x": None, "y": None, "n": n}]  # HUGEINT came out as the string "…"
    rows = list(csv.reader(io.StringIO(run("sql", "SELECT [1, 2] AS l, {'k': 'ü'} AS s", "-c", cat.path, "-f", "csv"))))
    assert rows == [["l", "s"], ["[1, 2]", '{"k": "\\u00fc"}']]  # JSON text, not Python's repr


def test_csv_quotes_a_carriage_return_so_rows_read_back_whole(world):
    """A field holding a bare \r (a checkpoint path may) was written unquoted, so csv.reader and
    DuckDB's read_csv split its row (review, 2026-12-03). Lines still end in \n."""
    root, cat, _ = world
    text = run(
        "sql", "SELECT 'a' || chr(13) || 'b' AS v, 'c' || chr(10) || 'd' AS w, 1 AS n", "-c", cat.path, "-f", "csv"
    )
    assert list(csv.reader(io.StringIO(text, newline=""))) == [["v", "w", "n"], ["a\rb", "c\nd", "1"]]
    assert text.endswith('"c\nd",1\n') and "\r\n" not in text


def test_bits_blobs_and_intervals_print_as_what_they_say(world):
    """A plan's mask bits (BIT) came out as the hex of DuckDB's encoding (a 32-block tensor's as
    '00a19104af', which reads like another bit string), a BLOB in CSV inside literal quotes, an INTERVAL
    as a JSON triple (review, 2026-12-02). Now the bit string, plain hex, the interval's text."""
    root, cat, plan = world
    query = "SELECT '1011'::BIT AS b, '\\xAA'::BLOB AS x, INTERVAL 3 DAY AS i, 1 AS n"
    doc = json.loads(run("sql", query, "-c", cat.path, "-f", "json"))
    assert doc == [{"b": "1011", "x": "aa", "i": "3 days", "n": 1}]
    rows = list(csv.reader(io.StringIO(run("sql", query, "-c", cat.path, "-f", "csv"))))
    assert rows == [["b", "x", "i", "n"], ["1011", "aa", "3 days", "1"]]
    bits = cat.sql(
        "SELECT selected, selected::VARCHAR AS want FROM plan_mask_bits WHERE plan_id = $1", [plan.plan_id]
    ).to_pylist()
    assert bits and all(r["selected"] == r["want"] and set(r["want"]) <= {"0", "1"} for r in bits)


def test_machine_formats_carry_what_the_table_shows(world, tmp_path):
    root, cat, plan = world
    doc = json.loads(run("show-plan", plan.plan_id, "-c", cat.path, "-f", "json"))
    assert doc["seed"] == 7 and doc["n_selected"] == plan.n_selected and doc["strategy"] == "ranked"
    kept = json.loads(
        run("frontier", "--base", "base", "-m", "linear", "--keep", "--name", "fr", "-c", cat.path, "-f", "json")
    )
    assert [cat.get_plan(r["plan_id"]).name for r in kept] == [f"fr@{r['budget']}" for r in kept]
    grid = ["--base", "base", "--all", "-m", "linear", "--grid", "budget=10%,20%", "--out", tmp_path / "sw"]
    swept = json.loads(run("sweep", *grid, "-c", cat.path, "-f", "json"))
    assert [Path(r["out"]).parent for r in swept] == [tmp_path / "sw"] * 2
    assert all(Path(r["out"]).is_dir() for r in swept)
    yml = run("show-plan", plan.plan_id, "-c", cat.path, "-f", "mergekit")
    assert "mergekit reads them all: this config is the plan's full-read merge" in yml and "seed 7" in yml


def test_report_lines_are_whole_and_markup_is_text(world, tmp_path):
    root, cat, plan = world
    out = tmp_path / "[/tmp]" / ("o" * 90)  # a path rich would read as a closing tag
    text = run("execute", plan.plan_id, "--out", out, "-c", cat.path)
    assert f"wrote {out}:" in text
    checked = run("check", "--output", out, "-c", cat.path)
    assert checked.strip() == "ok: catalog and outputs verified"
    assert "loss = 123456789.123" in run("score", plan.plan_id, "loss", "123456789.123", "-c", cat.path)


def test_a_plans_header_and_its_sql_stay_on_their_lines_in_a_pipe(world):
    """In a pipe (80 columns) the plan's first line was folded, splitting its hash onto a line of its
    own (README shows it whole; scripts grep it), and --explain folded SQL comments, so that the
    printed SQL no longer parsed."""
    root, cat, plan = world
    text = run("plan", "--base", "base", "--all", "-m", "ties", "-b", "25%", "--explain", "-c", cat.path)
    header = next(ln for ln in text.splitlines() if ln.startswith("plan "))
    assert "hash " in header and len(header.split("hash ")[1].strip()) == 16, header
    import duckdb

    parts, current = [], []
    for ln in text.splitlines():  # each explained step's SQL, from its '-- step' line to the next
        if ln.startswith("-- ") and ": " in ln and ln.rstrip().endswith("rows"):
            if current:
                parts.append("\n".join(current))
            current = []
        elif ln.startswith("plan "):
            break
        else:
            current.append(ln)
    parts.append("\n".join(current))
    sql = [p for p in parts if "SELECT" in p.upper()]
    assert sql
    for statement in sql:  # each still parses as the SQL it is (a folded comment line would not)
        duckdb.connect().extract_statements(statement)


def test_no_progress_is_drawn_into_a_pipe(world, tmp_path):
    """A progress bar is for a terminal: into a pipe, rich still wrote an empty line to stderr at the
    end of every register and execute (and before an error's line)."""
    import subprocess
    import sys

    root, cat, plan = world
    cmd = [sys.executable, "-m", "mergedb.cli", "execute", str(plan.plan_id), "--out", str(tmp_path / "o"), "-c"]
    res = subprocess.run([*cmd, str(cat.path)], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", repr(res.stderr)
    assert res.stdout.startswith("wrote ")


def test_register_says_which_checkpoints_moved(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=2)
    db = tmp_path / "c.duckdb"
    run("register", fam, "--base-model", "base", "-c", db)
    shutil.move(fam, tmp_path / "moved")
    out = run("register", tmp_path / "moved", "--base-model", "base", "-c", db)
    assert "registered 0 (-), unchanged 2 (moved here: base, expert_00); read 0 B" in out, out


def test_a_table_stops_at_its_row_cap_and_says_how_to_get_every_row(world):
    """Rich laid out every row: `mergedb sql` of a million rows as a table took 226 s (csv 2.4 s).
    A table shows the first render.TABLE_ROWS rows and says how many it left out; csv prints all."""
    from mergedb import render

    _, cat, _ = world
    n = render.TABLE_ROWS + 7
    query = f"SELECT range AS i FROM range({n})"
    lines = run("sql", query, "-c", cat.path).splitlines()
    shown = [ln.strip() for ln in lines if ln.strip().isdigit()]
    assert shown == [str(i) for i in range(render.TABLE_ROWS)]
    assert lines[-1].startswith("… 7 more rows") and "--format csv" in lines[-1], lines[-1]
    every = list(csv.reader(io.StringIO(run("sql", query, "-c", cat.path, "-f", "csv"))))
    assert every == [["i"], *([str(i)] for i in range(n))]
    assert "more rows" not in run("sql", f"SELECT range AS i FROM range({render.TABLE_ROWS})", "-c", cat.path)


def test_show_caps_its_table_without_advice_about_queries(world, monkeypatch):
    """show's per-tensor table (a mixture-of-experts checkpoint has thousands) said to narrow "the query
    with WHERE or LIMIT", which show has none of (review of the cap)."""
    from mergedb import render

    _, cat, _ = world
    monkeypatch.setattr(render, "TABLE_ROWS", 5)
    last = run("show", "expert_00", "-c", cat.path).splitlines()[-1]
    assert last.startswith("… ") and "more rows" in last and "--format csv" in last and "WHERE" not in last, last
