"""`mergedb frontier`: bytes against bounds at a ladder of budgets, from the catalog alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergedb import Catalog, PlanRequest, synth
from mergedb.cli import app
from mergedb.frontier import BUDGETS as FRONTIER_BUDGETS

runner = CliRunner()


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontier")
    fam = synth.make_family(root / "fam", experts=3, size="tiny", seed=3)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base")
    return cat


def _n_plans(cat: Catalog) -> int:
    return cat.sql("SELECT count(*) AS n FROM plans").column("n")[0].as_py()


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_frontier_equals_plans_made_one_by_one_and_stores_nothing(catalog, method, tmp_path):
    req = PlanRequest("base", None, method, params={"density": 0.5} if method == "ties" else {})
    before = _n_plans(catalog)
    got = catalog.frontier(req)
    assert _n_plans(catalog) == before  # rolled back
    assert [p.budget_spec for p in got] == list(FRONTIER_BUDGETS)
    one = Catalog(tmp_path / "copy.duckdb")
    one.path.write_bytes(catalog.path.read_bytes())
    for p in got:
        q = one.plan(PlanRequest("base", None, method, p.budget_spec, params=req.params))
        assert (p.selected_bytes, p.full_bytes, p.n_selected) == (q.selected_bytes, q.full_bytes, q.n_selected)
        assert (p.bound_blockwise, p.bound_sum, p.bound_rounded) == (q.bound_blockwise, q.bound_sum, q.bound_rounded)
        assert p.est_error == q.est_error
        assert p.plan_hash == q.plan_hash
    sel = [p.selected_bytes for p in got]
    assert sel == sorted(sel)


def test_keep_stores_named_plans(catalog):
    before = _n_plans(catalog)
    got = catalog.frontier(PlanRequest("base", None, "task_arithmetic", name="ta"), ["10%", "50%"], keep=True)
    assert _n_plans(catalog) == before + 2
    assert [catalog.get_plan(f"ta@{b}").plan_id for b in ("10%", "50%")] == [p.plan_id for p in got]


def test_a_budget_listed_twice_is_named(catalog):
    """Kept and named, the second plan of a repeated budget collided with the first's name: 'a plan
    named ta@50% exists already', of a plan nobody had stored (review, 2026-12-02)."""
    from mergedb.errors import PlanError

    before = _n_plans(catalog)
    with pytest.raises(PlanError, match="budget '50%' is listed twice"):
        catalog.frontier(PlanRequest("base", None, "task_arithmetic", name="ta"), ["50%", "10%", "50%"], keep=True)
    assert _n_plans(catalog) == before


