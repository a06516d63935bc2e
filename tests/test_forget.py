"""`mergedb forget`: an expert deleted from the disk leaves the catalog without a trace, its plans
only when asked; a refused call changes nothing (review, 2026-12-03: there was no way out but a
new catalog, every `plan --all` kept the gone expert and `check` reported it for good)."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.check import check_catalog
from mergedb.cli import app
from mergedb.errors import CatalogError, MergeDBError, PlanError
from mergedb.planner import PlanRequest
from tests.test_bad_input import snapshot

runner = CliRunner()


@pytest.fixture
def world(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=12)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    every = cat.plan(PlanRequest("base", None, "ties", "50%", name="every"))
    two = cat.plan(PlanRequest("base", ("expert_00", "expert_01"), "task_arithmetic", name="two"))
    cat.execute(every.plan_id, tmp_path / "out-every")
    cat.record_score("every", "loss", 1.5)
    return fam, cat, every, two


def _n(cat: Catalog, table: str) -> int:
    return cat.sql(f"SELECT count(*) AS n FROM {table}").column("n")[0].as_py()


def test_an_expert_deleted_from_disk_is_forgotten_with_its_plans(world, tmp_path):
    fam, cat, every, two = world
    shutil.rmtree(fam / "expert_02")
    assert any(p.where == "checkpoint expert_02" for p in check_catalog(cat))
    before = snapshot(cat)
    with pytest.raises(CatalogError, match=r"1 stored plan \(1\) merges it .* pass --with-plans"):
        cat.forget(["expert_02"])
    assert snapshot(cat) == before
    res = cat.forget(["expert_02"], with_plans=True)
    assert (res.checkpoints, res.plans) == (("expert_02",), (every.plan_id,))
    assert check_catalog(cat, deep=True) == []  # no orphaned row, nothing missing
    assert [c.name for c in cat.checkpoints()] == ["base", "expert_00", "expert_01"]
    assert [p.plan_id for p in cat.plans()] == [two.plan_id] and _n(cat, "runs") == 0 and _n(cat, "scores") == 0
    again = cat.plan(PlanRequest("base", None, "ties", "50%"))  # --all no longer names the gone expert
    assert [e.name for e in again.experts] == ["expert_00", "expert_01"]
    cat.execute(two.plan_id, tmp_path / "out-two")  # a plan without it is untouched
    assert (fam / "expert_00" / "model.safetensors").exists()  # no file touched


def test_a_base_goes_only_with_all_its_experts(world):
    fam, cat, _, _ = world
    before = snapshot(cat)
    with pytest.raises(CatalogError, match=r"base 'base' has experts not named here \(expert_02\)"):
        cat.forget(["base", "expert_00", "expert_01"], with_plans=True)
    for bad, words in (
        (["nope"], "no checkpoint named 'nope'"),
        ("expert_00", "a list of checkpoint names"),
        ([], "a list of checkpoint names"),
        (5, "a list of checkpoint names"),  # a bare TypeError
        ((n for n in ["expert_02"]), "a list of checkpoint names"),  # used up by the check: forgot nothing, said ok
    ):
        with pytest.raises(MergeDBError, match=words):
            cat.forget(bad)
    with pytest.raises(MergeDBError, match="with_plans is True or False"):  # "no" removed the plans (embed review)
        cat.forget(["expert_02"], with_plans="no")
    assert snapshot(cat) == before
    res = cat.forget(["expert_02", "base", "expert_00", "expert_01", "base"], with_plans=True)
    assert res.checkpoints == ("expert_02", "base", "expert_00", "expert_01") and len(res.plans) == 2
    assert cat.checkpoints() == [] and check_catalog(cat) == []
    assert all(_n(cat, t) == 0 for t in ("blocks", "family_tensors", "expert_blocks", "files", "plan_mask_bits"))
    assert cat.register([fam], base_model="base").registered == ("base", "expert_00", "expert_01", "expert_02")


def test_cli_forget(world):
    _, cat, every, _ = world
    r = runner.invoke(app, ["forget", "expert_02", "-c", str(cat.path)])
    assert r.exit_code == 1 and "--with-plans" in r.output, r.output
    r = runner.invoke(app, ["forget", "expert_02", "--with-plans", "-c", str(cat.path)])
    assert r.exit_code == 0 and f"forgot expert_02 and 1 plan ({every.plan_id}); no file was touched" in r.output


def test_a_run_is_not_recorded_against_a_new_plan_that_took_the_forgotten_ones_id(world, tmp_path):
    """Plan ids are max + 1: a plan forgotten while it was executed gives its id to the next plan made,
    and the run was recorded as an ok run of that other plan, which `check` then passed (concurrency
    review). The run's plan hash is compared now: the output is complete, its run not recorded."""
    from mergedb.errors import RunNotRecordedError

    fam, cat, every, two = world
    done = []

    def progress(_n):
        if not done:  # mid-merge, another process forgets the plan and plans something else
            other = Catalog(cat.path)
            other.forget(["expert_02"], with_plans=True)
            done.append(other.plan(PlanRequest("base", ("expert_00",), "linear", name="new")))

    last = cat.plan(PlanRequest("base", None, "task_arithmetic", name="last"))  # the highest id: the next plan's
    runs = _n(cat, "runs")
    with pytest.raises(RunNotRecordedError, match=r"complete and good.*another plan now.*forgotten meanwhile"):
        cat.execute(last.plan_id, tmp_path / "o", progress=progress)
    assert done[0].plan_id == last.plan_id  # the id was taken, or this tests nothing
    assert _n(cat, "runs") == runs - 1  # `every`'s run went with it; none added
    assert check_catalog(cat) == []


def test_a_score_by_summary_is_not_given_to_the_plan_that_took_a_forgotten_ones_id(world):
    """record_score(plan.plan_id, …), as the README's search loop wrote it, scored whatever plan held
    that id after a `forget --with-plans` and a new plan (search review). The README and the example
    pass the summary, checked by its hash; its refusal now says the plan may have been forgotten."""
    fam, cat, every, two = world
    last = cat.plan(PlanRequest("base", None, "task_arithmetic", name="last"))  # the highest id
    cat.forget(["expert_02"], with_plans=True)
    other = cat.plan(PlanRequest("base", ("expert_00",), "linear", name="other"))
    assert other.plan_id == last.plan_id  # the id was taken, or this tests nothing
    scores = _n(cat, "scores")
    with pytest.raises(PlanError, match=r"not the plan summarised .* or forgotten since .*another plan's"):
        cat.record_score(last, "loss", 0.25)
    assert _n(cat, "scores") == scores