def test_cli_table_json_and_png(catalog, tmp_path):
    before = _n_plans(catalog)
    png = tmp_path / "f.png"
    res = runner.invoke(
        app, ["frontier", "--base", "base", "-m", "task_arithmetic", "-c", str(catalog.path), "--out", str(png)],
        env={"COLUMNS": "80"},
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and "nothing stored" in res.output
    data = png.read_bytes()
    assert len(data) > 0 and data[:8] == b"\x89PNG\r\n\x1a\n"
    res = runner.invoke(
        app, ["frontier", "--base", "base", "-m", "task_arithmetic", "-c", str(catalog.path), "-f", "json"]
    )
    rows = json.loads(res.output)
    want = catalog.frontier(PlanRequest("base", None, "task_arithmetic"))
    assert [r["selected_bytes"] for r in rows] == [p.selected_bytes for p in want]
    assert [r["est_error"] for r in rows] == [p.est_error for p in want]
    assert _n_plans(catalog) == before


def test_keep_with_a_bad_picture_path_stores_nothing(catalog, tmp_path):
    before = _n_plans(catalog)
    cases = [(tmp_path / "f.txt", "PNG"), (tmp_path / "no" / "f.png", "its folder does not exist")]
    # a folder not even root can write in: the plans were stored, then the picture refused (review, 2026-12-03)
    cases.append((Path("/proc/frontier.png"), "/proc/frontier.png: cannot write there"))
    for out, words in cases:
        res = runner.invoke(
            app,
            ["frontier", "--base", "base", "-m", "linear", "--keep", "--name", "kk", "-c", str(catalog.path),
             "--out", str(out)],
        )  # fmt: skip
        assert res.exit_code == 1 and words in res.output, res.output
    assert _n_plans(catalog) == before and not (tmp_path / "no").exists()


def test_png_needs_a_png_name(catalog, tmp_path):
    res = runner.invoke(
        app, ["frontier", "--base", "base", "-m", "linear", "-c", str(catalog.path), "--out", str(tmp_path / "f.jpg")]
    )
    assert res.exit_code == 1 and "PNG" in res.output


def test_candidates_read_beside_other_readers(catalog):
    """plan_candidates only reads: it opens the catalog read-only, so it runs while another process
    reads the catalog (it opened it read-write, which that reader's shared lock refused)."""
    import subprocess
    import sys

    req = PlanRequest("base", None, "ties", "all")
    want = catalog.plan_candidates(req)
    hold = (
        "import duckdb, sys, time; c = duckdb.connect(sys.argv[1], read_only=True); "
        "print('held', flush=True); time.sleep(60)"
    )
    reader = subprocess.Popen([sys.executable, "-c", hold, str(catalog.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "held"
        got = Catalog(catalog.path, wait=0).plan_candidates(req)
    finally:
        reader.kill()
        reader.wait()
    assert got.equals(want)


def test_cli_frontier_of_slerp_takes_t(catalog):
    """SLERP needs t, and frontier's refusal advised --t, which frontier did not take. With --t the
    rows are those of plans made with that t (and differ from another t's)."""
    args = ["frontier", "--base", "base", "-m", "slerp", "--experts", "expert_00", "-c", str(catalog.path)]
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "--t 0.5" in res.output, res.output
    rows = {}
    for t in ("0.3", "0.9"):
        res = runner.invoke(app, [*args, "--t", t, "--format", "json"])
        assert res.exit_code == 0, res.output
        rows[t] = json.loads(res.output)
        want = catalog.frontier(PlanRequest("base", ("expert_00",), "slerp", params={"t": float(t)}))
        assert [(r["budget"], r["bound"]) for r in rows[t]] == [(p.budget_spec, p.bound_rounded) for p in want]
    assert rows["0.3"] != rows["0.9"]


def test_plans_not_kept_have_no_id_to_run_by_mistake(catalog, tmp_path):
    """An unkept frontier's plans were rolled back, so the ids they carried went to the next plans
    stored: executing or scoring `frontier(...)[0].plan_id` ran another plan. They carry None now,
    which every plan lookup refuses; a kept plan's summary can be passed as it is."""
    from mergedb.errors import PlanError

    got = catalog.frontier(PlanRequest("base", None, "ties", params={"density": 0.5}), ["10%", "50%"])
    assert [p.plan_id for p in got] == [None, None]
    other = catalog.plan(PlanRequest("base", None, "linear"))
    for call in (
        lambda: catalog.execute(got[0].plan_id, tmp_path / "o"),
        lambda: catalog.execute(got[0], tmp_path / "o"),
        lambda: catalog.record_score(got[1], "loss", 1.0),
        lambda: catalog.get_plan(None),
    ):
        with pytest.raises(PlanError, match=r"no plan given \(None\).*keep=True"):
            call()
    assert not (tmp_path / "o").exists()
    assert catalog.get_plan(other) == other  # a stored plan's summary names it
    kept = catalog.frontier(PlanRequest("base", None, "linear"), ["all"], keep=True)[0]
    assert kept.plan_id is not None and catalog.get_plan(kept).plan_hash == other.plan_hash


def test_a_summary_from_another_catalog_is_not_taken_for_a_plan_of_this_one(catalog, tmp_path):
    """A PlanSummary names its plan by id, which another catalog may give to another plan: the hash
    must agree, or the lookup is refused."""
    from mergedb.errors import PlanError

    other = Catalog(tmp_path / "other.duckdb")
    other.path.write_bytes(catalog.path.read_bytes())
    mine = catalog.plan(PlanRequest("base", None, "ties", "50%", params={"density": 0.5}))
    theirs = other.plan(PlanRequest("base", None, "task_arithmetic", "50%"))
    assert mine.plan_id == theirs.plan_id and mine.plan_hash != theirs.plan_hash
    with pytest.raises(PlanError, match=rf"plan {mine.plan_id} of this catalog is not the plan summarised"):
        other.get_plan(mine)
    assert other.get_plan(theirs) == theirs


def test_a_bound_not_computed_for_the_written_output_is_shown_as_none(tmp_path):
    """Where the planner computes no bound on the written output (here: fp16 blocks whose norms pass
    fp16's largest value, "could overflow"), `plans`, `show-plan --format json` and the frontier showed
    the float32 block-wise bound under "bound on ‖θB−θF‖ of the written output", which the written
    output exceeded (review, 2026-12-03). They show none; the float32 one keeps its own name."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    base = {f"layers.{i}.w": (rng.uniform(-1000, 1000, (128, 128))).astype(np.float16) for i in range(2)}
    for name, ts in (("base", base), ("e0", {k: np.nextafter(v, np.float16(np.inf)) for k, v in base.items()})):
        (tmp_path / name).mkdir()
        save_file(ts, str(tmp_path / name / "model.safetensors"))
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "base"], base=True)
    cat.register([tmp_path / "e0"], base_model="base")
    p = cat.plan(PlanRequest("base", None, "task_arithmetic", "50%", name="half"))
    assert p.bound_rounded is None and "could overflow" in p.bound_note and p.bound_blockwise is not None
    for args in (["plans", "-f", "json"], ["show-plan", "half", "-f", "json"]):
        out = runner.invoke(app, [*args, "-c", str(cat.path)]).output
        doc = json.loads(out)
        rec = doc[0] if isinstance(doc, list) else doc
        assert rec["bound"] is None and rec.get("bound_blockwise", p.bound_blockwise) == p.bound_blockwise, rec
    from mergedb.frontier import records

    (r,) = records(cat.frontier(PlanRequest("base", None, "task_arithmetic"), ["50%"]))
    assert r["bound"] is None and r["bound_blockwise"] == p.bound_blockwise
